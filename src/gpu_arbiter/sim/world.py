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

With a policy that sleeps (:class:`.base.Sleeper`, its :class:`.base.SleepTier`)::

    idle --after_s--> sleeping --sleep_s--> asleep          (lease shrunk at once; the
                                                              memory given back at asleep)
    asleep --a request for its model--> wake_wait --grant of the difference--> waking
    waking --wake_s--> running                               (no cold load)
    wake_wait --load_s (as long as a cold load) without a grant--> stopping
                                                             (the request starts cold)
    sleeping, asleep --revoked--> stopping; --keep_alive_s after last use--> released

At every simulated time the world applies the due events, runs the policy's
``decide(now)`` once, carries its grants and revocations out and, with
``check``, asks the policy to verify its own books. For every policy alike it
counts physical over-commit (memory held by processes above a GPU's
capacity) and loads that start on a GPU while another load runs there. A
policy that sleeps is also told, before each ``decide``, what each process holds
on every GPU whose memory changed (its probe), so that memory a sleeping process
has not given back yet is never granted: if it were, the physical over-commit
count would show it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from ..core import Alarm, GpuId
from .base import Allocator, Attempt, Sleeper, Step
from .clock import EventHeap
from .cluster import Cluster
from .metrics import Recording, WaitSample
from .trace import TraceRequest

__all__ = ["Simulation"]

_Event = tuple[str, str, int]  # kind, key, version
_BUSY = frozenset({"loading", "running", "waking"})  # memory doing work
_IDLE = frozenset({"idle", "sleeping", "asleep", "wake_wait"})  # memory kept as a cache


def _nothing() -> None:
    """What the alarm's ringing does: nothing of its own, as every event makes a step."""


@dataclass(slots=True)
class _Wake:
    """A wake the alarm asked for; cancelled, it rings nothing."""

    ring: Callable[[], object] | None

    def cancel(self) -> None:
        self.ring = None


@dataclass(slots=True)
class _Process:
    """One holder's process. ``held_mb``: what it holds on each of its GPUs now (the
    ground truth; a sleeping one holds less than its size). ``wake``: the attempt that
    waits for this sleeping model; ``wake_lease``/``wake_mb``: the grant of the
    difference it woke with (its model then holds two leases)."""

    lease_id: str
    attempt: Attempt
    gpus: tuple[GpuId, ...]
    phase: str  # new | loading | running | idle | sleeping | asleep | wake_wait | waking
    since: float  # | stopping | gone
    version: int = 0
    requeue: bool = False
    granted_at: float = 0.0
    held_mb: int = 0
    used_at: float = 0.0
    wake: Attempt | None = None
    wake_lease: str | None = None
    wake_mb: int = 0

    @property
    def vram_mb(self) -> int:
        return self.attempt.item.vram_mb

    @property
    def lease_ids(self) -> tuple[str, ...]:
        return (self.lease_id,) if self.wake_lease is None else (self.lease_id, self.wake_lease)

    def same_model(self, attempt: Attempt) -> bool:
        """Whether ``attempt`` may run on this process's warm model: the same model, size,
        GPUs, constraints, priority and preemptibility (the lease is reused as it is)."""
        return _model_key(self.attempt.item) == _model_key(attempt.item)

    def share(self) -> tuple[int, int, int]:
        """MiB it holds in all: (held, of it busy, of it idle-warm or asleep)."""
        total = self.held_mb * len(self.gpus)
        return total, total if self.phase in _BUSY else 0, total if self.phase in _IDLE else 0


def _model_key(item: TraceRequest) -> tuple[object, ...]:
    return (item.model, item.vram_mb, item.gpus, item.constraints, item.priority, item.preemptible)


