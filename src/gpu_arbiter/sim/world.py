"""The simulated world: holders that request leases, load, run, stop, on a virtual clock.

The world owns the clock (:class:`.clock.EventHeap`) and the ground truth: which
holder process sits on which GPU, in which phase. A policy
(:class:`.base.Allocator`) only decides. A holder's life::

    arrive --submit--> pending --grant--> loading --load_s--> running --run_s--> done
                                             |                   |
                                             +---- revoked ------+--> stopping --stop_s--> released
                                                                      (re-queued as a new attempt)
    done --keeps_warm--> idle --a request for its model--> running (no load)
                         idle --keep_alive_s--> released
                         idle --revoked--> stopping --stop_s--> released
    done --otherwise--> released

At every simulated time the world applies the due events, runs the policy's
``decide(now)`` once, carries its grants and revocations out and, with
``check``, asks the policy to verify its own books. For every policy alike it
counts physical over-commit (memory held by processes above a GPU's
capacity) and loads that start on a GPU while another load runs there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core import GpuId
from .base import Allocator, Attempt, Step
from .clock import EventHeap
from .cluster import Cluster
from .metrics import Recording, WaitSample
from .trace import TraceRequest

__all__ = ["Simulation"]

_Event = tuple[str, str, int]  # kind, key, version


@dataclass(slots=True)
class _Process:
    lease_id: str
    attempt: Attempt
    gpus: tuple[GpuId, ...]
    phase: str  # loading | running | idle | stopping
    since: float
    version: int = 0
    requeue: bool = False
    granted_at: float = 0.0

    @property
    def vram_mb(self) -> int:
        return self.attempt.item.vram_mb

    def same_model(self, attempt: Attempt) -> bool:
        """Whether ``attempt`` may run on this process's warm model: the same model, size,
        GPUs, constraints, priority and preemptibility (the lease is reused as it is)."""
        return _model_key(self.attempt.item) == _model_key(attempt.item)


def _model_key(item: TraceRequest) -> tuple[object, ...]:
    return (item.model, item.vram_mb, item.gpus, item.constraints, item.priority, item.preemptible)


class Simulation:
    """One policy over one trace on one cluster. :meth:`run` returns a :class:`Recording`."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        cluster: Cluster,
        allocator: Allocator,
        *,
        stop_s: float = 2.0,
        keep_alive_s: float = 300.0,
        check: bool = True,
        horizon_s: float | None = None,
    ) -> None:
        self.trace = list(trace)
        self.allocator = allocator
        self.stop_s = stop_s
        self.keep_alive_s = keep_alive_s
        self.check = check
        last = max((r.arrival_s for r in self.trace), default=0.0)
        self.horizon_s = horizon_s if horizon_s is not None else last + 86400.0
        self.capacity = cluster.capacity_mb()
        self.events: EventHeap[_Event] = EventHeap()
        self.pending: dict[str, Attempt] = {}
        self.procs: dict[str, _Process] = {}
        self.mem = dict.fromkeys(self.capacity, 0)
        self.loads = dict.fromkeys(self.capacity, 0)
        self.rec = Recording(
            policy=allocator.name, capacity_mb=sum(self.capacity.values()), window_s=last
        )
        self._tries: dict[int, int] = {}
        self._seq = 0
        self._wakes: set[float] = set()

    # ------------------------------------------------------------------ the loop

    def run(self) -> Recording:
        """Runs until nothing is left to happen, or ``horizon_s`` (default: a day after the
        last arrival) has passed; what has not finished by then counts as ``unfinished``."""
        for index, item in enumerate(self.trace):
            self.events.schedule(item.arrival_s, ("arrive", str(index), 0))
        while (now := self.events.next_time()) is not None and now <= self.horizon_s:
            for kind, key, version in self.events.pop_due(now):
                self._handle(kind, key, version, now)
            step = self.allocator.decide(now)
            self._apply(step, now)
            if self.check:
                present = {p.lease_id: p.gpus for p in self.procs.values()}
                self.rec.violations.extend(self.allocator.check(now, step, present))
            self.rec.steps += 1
            deadline = self.allocator.next_deadline()
            if deadline is not None and deadline > now and deadline not in self._wakes:
                self._wakes.add(deadline)
                self.events.schedule(deadline, ("wake", "", 0))
        end = max(self.events.next_time() or 0.0, self.rec.last_completion)
        for attempt in self.pending.values():  # never started: counted as waiting until the end
            waited = max(0.0, end - attempt.submitted_at)
            item = attempt.item
            self.rec.waits.append(WaitSample(item.priority, waited, waited, False, attempt.id))
        self.rec.unfinished = len(self.pending) + sum(
            p.phase in ("loading", "running") or p.requeue for p in self.procs.values()
        )
        return self.rec

    def _handle(self, kind: str, key: str, version: int, now: float) -> None:
        if kind == "arrive":
            self._arrive(int(key), now)
            return
        if kind == "wake":
            self._wakes.discard(now)
            return
        proc = self.procs.get(key)
        if proc is None or proc.version != version:
            return  # stale: the process moved on
        if kind == "loaded":
            self._loaded(proc, now)
        elif kind == "done":
            self._done(proc, now)
        elif kind == "stopped":
            self._free(proc, now)
            if proc.requeue:
                self._submit(self._attempt(proc.attempt.index, now), now)
        elif kind == "unload":
            self._free(proc, now)

    def _apply(self, step: Step, now: float) -> None:
        for lease_id, gpus in step.grants:
            self._grant(lease_id, gpus, now)
        for lease_id, _reason in step.revocations:
            self._revoke(self.procs[lease_id], now)

    # ------------------------------------------------------------------ holders

    def _arrive(self, index: int, now: float) -> None:
        attempt = self._attempt(index, now)
        warm = self._idle_for(attempt) if self.allocator.keeps_warm else None
        if warm is not None:
            self.allocator.set_idle(warm.lease_id, False, now)
            self._run(warm, attempt, now, warm_start=True)
        else:
            self._submit(attempt, now)

    def _attempt(self, index: int, now: float) -> Attempt:
        tries = self._tries.get(index, 0) + 1
        self._tries[index] = tries
        self._seq += 1
        attempt_id = f"r{index}" if tries == 1 else f"r{index}.{tries}"
        return Attempt(attempt_id, index, self.trace[index], now, self._seq)

    def _submit(self, attempt: Attempt, now: float) -> None:
        rejection = self.allocator.submit(attempt, now)
        if rejection is not None:
            self.rec.rejected.append(f"{attempt.id}: {rejection}")
        else:
            self.pending[attempt.id] = attempt

    def _idle_for(self, attempt: Attempt) -> _Process | None:
        idle = [p for p in self.procs.values() if p.phase == "idle" and p.same_model(attempt)]
        return max(idle, key=lambda p: (p.since, p.lease_id), default=None)

    def _grant(self, lease_id: str, gpus: tuple[GpuId, ...], now: float) -> None:
        attempt = self.pending.pop(lease_id)
        proc = _Process(lease_id, attempt, gpus, "loading", now, granted_at=now)
        self.procs[lease_id] = proc
        for gpu_id in gpus:
            if self.loads[gpu_id]:
                self.rec.count("concurrent_loads", str(gpu_id))
            self.loads[gpu_id] += 1
            self.rec.max_loads = max(self.rec.max_loads, self.loads[gpu_id])
            self.mem[gpu_id] += proc.vram_mb
            if self.mem[gpu_id] > self.capacity[gpu_id]:
                self.rec.count("overcommits", str(gpu_id))
        self.rec.change(now, held=proc.vram_mb * len(gpus), busy=proc.vram_mb * len(gpus))
        self.rec.loads_started += 1
        self.events.schedule(now + attempt.item.load_s, ("loaded", lease_id, proc.version))

    def _loaded(self, proc: _Process, now: float) -> None:
        for gpu_id in proc.gpus:
            self.loads[gpu_id] -= 1
        self.allocator.ready(proc.lease_id, now)
        self._run(proc, proc.attempt, now, warm_start=False)

    def _run(self, proc: _Process, attempt: Attempt, now: float, *, warm_start: bool) -> None:
        if proc.phase == "idle":
            total = proc.vram_mb * len(proc.gpus)
            self.rec.change(now, held=0, busy=total, idle=-total)
        if warm_start:
            proc.granted_at = now
        proc.attempt = attempt
        proc.phase = "running"
        proc.since = now
        proc.version += 1
        item = attempt.item
        self.rec.waits.append(
            WaitSample(
                item.priority,
                now - attempt.submitted_at,
                proc.granted_at - attempt.submitted_at,
                warm_start,
                attempt.id,
            )
        )
        self.rec.warm_starts += warm_start
        self.events.schedule(now + item.run_s, ("done", proc.lease_id, proc.version))

    def _done(self, proc: _Process, now: float) -> None:
        item = proc.attempt.item
        self.rec.completed += 1
        self.rec.work_gpu_s += item.run_s * item.gpus
        self.rec.last_completion = now
        if not self.allocator.keeps_warm:
            self._free(proc, now)
            return
        waiting = [a for a in self.pending.values() if proc.same_model(a)]
        if waiting:  # a request for this very model is queued: it takes the warm model
            attempt = min(waiting, key=lambda a: a.seq)
            self.allocator.cancel(attempt.id)
            del self.pending[attempt.id]
            self._run(proc, attempt, now, warm_start=True)
            return
        total = proc.vram_mb * len(proc.gpus)
        self.rec.change(now, held=0, busy=-total, idle=total)
        proc.phase = "idle"
        proc.since = now
        proc.version += 1
        self.allocator.set_idle(proc.lease_id, True, now)
        self.events.schedule(now + self.keep_alive_s, ("unload", proc.lease_id, proc.version))

    def _revoke(self, proc: _Process, now: float) -> None:
        if proc.phase == "stopping":
            return
        if proc.phase in ("loading", "running"):
            self.rec.preemptions += 1
            proc.requeue = True
            self.rec.change(now, held=0, busy=-proc.vram_mb * len(proc.gpus))
            if proc.phase == "running":
                self.rec.wasted_run_s += (now - proc.since) * proc.attempt.item.gpus
            else:
                for gpu_id in proc.gpus:
                    self.loads[gpu_id] -= 1
        else:
            self.rec.evictions += 1
            self.rec.change(now, held=0, busy=0, idle=-proc.vram_mb * len(proc.gpus))
        proc.phase = "stopping"
        proc.since = now
        proc.version += 1
        self.events.schedule(now + self.stop_s, ("stopped", proc.lease_id, proc.version))

    def _free(self, proc: _Process, now: float) -> None:
        busy = proc.phase in ("loading", "running")
        idle = proc.phase == "idle"
        if proc.phase == "loading":
            for gpu_id in proc.gpus:
                self.loads[gpu_id] -= 1
        for gpu_id in proc.gpus:
            self.mem[gpu_id] -= proc.vram_mb
        total = proc.vram_mb * len(proc.gpus)
        self.rec.change(now, held=-total, busy=-total if busy else 0, idle=-total if idle else 0)
        del self.procs[proc.lease_id]
        self.allocator.release(proc.lease_id, now)