class _Pending:
    """The attempts submitted and not granted yet, in the order they came, and by model: a
    finished run hands its warm model to the oldest attempt waiting for that very model,
    which must not mean a walk through the whole queue."""

    def __init__(self) -> None:
        self._by_id: dict[str, Attempt] = {}
        self._by_model: dict[tuple[object, ...], dict[str, Attempt]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Attempt]:
        return iter(self._by_id.values())

    def __contains__(self, attempt_id: str) -> bool:
        return attempt_id in self._by_id

    def add(self, attempt: Attempt) -> None:
        self._by_id[attempt.id] = attempt
        self._by_model.setdefault(_model_key(attempt.item), {})[attempt.id] = attempt

    def pop(self, attempt_id: str) -> Attempt:
        attempt = self._by_id.pop(attempt_id)
        key = _model_key(attempt.item)
        same = self._by_model[key]
        del same[attempt_id]
        if not same:
            del self._by_model[key]
        return attempt

    def of_model(self, item: TraceRequest) -> Iterable[Attempt]:
        """The attempts that may run on a warm model of ``item`` (:meth:`_Process.same_model`)."""
        return self._by_model.get(_model_key(item), {}).values()


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
        self.sleeper = allocator if isinstance(allocator, Sleeper) else None
        self.stop_s = stop_s
        self.keep_alive_s = keep_alive_s
        self.check = check
        last = max((r.arrival_s for r in self.trace), default=0.0)
        self.horizon_s = horizon_s if horizon_s is not None else last + 86400.0
        self.capacity = cluster.capacity_mb()
        self.events: EventHeap[_Event] = EventHeap()
        self.pending = _Pending()
        self.procs: dict[str, _Process] = {}
        self.mem = dict.fromkeys(self.capacity, 0)
        self.loads = dict.fromkeys(self.capacity, 0)
        self.rec = Recording(
            policy=allocator.name, capacity_mb=sum(self.capacity.values()), window_s=last
        )
        self._tries: dict[int, int] = {}
        self._seq = 0
        self._wakes: dict[int, _Wake] = {}  # by their event's version
        self._wake_keys = itertools.count()
        self._alarm = Alarm(self, _nothing)  # the policy's next deadline
        self._owners: dict[str, str] = {}  # a wake's lease: the process's own lease
        self._waking: dict[str, str] = {}  # a pending wake request: the sleeping lease
        self._dirty: set[GpuId] = set()  # GPUs whose memory changed since the last probe
        self._present: dict[str, tuple[GpuId, ...]] = {}  # each process's leases: its GPUs

    # ------------------------------------------------------------------ the loop

    def run(self) -> Recording:
        """Runs until nothing is left to happen, or ``horizon_s`` (default: a day after the
        last arrival) has passed; what has not finished by then counts as ``unfinished``."""
        for index, item in enumerate(self.trace):
            self.events.schedule(item.arrival_s, ("arrive", str(index), 0))
        while (now := self.events.next_time()) is not None and now <= self.horizon_s:
            for kind, key, version in self.events.pop_due(now):
                self._handle(kind, key, version, now)
            self._probe()
            step = self._apply(self.allocator.decide(now), now)
            if self.check:
                self.rec.violations.extend(self.allocator.check(now, step, self._present))
            self.rec.steps += 1
            deadline = self.allocator.next_deadline()
            self._alarm.set(deadline if deadline is not None and deadline > now else None)
        self._finish()
        return self.rec

    # The world's event heap is the alarm's clock: a wake is a ``deadline`` event. One that
    # was cancelled still makes a step at its time, as every event does; with nothing due
    # the policy decides nothing then.

    def call_at(self, when: float, callback: Callable[[], object]) -> _Wake:
        key = next(self._wake_keys)
        self._wakes[key] = wake = _Wake(callback)
        self.events.schedule(when, ("deadline", "", key))
        return wake

    def _finish(self) -> None:
        end = max(self.events.next_time() or 0.0, self.rec.last_completion)
        deferred = [p.wake for p in self.procs.values() if p.phase == "sleeping" and p.wake]
        for attempt in [*self.pending, *deferred]:  # never started: waited to the end
            waited = max(0.0, end - attempt.submitted_at)
            item = attempt.item
            self.rec.waits.append(WaitSample(item.priority, waited, waited, False, attempt.id))
        self.rec.unfinished = (
            len(self.pending)
            + len(deferred)
            + sum(
                p.phase in ("loading", "running", "waking") or p.requeue
                for p in self.procs.values()
            )
        )

    def _handle(self, kind: str, key: str, version: int, now: float) -> None:
        if kind == "arrive":
            self._arrive(int(key), now)
            return
        if kind == "deadline":
            ring = self._wakes.pop(version).ring
            if ring is not None:
                ring()
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
        else:
            self._handle_sleep(kind, proc, now)

    def _handle_sleep(self, kind: str, proc: _Process, now: float) -> None:
        if kind == "sleep":
            self._sleep(proc, now)
        elif kind == "slept":
            assert self.sleeper is not None
            self._move(proc, now, "asleep", held_mb=self.sleeper.tier.resident_mb(proc.vram_mb))
            if proc.wake is not None:  # a request came while it was falling asleep
                self._ask_wake(proc, now)
        elif kind == "woken":
            self._woken(proc, now)
        elif kind == "give_up":
            self._give_up(proc, now)

    def _apply(self, step: Step, now: float) -> Step:
        """Carries the step out; returns it less any wake given back unused."""
        reclaimed = {self._owners.get(lease_id, lease_id) for lease_id, _ in step.revocations}
        grants = []
        for lease_id, gpus in step.grants:
            if self._waking.get(lease_id) in reclaimed:  # woken and reclaimed at once:
                self.pending.pop(lease_id)  # the wake is given back unused, and its
                self.allocator.release(lease_id, now)  # request starts cold (_revoke)
                continue
            self._grant(lease_id, gpus, now)
            grants.append((lease_id, gpus))
        for lease_id, _reason in step.revocations:
            self._revoke(self.procs[self._owners.get(lease_id, lease_id)], now)
        return Step(grants=tuple(grants), revocations=step.revocations)

    def _probe(self) -> None:
        """Tells a policy that sleeps what each process holds on the GPUs that changed."""
        if self.sleeper is None or not self._dirty:
            return
        for gpu_id in sorted(self._dirty):
            used: dict[str, int] = {}
            for proc in self.procs.values():
                if gpu_id in proc.gpus:
                    used[proc.lease_id] = proc.held_mb - proc.wake_mb
                    if proc.wake_lease is not None:
                        used[proc.wake_lease] = proc.wake_mb
            self.sleeper.observe(gpu_id, used)
        self._dirty.clear()

    # ------------------------------------------------------------------ holders

    def _arrive(self, index: int, now: float) -> None:
        attempt = self._attempt(index, now)
        warm = self._copy(attempt, ("idle",)) if self.allocator.keeps_warm else None
        if warm is not None:
            self._set_idle(warm, False, now)
            self._run(warm, attempt, now, warm_start=True)
            return
        asleep = self._copy(attempt, ("sleeping", "asleep")) if self.sleeper else None
        if asleep is not None:
            asleep.wake = attempt
            if asleep.phase == "asleep":  # else asked for once it has fallen asleep
                self._ask_wake(asleep, now)
            return
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
            self.pending.add(attempt)

    def _copy(self, attempt: Attempt, phases: tuple[str, ...]) -> _Process | None:
        """The most recently used process of the attempt's model in one of ``phases`` that
        no other request is waking."""
        found = [
            p
            for p in self.procs.values()
            if p.phase in phases and p.wake is None and p.same_model(attempt)
        ]
        return max(found, key=lambda p: (p.since, p.lease_id), default=None)

    def _set_idle(self, proc: _Process, idle: bool, now: float) -> None:
        for lease_id in proc.lease_ids:
            self.allocator.set_idle(lease_id, idle, now)

    def _move(self, proc: _Process, now: float, phase: str, held_mb: int | None = None) -> None:
        """The process enters ``phase`` (holding ``held_mb`` per GPU from now, if given):
        the memory figures and the ground truth per GPU follow."""
        before = proc.share()
        proc.phase = phase
        proc.since = now
        if held_mb is not None and held_mb != proc.held_mb:
            grown = held_mb - proc.held_mb
            proc.held_mb = held_mb
            for gpu_id in proc.gpus:
                self.mem[gpu_id] += grown
                self._dirty.add(gpu_id)
                if grown > 0 and self.mem[gpu_id] > self.capacity[gpu_id]:
                    self.rec.count("overcommits", str(gpu_id))
        after = proc.share()
        self.rec.change(
            now, held=after[0] - before[0], busy=after[1] - before[1], idle=after[2] - before[2]
        )

    def _start_load(self, proc: _Process) -> None:
        for gpu_id in proc.gpus:
            if self.loads[gpu_id]:
                self.rec.count("concurrent_loads", str(gpu_id))
            self.loads[gpu_id] += 1
            self.rec.max_loads = max(self.rec.max_loads, self.loads[gpu_id])

    def _end_load(self, proc: _Process) -> None:
        for gpu_id in proc.gpus:
            self.loads[gpu_id] -= 1

    def _grant(self, lease_id: str, gpus: tuple[GpuId, ...], now: float) -> None:
        attempt = self.pending.pop(lease_id)
        sleeping = self._waking.pop(lease_id, None)
        if sleeping is not None:
            self._wake_granted(self.procs[sleeping], lease_id, gpus, now)
            return
        proc = _Process(lease_id, attempt, gpus, "new", now, granted_at=now)
        self.procs[lease_id] = proc
        self._present[lease_id] = gpus
        self._start_load(proc)
        self._move(proc, now, "loading", held_mb=proc.vram_mb)
        self.rec.loads_started += 1
        self.events.schedule(now + attempt.item.load_s, ("loaded", lease_id, proc.version))

    def _loaded(self, proc: _Process, now: float) -> None:
        self._end_load(proc)
        self.allocator.ready(proc.lease_id, now)
        self._run(proc, proc.attempt, now, warm_start=False)

    def _run(self, proc: _Process, attempt: Attempt, now: float, *, warm_start: bool) -> None:
        if warm_start:
            proc.granted_at = now
        proc.attempt = attempt
        self._move(proc, now, "running")
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
        waiting = [a for a in self.pending.of_model(proc.attempt.item) if a.id not in self._waking]
        if waiting:  # a request for this very model is queued: it takes the warm model
            attempt = min(waiting, key=lambda a: a.seq)
            self.allocator.cancel(attempt.id)
            self.pending.pop(attempt.id)
            self._run(proc, attempt, now, warm_start=True)
            return
        self._move(proc, now, "idle")
        proc.used_at = now
        proc.version += 1
        self._set_idle(proc, True, now)
        self.events.schedule(now + self.keep_alive_s, ("unload", proc.lease_id, proc.version))
        tier = None if self.sleeper is None else self.sleeper.tier
        if (
            tier
            and tier.after_s < self.keep_alive_s
            and tier.resident_mb(proc.vram_mb) < proc.vram_mb
        ):
            self.events.schedule(now + tier.after_s, ("sleep", proc.lease_id, proc.version))

    # ------------------------------------------------------------------ the sleep tier

    def _sleep(self, proc: _Process, now: float) -> None:
        """The lease shrinks at once (its wake's grant is given back); the process still
        holds the memory until ``sleep_s`` later, and the probe says so."""
        assert self.sleeper is not None
        tier = self.sleeper.tier
        self.sleeper.sleep(proc.lease_ids, tier.resident_mb(proc.vram_mb), now)
        if proc.wake_lease is not None:
            del self._owners[proc.wake_lease]
            del self._present[proc.wake_lease]
            proc.wake_lease = None
        proc.wake_mb = 0
        self._dirty.update(proc.gpus)  # its leases changed: the probe keeps what it holds
        self._move(proc, now, "sleeping")
        self.rec.sleeps += 1
        self.events.schedule(now + tier.sleep_s, ("slept", proc.lease_id, proc.version))

    def _ask_wake(self, proc: _Process, now: float) -> None:
        """Asks for the difference on the same GPUs for the attempt waiting on ``proc``."""
        assert self.sleeper is not None and proc.wake is not None
        attempt = proc.wake
        more = proc.vram_mb - proc.held_mb
        rejection = self.sleeper.wake(attempt, proc.lease_id, proc.gpus, more, now)
        if rejection is not None:  # cannot happen on its own GPUs; a cold start then
            self._start_cold(proc, now)
            return
        self.pending.add(attempt)
        self._waking[attempt.id] = proc.lease_id
        self._move(proc, now, "wake_wait")  # still idle to the core: reclaimable (else a
        proc.version += 1  # request nominated to its memory and its wake wait on each other)
        at = now + attempt.item.load_s
        self.events.schedule(at, ("give_up", proc.lease_id, proc.version))

    def _give_up(self, proc: _Process, now: float) -> None:
        """The wake waited as long as a cold load takes: the memory the model gave back is
        held by others on its GPUs (perhaps for long, by work that may not be preempted).
        The request starts cold, anywhere, and the sleeping process stops."""
        self.rec.wakes_abandoned += 1
        self._start_cold(proc, now)
        self._move(proc, now, "stopping")
        proc.version += 1
        self.events.schedule(now + self.stop_s, ("stopped", proc.lease_id, proc.version))

    def _wake_granted(
        self, proc: _Process, lease_id: str, gpus: tuple[GpuId, ...], now: float
    ) -> None:
        assert self.sleeper is not None
        if gpus != proc.gpus:
            self.rec.violations.append(f"wake {lease_id} granted on {gpus}, not on {proc.gpus}")
        self.allocator.set_idle(proc.lease_id, False, now)  # in use from now
        self._owners[lease_id] = proc.lease_id
        self._present[lease_id] = proc.gpus
        proc.wake_lease = lease_id
        proc.wake_mb = proc.vram_mb - proc.held_mb
        proc.granted_at = now
        self._start_load(proc)
        self._move(proc, now, "waking", held_mb=proc.vram_mb)
        proc.version += 1
        self.rec.wakes += 1
        at = now + self.sleeper.tier.wake_s
        self.events.schedule(at, ("woken", proc.lease_id, proc.version))

    def _woken(self, proc: _Process, now: float) -> None:
        assert proc.wake is not None and proc.wake_lease is not None
        self._end_load(proc)
        self.allocator.ready(proc.wake_lease, now)
        attempt, proc.wake = proc.wake, None
        self._run(proc, attempt, now, warm_start=False)

    # ------------------------------------------------------------------ ends

    def _revoke(self, proc: _Process, now: float) -> None:
        if proc.phase == "stopping":
            return
        if proc.phase in ("loading", "running", "waking"):
            self.rec.preemptions += 1
            proc.requeue = True
            if proc.phase == "running":
                self.rec.wasted_run_s += (now - proc.since) * proc.attempt.item.gpus
            if proc.phase in ("loading", "waking"):
                self._end_load(proc)
            if proc.wake is not None:  # the waking attempt is the one re-queued
                proc.attempt, proc.wake = proc.wake, None
        else:
            self.rec.evictions += 1
            if proc.wake is not None:  # reclaimed before it woke: the request starts cold
                self._start_cold(proc, now)
        self._move(proc, now, "stopping")
        proc.version += 1
        self.events.schedule(now + self.stop_s, ("stopped", proc.lease_id, proc.version))

    def _start_cold(self, proc: _Process, now: float) -> None:
        """The request waiting on ``proc``'s wake starts cold instead; its wait still counts
        from its arrival. A wake already asked for is withdrawn, and the request asks anew
        under an id of its own (the policy's books keep the old one's history)."""
        assert proc.wake is not None
        attempt, proc.wake = proc.wake, None
        if self._waking.pop(attempt.id, None) is not None:
            if attempt.id in self.pending:
                self.allocator.cancel(attempt.id)
                self.pending.pop(attempt.id)
            retry = self._attempt(attempt.index, now)
            attempt = dataclasses.replace(retry, submitted_at=attempt.submitted_at)
        self._submit(attempt, now)

    def _free(self, proc: _Process, now: float) -> None:
        if proc.phase in ("loading", "waking"):
            self._end_load(proc)
        self._move(proc, now, "gone", held_mb=0)
        del self.procs[proc.lease_id]
        for lease_id in proc.lease_ids:
            self._owners.pop(lease_id, None)
            del self._present[lease_id]
            self.allocator.release(lease_id, now)
        if proc.wake is not None:  # unloaded while falling asleep: the request starts cold
            self._start_cold(proc, now)
