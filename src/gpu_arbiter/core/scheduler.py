"""The decision core: state in, decisions out. Pure: no asyncio, no I/O, no clock.

Callers (the asyncio engine, the controller, the simulator) report events —
``submit``, ``release``, ``ready``, ``set_probe``, ``drain`` ... — each with the
time as an argument, then call :meth:`Scheduler.decide` with the time. It
returns :class:`Decisions` (grants, revocations, expiries, time-outs, worker
transitions) and has already applied them to its own state; the caller carries
them out (wakes waiters, cancels holders, persists). :meth:`next_deadline`
says when ``decide`` must run again if nothing else happens: no polling.

One cycle of ``decide(now)``:
  1. timers: leases whose TTL lapsed expire; loads past ``load_timeout_s`` count
     as done; drain deadlines revoke what is left.
  2. placement, unless paused: walk the queue in order (effective priority
     desc, seq asc). Each request is placed on GPUs where it fits (I1, I2, I3)
     beyond the holds of nominations ahead of it (I6); else it plans
     preemption (I5) and holds a nomination there; else it nominates its best
     GPU. The walk goes class by class (base priority, shape): a class whose
     head can neither be placed nor preempt is dropped for the cycle. It stops
     once no GPU has room for the smallest pending request and no pending
     request could preempt anything. Afterwards no pending request that the
     pause, a load gate, a hold ahead of it or its constraints do not hold back
     could be granted (I10).
  3. pending requests past ``max_wait_s`` time out; empty draining workers
     become drained.

Before placement, after the cluster changed shape (a worker removed or
re-registered with other GPUs or labels), pending requests that no registered
GPU could ever satisfy any more are rejected, as a new one would be.

A revoked lease can be renewed only within ``policy.grace_s`` of its revocation
and its expiry never moves past ``revoked_at + grace_s + ttl_s``, so a holder
that ignores its revocation keeps a preemptor waiting at most grace + TTL. A
lease an agent supervises (``supervised``) is revoked when its TTL lapses, not
expired: its memory stays committed until the agent confirms the process
exited (I4).

A held lease may shrink (:meth:`Scheduler.shrink`: a model server put to sleep); it
never grows. The memory it gives back counts as committed no longer, but as occupied
for as long as the latest probe shows its process still using it (I2), so it is
granted again only once the probe shows it free (I4).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from .errors import Conflict, InvalidInput, NotFound, Unschedulable
from .filters import mismatch
from .ledger import GpuFigures, Ledger
from .model import (
    Constraints,
    Gpu,
    GpuId,
    GpuProbe,
    Lease,
    LeaseState,
    Policy,
    Request,
    Worker,
    WorkerStatus,
    evolve,
)
from .preemption import Plan, eligible_from, plan_for_gpu
from .queue import PendingQueue
from .reasons import (
    Blocker,
    GpuVerdict,
    PendingReason,
    holding_sentence,
    loading_sentence,
    revoking_sentence,
    summarize,
)
from .units import format_mb

__all__ = ["Decisions", "Scheduler"]

_HELD = (LeaseState.LOADING, LeaseState.ACTIVE, LeaseState.REVOKING)


@dataclass(frozen=True, slots=True)
class Decisions:
    grants: tuple[Lease, ...] = ()
    revocations: tuple[Lease, ...] = ()
    expired: tuple[Lease, ...] = ()
    timed_out: tuple[Request, ...] = ()
    loaded: tuple[Lease, ...] = ()
    workers: tuple[tuple[str, WorkerStatus, WorkerStatus], ...] = ()
    rejected: tuple[tuple[Request, PendingReason], ...] = ()

    def __bool__(self) -> bool:
        return any(
            (
                self.grants,
                self.revocations,
                self.expired,
                self.timed_out,
                self.loaded,
                self.workers,
                self.rejected,
            )
        )


_NOTHING = Decisions()


@dataclass(slots=True)
class _Nomination:
    """Memory being freed by preemption, held for its preemptor."""

    gpus: tuple[GpuId, ...]
    victims: set[str]
    probe_seqs: dict[GpuId, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Cycle:
    """Scratch state of one placement walk."""

    now: float
    holds: dict[GpuId, int] = field(default_factory=dict)
    journal: list[tuple[str, tuple[GpuId, ...], int]] = field(default_factory=list)
    failed_shapes: dict[tuple[int, int, Constraints], int] = field(default_factory=dict)
    grants: list[Lease] = field(default_factory=list)
    revocations: list[Lease] = field(default_factory=list)
    preheld: dict[str, tuple[GpuId, ...]] = field(default_factory=dict)
    granted: set[str] = field(default_factory=set)


class Scheduler:
    def __init__(self, policy: Policy | None = None, *, next_token: int = 1, next_seq: int = 1):
        self.policy = policy or Policy()
        self.paused = False
        self.next_token = next_token
        self.next_seq = next_seq
        self.workers: dict[str, Worker] = {}
        self.leases: dict[str, Lease] = {}
        self.queue = PendingQueue()
        self._ledger = Ledger()
        self._worker_gpus: dict[str, list[GpuId]] = {}
        self._worker_leases: dict[str, set[str]] = {}
        self._drain_deadlines: dict[str, float] = {}
        self._nominations: dict[str, _Nomination] = {}
        self._victims: dict[int, int] = {}  # base priority -> busy preemptible leases
        self._idle: dict[int, int] = {}  # base priority -> idle preemptible leases
        self._timers: list[tuple[float, int, str, str]] = []
        self._timer_seq = 0
        self._retries: set[float] = set()  # times of pending "retry" timers
        self._match_cache: dict[tuple[Constraints, int, int], frozenset[GpuId]] = {}
        self._drain_check: set[str] = set()  # draining workers that may have become empty
        self._journal: list[tuple[str, tuple[GpuId, ...], int]] = []
        self._journal_at: dict[str, int] | None = {}  # index of _journal, made by explain()
        self._shrunk = False  # the cluster lost GPUs or changed them: recheck pending requests
        self.counters: Counter[str] = Counter()

    # ------------------------------------------------------------------ workers and GPUs

    def put_worker(self, worker: Worker, gpus: Sequence[Gpu]) -> None:
        """Registers a worker or replaces its GPUs.

        A GPU that vanished but still holds leases stays, stale, until they end. A GPU
        registered smaller than its leases is accepted, over-committed: it gets no grant
        until they are back under its capacity (refusing it would leave the worker unable
        to come back, e.g. after a driver change)."""
        for gpu in gpus:
            if gpu.worker != worker.name:
                raise InvalidInput("gpus", f"GPU {gpu.id} does not belong to worker {worker.name}")
        if len({gpu.index for gpu in gpus}) != len(gpus):
            raise InvalidInput("gpus", "GPU indexes must be unique")
        self._shrunk |= self._reshaped(worker, gpus)
        self.workers[worker.name] = worker
        new_ids = [gpu.id for gpu in gpus]
        for old in self._worker_gpus.get(worker.name, []):
            if old not in new_ids:
                if self._ledger.lease_ids(old):
                    self._ledger.set_probe(old, None)
                    new_ids.append(old)
                else:
                    self._ledger.drop_gpu(old)
        for gpu in gpus:
            self._ledger.put_gpu(gpu)
        self._worker_gpus[worker.name] = sorted(new_ids)
        self._worker_leases.setdefault(worker.name, set())
        self._match_cache.clear()

    def _reshaped(self, worker: Worker, gpus: Sequence[Gpu]) -> bool:
        """Whether re-registering ``worker`` changes its labels or GPUs (so pending requests
        may no longer be satisfiable); a new worker only adds room."""
        old = self.workers.get(worker.name)
        if old is None:
            return False
        before = {self._ledger.gpu(g) for g in self._worker_gpus.get(worker.name, ())}
        return dict(old.labels) != dict(worker.labels) or before != set(gpus)

    def remove_worker(self, name: str) -> None:
        """Forgets a worker and its GPUs. Its leases must have ended first."""
        self._worker(name)
        if self._worker_leases.get(name):
            raise Conflict(f"worker {name} still holds {len(self._worker_leases[name])} lease(s)")
        self._shrunk = True
        for gpu_id in self._worker_gpus.pop(name, []):
            self._ledger.drop_gpu(gpu_id)
        del self.workers[name]
        self._worker_leases.pop(name, None)
        self._drain_deadlines.pop(name, None)
        self._match_cache.clear()

    def set_worker_status(self, name: str, status: WorkerStatus) -> WorkerStatus:
        """Sets a status as is (restoring state); returns the previous one."""
        worker = self._worker(name)
        self.workers[name] = evolve(worker, status=status)
        self._drain_check.add(name)
        return worker.status

    def drain(
        self, name: str, now: float, *, force: bool = False, deadline_s: float | None = None
    ) -> list[Lease]:
        """No new work on ``name``; ``force`` revokes its leases now, ``deadline_s`` later."""
        worker = self._worker(name)
        if worker.status is WorkerStatus.OFFLINE:
            raise Conflict(f"worker {name} is offline")
        if worker.status is WorkerStatus.ONLINE:
            self.workers[name] = evolve(worker, status=WorkerStatus.DRAINING)
        self._drain_check.add(name)
        if force:
            return self._revoke_worker(name, "drain", now)
        if deadline_s is not None:
            self._drain_deadlines[name] = now + deadline_s
            self._push_timer(now + deadline_s, "drain", name)
        return []

    def cancel_drain(self, name: str) -> WorkerStatus:
        worker = self._worker(name)
        if worker.status not in (WorkerStatus.DRAINING, WorkerStatus.DRAINED):
            raise Conflict(f"worker {name} is {worker.status}, not draining")
        self.workers[name] = evolve(worker, status=WorkerStatus.ONLINE)
        self._drain_deadlines.pop(name, None)
        return worker.status

    def set_offline(self, name: str, now: float) -> list[Lease]:
        """Heartbeat lost. A draining worker has its drain finished: its leases are revoked."""
        worker = self._worker(name)
        revoked: list[Lease] = []
        if worker.status is WorkerStatus.DRAINING:
            revoked = self._revoke_worker(name, "drain", now)
        self.workers[name] = evolve(worker, status=WorkerStatus.OFFLINE)
        self._drain_deadlines.pop(name, None)
        return revoked

    def _revoke_worker(self, name: str, reason: str, now: float) -> list[Lease]:
        """Revokes the worker's leases not already being revoked; returns those."""
        return [
            self.revoke(lid, reason, now)
            for lid in sorted(self._worker_leases.get(name, ()))
            if self.leases[lid].state is not LeaseState.REVOKING
        ]

    def set_probe(self, gpu_id: GpuId, probe: GpuProbe | None) -> None:
        if gpu_id not in self._ledger:
            raise NotFound(f"no GPU {gpu_id}")
        self._ledger.set_probe(gpu_id, probe)

    def gpu_ids(self, worker: str | None = None) -> list[GpuId]:
        if worker is not None:
            return list(self._worker_gpus.get(worker, []))
        return sorted(self._ledger.ids())

    def figures(self, gpu_id: GpuId) -> GpuFigures:
        return self._ledger.figures(gpu_id)

    def worker_lease_ids(self, name: str) -> set[str]:
        return set(self._worker_leases.get(name, ()))

    # ------------------------------------------------------------------ requests and leases

    def rejection_for(self, request: Request) -> PendingReason | None:
        """Why no registered GPU could ever satisfy ``request``; None if one could (or no
        worker is registered yet, in which case the request waits for one)."""
        if not self.workers or self._matching(request):
            return None
        unknown = [str(g) for g in request.constraints.gpu_ids if g not in self._ledger]
        if unknown:
            return PendingReason(
                "no_matching_gpu", f"constraints.gpu_ids: no GPU {', '.join(unknown)} is registered"
            )
        matching = self._matching(request)  # cached per shape: the common case is cheap
        if request.gpus == 1 and matching:
            return None
        if len(matching) >= request.gpus and request.gpus <= max(
            Counter(g.worker for g in matching).values()
        ):
            return None
        per_worker: Counter[str] = Counter()
        codes: Counter[str] = Counter()
        for name, ids in self._worker_gpus.items():
            labels = self.workers[name].labels
            for gpu_id in ids:
                code = mismatch(
                    self._ledger.gpu(gpu_id), labels, request.constraints, request.vram_mb
                )
                codes[code or "fits"] += 1
                per_worker[name] += code is None
        if any(count >= request.gpus for count in per_worker.values()):
            return None
        if codes["fits"]:
            code, message = "too_few_gpus", f"no worker has {request.gpus} matching GPUs"
        elif codes["too_small"]:
            largest = max(self._ledger.gpu(g).capacity_mb for g in self._ledger.ids())
            code = "too_large"
            message = (
                f"{format_mb(request.vram_mb)} per GPU is more than any matching GPU "
                f"holds (largest capacity {format_mb(largest)})"
            )
        else:
            code = "no_matching_gpu"
            message = f"no GPU matches {request.constraints.describe()}"
        detail = ", ".join(f"{n} {c}" for c, n in sorted(codes.items()) if c != "fits")
        return PendingReason(code, f"{message} ({detail})" if detail else message)

    def submit(self, request: Request, now: float) -> Request:
        """Queues ``request`` (its ``seq`` and ``submitted_at`` are set here, unless restored).

        Raises :class:`Unschedulable` when no registered GPU could ever satisfy it."""
        if request.id in self.queue or request.id in self.leases:
            raise Conflict(f"request {request.id!r} already exists")
        rejection = self.rejection_for(request)
        if rejection is not None:
            self.counters["rejected"] += 1
            raise Unschedulable(rejection)
        if request.seq == 0:
            request = evolve(request, seq=self.next_seq, submitted_at=now)
        self.next_seq = max(self.next_seq, request.seq + 1)
        self.queue.add(request)
        if request.max_wait_s is not None:
            self._push_timer(request.submitted_at + request.max_wait_s, "wait", request.id)
        self.counters["submitted"] += 1
        return request

    def cancel(self, request_id: str) -> Request:
        request = self.queue.remove(request_id)
        self._nominations.pop(request_id, None)
        self.counters["cancelled"] += 1
        return request

    def lease(self, lease_id: str) -> Lease:
        try:
            return self.leases[lease_id]
        except KeyError:
            raise NotFound(f"no held lease {lease_id!r}") from None

    def release(self, lease_id: str, now: float, state: LeaseState = LeaseState.RELEASED) -> Lease:
        """The holder released or stopped (or, with ``state=EXPIRED``, its TTL lapsed):
        the memory is freed, exactly once."""
        lease = self.lease(lease_id)
        self._forget_lease(lease)
        self._ledger.uncommit(lease)
        del self.leases[lease_id]
        worker = lease.worker
        self._worker_leases[worker].discard(lease_id)
        if self.workers[worker].status is WorkerStatus.DRAINING:
            self._drain_check.add(worker)
        for nomination in self._nominations.values():
            if lease_id in nomination.victims:
                nomination.victims.discard(lease_id)
                for gpu_id in nomination.gpus:
                    if gpu_id in self._ledger and self._ledger.has_probe(gpu_id):
                        nomination.probe_seqs[gpu_id] = self._ledger.probe_seq(gpu_id)
        self.counters[str(state)] += 1
        return evolve(lease, state=state, ended_at=now, loading=False)

    def ready(self, lease_id: str, now: float) -> Lease:
        """The load finished: the GPU's load gate opens."""
        lease = self.lease(lease_id)
        if not lease.loading:
            return lease
        self._ledger.finish_loading(lease)
        state = LeaseState.ACTIVE if lease.state is LeaseState.LOADING else lease.state
        return self._put(lease, evolve(lease, loading=False, state=state, last_used_at=now))

    def renew(self, lease_id: str, now: float, ttl_s: float | None = None) -> Lease:
        """Moves the expiry to ``now + ttl``. A revoked lease: only within its grace, and
        never past ``revoked_at + grace_s + ttl_s`` (else :class:`Conflict`)."""
        lease = self.lease(lease_id)
        grace_end = lease.grace_ends_at(self.policy.grace_s)
        if grace_end is not None and now > grace_end:
            raise Conflict(
                f"lease {lease_id} was revoked ({lease.revoke_reason}) "
                f"{now - (lease.revoked_at or now):.1f} s ago and its grace of "
                f"{self.policy.grace_s:g} s is over: it cannot be renewed; stop and release it",
                lease_id=lease_id,
                reason="revoked_past_grace",
            )
        ttl = lease.request.ttl_s if ttl_s is None else ttl_s
        if ttl is None:
            return lease
        expires_at = now + ttl
        if grace_end is not None:
            expires_at = min(expires_at, self._revoked_expiry_cap(lease))
        renewed = self._put(lease, evolve(lease, expires_at=expires_at))
        self._push_timer(renewed.expires_at, "ttl", lease_id)
        return renewed

    def _revoked_expiry_cap(self, lease: Lease) -> float:
        """The latest expiry a revoked lease may have: grace + TTL after its revocation."""
        ttl = lease.request.ttl_s
        grace_end = lease.grace_ends_at(self.policy.grace_s)
        if ttl is None or grace_end is None:
            return math.inf
        return grace_end + ttl

    def set_supervised(self, lease_id: str, supervised: bool, now: float) -> Lease:
        """Whether an agent supervises the lease's process (it will confirm its exit). No
        longer supervised, a lease whose TTL has lapsed meanwhile expires at the next cycle."""
        lease = self.lease(lease_id)
        if lease.supervised == supervised:
            return lease
        changed = self._put(lease, evolve(lease, supervised=supervised))
        if not supervised:
            self._push_timer(changed.expires_at, "ttl", lease_id)
        return changed

    def set_idle(self, lease_id: str, idle: bool, now: float) -> Lease:
        lease = self.lease(lease_id)
        if lease.idle == idle:
            return lease
        return self._put(lease, evolve(lease, idle=idle, last_used_at=now))

    def shrink(self, lease_id: str, vram_mb: int, now: float) -> Lease:
        """A held lease gives memory back: it holds ``vram_mb`` per GPU from now on (a model
        server put to sleep keeps its process, and its lease only what that still uses).

        Committed memory drops at once; what its process still holds by the latest probe
        stays out of reach (I2: ``max(committed, observed_used)``, or per lease
        ``max(reserved, used)``), so the memory is granted again only once the probe shows
        it free (I4). A lease never grows: more memory takes a new grant, through the queue
        and the load gate. The caller runs the cycle after it (I10)."""
        if lease_id in self.queue:
            raise Conflict(f"request {lease_id} is pending, not granted: it holds nothing")
        lease = self.lease(lease_id)
        if isinstance(vram_mb, bool) or not isinstance(vram_mb, int) or vram_mb < 1:
            raise InvalidInput("vram_mb", "must be an integer number of MiB >= 1")
        if vram_mb > lease.vram_mb:
            raise Conflict(
                f"lease {lease_id} holds {format_mb(lease.vram_mb)} per GPU; it cannot grow to "
                f"{format_mb(vram_mb)}: a lease grows only through a new grant",
                field="vram_mb",
                reason="a lease grows only through a new grant",
            )
        if vram_mb == lease.vram_mb:
            return lease
        self._ledger.shrink(lease, vram_mb)
        self.counters["shrunk"] += 1
        return self._put(lease, evolve(lease, shrunk_to_mb=vram_mb))

    def revoke(
        self, lease_id: str, reason: str, now: float, *, for_request: str | None = None
    ) -> Lease:
        """Starts taking a lease back. Its memory stays committed until it ends (I4)."""
        lease = self.lease(lease_id)
        if lease.state is LeaseState.REVOKING:
            return lease
        self.counters[f"revoked:{reason}"] += 1
        revoked = evolve(
            lease,
            state=LeaseState.REVOKING,
            revoke_reason=reason,
            preempted_for=for_request,
            revoked_at=now,
        )
        cap = self._revoked_expiry_cap(revoked)
        if lease.expires_at > cap:  # renewed far ahead before: grace + TTL from now at most
            revoked = evolve(revoked, expires_at=cap)
            self._push_timer(cap, "ttl", lease_id)
        return self._put(lease, revoked)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def restore_lease(self, lease: Lease) -> None:
        """Puts back a lease loaded from storage (the controller's restart)."""
        if lease.id in self.leases or not lease.state.holds_memory:
            raise Conflict(f"cannot restore lease {lease.id!r} in state {lease.state}")
        self._add_lease(lease)
        self.next_token = max(self.next_token, lease.token + 1)
        self.next_seq = max(self.next_seq, lease.request.seq + 1)

    # ------------------------------------------------------------------ the cycle

    def decide(self, now: float) -> Decisions:
        if not self.queue and not self._drain_check and not self._due(now):
            return _NOTHING
        expired, loaded, revocations, waits = self._run_timers(now)
        rejected = self._reject_unplaceable(now) if self._shrunk else []
        cycle = _Cycle(now)
        if not self.paused and not self._place_alone(cycle):
            self._place(cycle)
        self._journal = cycle.journal
        self._journal_at = None
        timed_out = [self._end_wait(rid) for rid in waits if rid in self.queue]
        workers = self._finish_drains() if self._drain_check else []
        return Decisions(
            grants=tuple(cycle.grants),
            revocations=tuple(revocations + cycle.revocations),
            expired=tuple(expired),
            timed_out=tuple(timed_out),
            loaded=tuple(loaded),
            workers=tuple(workers),
            rejected=tuple(rejected),
        )

    def _reject_unplaceable(self, now: float) -> list[tuple[Request, PendingReason]]:
        """After the cluster shrank: pending requests no registered GPU could ever satisfy
        any more end as a new one would (while no worker is registered, they wait)."""
        self._shrunk = False
        rejected = []
        for request in list(self.queue.ordered(self.policy, now)):
            reason = self.rejection_for(request)
            if reason is not None:
                self.queue.remove(request.id)
                self._nominations.pop(request.id, None)
                self.counters["rejected"] += 1
                rejected.append((request, reason))
        return rejected

    def _due(self, now: float) -> bool:
        deadline = self.next_deadline()
        return deadline is not None and deadline <= now

    def next_deadline(self) -> float | None:
        """When ``decide`` must run next if no event comes first (None: never)."""
        while self._timers and not self._timer_live(self._timers[0]):
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    def _run_timers(self, now: float) -> tuple[list[Lease], list[Lease], list[Lease], list[str]]:
        """Fires due timers; pending requests past their wait are returned, to be timed out
        after placement (a request granted in the very cycle its wait ends is granted)."""
        expired: list[Lease] = []
        loaded: list[Lease] = []
        revoked: list[Lease] = []
        waits: list[str] = []
        while self._timers and self._timers[0][0] <= now:
            entry = heapq.heappop(self._timers)
            if not self._timer_live(entry):
                continue
            _, _, kind, key = entry
            if kind == "ttl" and self.leases[key].supervised:
                if self.leases[key].state is not LeaseState.REVOKING:  # its agent stops it
                    revoked.append(self.revoke(key, "ttl_lapsed", now))
            elif kind == "ttl":
                expired.append(self.release(key, now, LeaseState.EXPIRED))
            elif kind == "load":
                loaded.append(self.ready(key, now))
            elif kind == "drain":
                del self._drain_deadlines[key]
                revoked += self._revoke_worker(key, "drain_deadline", now)
            elif kind == "wait":
                waits.append(key)
            elif kind == "retry":
                self._retries.discard(entry[0])
        return expired, loaded, revoked, waits

    def _timer_live(self, entry: tuple[float, int, str, str]) -> bool:
        at, _, kind, key = entry
        if kind == "ttl":
            lease = self.leases.get(key)
            return lease is not None and lease.expires_at == at
        if kind == "load":
            lease = self.leases.get(key)
            return lease is not None and lease.loading and lease.load_deadline == at
        if kind == "wait":
            return key in self.queue
        if kind == "drain":
            return self._drain_deadlines.get(key) == at
        return True  # "retry": re-run the cycle once

    def _retry_at(self, at: float) -> None:
        """Runs the cycle again at ``at`` (once, however often asked)."""
        if at not in self._retries and math.isfinite(at):
            self._retries.add(at)
            self._push_timer(at, "retry", "")

    def _push_timer(self, at: float, kind: str, key: str) -> None:
        if not math.isfinite(at):
            return
        self._timer_seq += 1
        heapq.heappush(self._timers, (at, self._timer_seq, kind, key))

    def _end_wait(self, request_id: str) -> Request:
        self._nominations.pop(request_id, None)
        self.counters["timed_out"] += 1
        return self.queue.remove(request_id)

    def _finish_drains(self) -> list[tuple[str, WorkerStatus, WorkerStatus]]:
        changes = []
        names, self._drain_check = self._drain_check, set()
        for name in sorted(names):
            worker = self.workers.get(name)
            if worker is None:
                continue
            if worker.status is WorkerStatus.DRAINING and not self._worker_leases.get(name):
                self.workers[name] = evolve(worker, status=WorkerStatus.DRAINED)
                self._drain_deadlines.pop(name, None)
                changes.append((name, WorkerStatus.DRAINING, WorkerStatus.DRAINED))
        return changes

    # ------------------------------------------------------------------ placement

    def _place_alone(self, cycle: _Cycle) -> bool:
        """Grants a lone pending request where it fits now, when no memory is held for a
        preemptor; False (nothing done) otherwise, for :meth:`_place` to walk the queue.

        The uncontended arbiter's case (an in-process ``acquire``): the walk would examine
        this one request and grant it on exactly these GPUs, through a third of the cycle's
        cost in walk machinery (class heap, holds, room checks) with nothing to order."""
        request = self.queue.only()
        if request is None or self._nominations:
            return False
        gpus = self._fit(request, cycle)
        if gpus is None:
            return False
        self._grant_in(cycle, request, gpus)
        self.counters["examined"] += 1
        self.queue.remove(request.id)
        return True

    def _place(self, cycle: _Cycle) -> None:
        """Walks the queue class by class (see :class:`~.queue.Walk`): a class whose head
        can neither be placed nor preempt is dropped for the rest of the cycle, so the
        cycle's cost follows the number of classes, not of requests. A request holding
        memory freed by its own preemption is walked on its own, never dropped with its
        class: that memory is held for it alone (I10)."""
        smallest = self.queue.smallest_vram_mb()
        if smallest is None:
            return
        highest = max(self.queue.priorities())
        granted: list[str] = []
        self._prehold(cycle)
        walk = self.queue.walk(self.policy, cycle.now, alone=list(cycle.preheld))
        for request in walk:
            preheld = cycle.preheld.pop(request.id, None)
            if preheld is not None:  # its own hold must not stand in its way
                for gpu_id in preheld:
                    cycle.holds[gpu_id] -= request.vram_mb
            lifted = self._lift_preholds(cycle, request)
            room_left = self._max_room(cycle) >= smallest
            if not room_left and not cycle.preheld and not self._could_preempt(highest):
                break
            outcome = self._turn(request, cycle, room_left=room_left, preheld=preheld is not None)
            for gpu_id, mb in lifted:
                cycle.holds[gpu_id] += mb
            if outcome is True:
                granted.append(request.id)
            elif outcome is False:
                walk.drop()
        self.counters["examined"] += walk.examined
        for request_id in granted:
            self.queue.remove(request_id)
            self._nominations.pop(request_id, None)

    def _turn(
        self, request: Request, cycle: _Cycle, *, room_left: bool, preheld: bool
    ) -> bool | None:
        """One request's turn: True when granted, None when memory is on its way back for it,
        False when neither it nor the rest of its class (younger, no more rights, less room)
        can be placed in this cycle."""
        shape = request.shape
        if not preheld and cycle.failed_shapes.get(shape, -1) >= request.priority:
            if room_left:  # it cannot fit either, but it still holds its best GPU (I6)
                self._hold(cycle, request, self._nominate(request, cycle))
            return False
        if not room_left and not preheld and not self._could_preempt(request.priority):
            return False  # can neither fit nor preempt, and nobody behind can fit: no hold needed
        gpus = self._fit(request, cycle)
        if gpus is not None:
            self._grant_in(cycle, request, gpus)
            return True
        if self._preempt_or_nominate(request, cycle):
            return None
        cycle.failed_shapes[shape] = max(cycle.failed_shapes.get(shape, -1), request.priority)
        return False

    def _prehold(self, cycle: _Cycle) -> None:
        """Memory freed by preemption is held for its preemptor against every request of
        equal or lower base priority, even one that aging has moved ahead of it, until the
        preemptor is granted or finds it still does not fit there (then it plans again): else
        a stream of aged lower-priority requests could take the memory, and the preemption
        would repeat. (A request of higher base priority may take it: it could preempt the
        preemptor right after its grant anyway.) A nomination whose
        victims are gone and where its preemptor no longer fits at all (memory taken by
        strangers meanwhile) is dropped first: it would hold memory for nobody."""
        for request_id, nomination in list(self._nominations.items()):
            if not all(g in self._ledger for g in nomination.gpus):  # its worker was removed
                del self._nominations[request_id]
            elif request_id in self.queue:
                request = self.queue.get(request_id)
                if not self._holds_memory(request, nomination):
                    del self._nominations[request_id]
                    continue
                self._hold(cycle, request, nomination.gpus, own=True)
                cycle.preheld[request_id] = nomination.gpus

    def _lift_preholds(self, cycle: _Cycle, request: Request) -> list[tuple[GpuId, int]]:
        """Lifts, for ``request``'s turn, the holds of preemptors of lower base priority: it
        could preempt them right after their grant, so it may take their memory directly.
        Returns what was lifted, to be put back after the turn."""
        lifted = []
        for preemptor_id, gpus in cycle.preheld.items():
            preemptor = self.queue.get(preemptor_id)
            if preemptor.priority < request.priority:
                for gpu_id in gpus:
                    cycle.holds[gpu_id] -= preemptor.vram_mb
                    lifted.append((gpu_id, preemptor.vram_mb))
        return lifted

    def _holds_memory(self, request: Request, nomination: _Nomination) -> bool:
        """Whether a preemptor's nomination still holds its memory: its victims have not all
        stopped (or the probe has not shown it yet), or the preemptor fits there now."""
        return self._still_preempting(nomination) or all(
            self._usable(g) and self._ledger.free_mb(g) >= request.vram_mb for g in nomination.gpus
        )

    def held_for_preemptors(self) -> dict[str, tuple[GpuId, ...]]:
        """Memory freed, or being freed, by preemption and held for its preemptor against
        every other request in the next cycle: request id -> its GPUs."""
        return {
            request_id: nomination.gpus
            for request_id, nomination in self._nominations.items()
            if request_id in self.queue
            and all(g in self._ledger for g in nomination.gpus)
            and self._holds_memory(self.queue.get(request_id), nomination)
        }

    def _max_room(self, cycle: _Cycle) -> int:
        """The most memory any usable GPU has beyond the holds of this cycle."""
        best = -(1 << 62)
        for gpu_id, hold in cycle.holds.items():
            if self._usable(gpu_id):
                best = max(best, self._ledger.free_mb(gpu_id) - hold)
        index = self._ledger.by_free
        for i in range(len(index) - 1, -1, -1):
            free, gpu_id = index[i]
            if free <= best:
                break
            if gpu_id not in cycle.holds and self._usable(gpu_id):
                return free
        return best

    def _could_preempt(self, highest_pending: int) -> bool:
        """Whether a request of this base priority might find a victim (now or, for idle
        leases, once time has passed: the plan then says when)."""
        if self._victims and min(self._victims) < highest_pending:
            return True
        if not self._idle:
            return False
        policy = self.policy
        reclaim_later = math.isfinite(policy.idle_reclaim_s) or math.isfinite(policy.starvation_s)
        return reclaim_later or min(self._idle) <= highest_pending

    def _usable(self, gpu_id: GpuId) -> bool:
        """A GPU that may take new grants: worker online (I7), probe fresh (I2)."""
        online = self.workers[gpu_id.worker].status is WorkerStatus.ONLINE
        return online and not self._ledger.stale(gpu_id)

    def _room(self, gpu_id: GpuId, cycle: _Cycle) -> int:
        return self._ledger.free_mb(gpu_id) - cycle.holds.get(gpu_id, 0)

    def _matching(self, request: Request) -> frozenset[GpuId]:
        """GPUs that match the constraints, are big enough, and sit on a worker with at least
        ``gpus`` such GPUs (cached until workers change)."""
        key = (request.constraints, request.vram_mb, request.gpus)
        cached = self._match_cache.get(key)
        if cached is None:
            found: list[GpuId] = []
            for name, ids in self._worker_gpus.items():
                labels = self.workers[name].labels
                on_worker = [
                    gpu_id
                    for gpu_id in ids
                    if mismatch(
                        self._ledger.gpu(gpu_id), labels, request.constraints, request.vram_mb
                    )
                    is None
                ]
                if len(on_worker) >= request.gpus:
                    found += on_worker
            cached = self._match_cache[key] = frozenset(found)
        return cached

    def _by_worker(self, gpu_ids: Iterable[GpuId]) -> dict[str, list[GpuId]]:
        grouped: dict[str, list[GpuId]] = {}
        for gpu_id in gpu_ids:
            grouped.setdefault(gpu_id.worker, []).append(gpu_id)
        return grouped

    def _fit(self, request: Request, cycle: _Cycle) -> tuple[GpuId, ...] | None:
        """The best GPUs where the request fits now (I1, I2, I3, after holds: I6), or None."""
        spread = self.policy.placement == "spread"
        nomination = self._nominations.get(request.id)
        if nomination is not None and all(
            self._fits_on(request, g, cycle) for g in nomination.gpus
        ):
            return nomination.gpus
        if request.gpus == 1:
            one = self._pick_one(request, cycle, need=request.vram_mb, spread=spread, gate=True)
            return None if one is None else (one,)
        fitting = [g for g in self._matching(request) if self._fits_on(request, g, cycle)]
        return self._best(request, fitting, cycle, spread=spread)

    def _fits_on(self, request: Request, gpu_id: GpuId, cycle: _Cycle) -> bool:
        return (
            gpu_id in self._ledger
            and self._usable(gpu_id)
            and self._room(gpu_id, cycle) >= request.vram_mb
            and self._ledger.loading(gpu_id) < self.policy.max_concurrent_loads
        )

    def _pick_one(
        self, request: Request, cycle: _Cycle, *, need: int | None, spread: bool, gate: bool
    ) -> GpuId | None:
        """The best single GPU by bisection of the ledger's free-memory index.

        Candidates: matching, usable GPUs with room >= ``need`` (any room if None) and, with
        ``gate``, a free load slot. Best: least room (binpack) or most (spread), then GPU id.
        GPUs holding nominations this cycle are checked one by one (they are few)."""
        matching = self._matching(request)
        limit = self.policy.max_concurrent_loads
        floor = -(1 << 62) if need is None else need
        sign = -1 if spread else 1
        best: tuple[int, GpuId] | None = None

        def consider(room: int, gpu_id: GpuId) -> None:
            nonlocal best
            if room < floor or gpu_id not in matching or not self._usable(gpu_id):
                return
            if gate and self._ledger.loading(gpu_id) >= limit:
                return
            if best is None or (sign * room, gpu_id) < (sign * best[0], best[1]):
                best = (room, gpu_id)

        for gpu_id, hold in cycle.holds.items():
            consider(self._ledger.free_mb(gpu_id) - hold, gpu_id)
        index = self._ledger.by_free
        if spread:
            positions: Iterable[int] = range(len(index) - 1, -1, -1)
        else:
            positions = range(bisect.bisect_left(index, (floor,)), len(index))
        for i in positions:
            free, gpu_id = index[i]
            if free < floor or (best is not None and sign * free > sign * best[0]):
                break
            if gpu_id not in cycle.holds:
                consider(free, gpu_id)
        return None if best is None else best[1]

    def _best(
        self, request: Request, gpu_ids: Iterable[GpuId], cycle: _Cycle, *, spread: bool
    ) -> tuple[GpuId, ...] | None:
        """Ranks workers' best ``gpus`` GPUs: binpack (least room left) or spread (most)."""
        best: tuple[tuple[int, str], tuple[GpuId, ...]] | None = None
        sign = -1 if spread else 1
        for worker, ids in self._by_worker(gpu_ids).items():
            if len(ids) < request.gpus:
                continue
            ranked = sorted(ids, key=lambda g: (sign * self._room(g, cycle), g))[: request.gpus]
            score = (sign * sum(self._room(g, cycle) for g in ranked), worker)
            if best is None or score < best[0]:
                best = (score, tuple(sorted(ranked)))
        return None if best is None else best[1]

    def _grant_in(self, cycle: _Cycle, request: Request, gpus: tuple[GpuId, ...]) -> None:
        cycle.grants.append(self._grant(request, gpus, cycle.now))
        cycle.granted.add(request.id)

    def _grant(self, request: Request, gpus: tuple[GpuId, ...], now: float) -> Lease:
        lease = Lease(
            request=request,
            gpus=gpus,
            token=self.next_token,
            state=LeaseState.LOADING,
            granted_at=now,
            expires_at=math.inf if request.ttl_s is None else now + request.ttl_s,
            load_deadline=now + request.load_timeout_s,
            last_used_at=now,
        )
        self.next_token += 1
        self._add_lease(lease)
        self.counters["granted"] += 1
        return lease

    def _add_lease(self, lease: Lease) -> None:
        lease_id = lease.id
        self.leases[lease_id] = lease
        self._ledger.commit(lease)
        self._worker_leases.setdefault(lease.worker, set()).add(lease_id)
        self._count_victim(lease, 1)
        self._push_timer(lease.expires_at, "ttl", lease_id)
        if lease.loading:
            self._push_timer(lease.load_deadline, "load", lease_id)

    # ------------------------------------------------------------------ preemption and nomination

    def _preempt_or_nominate(self, request: Request, cycle: _Cycle) -> bool:
        """Holds memory for a request that does not fit (a nomination, I6). True when memory is
        on its way back for it (its victims, or leases already being revoked)."""
        nomination = self._nominations.get(request.id)
        if nomination is not None and self._still_preempting(nomination):
            self._hold(cycle, request, nomination.gpus, own=True)
            return True
        self._nominations.pop(request.id, None)
        plan = self._plan(request, cycle) if self._could_preempt(request.priority) else None
        if plan is not None and not plan[1]:  # memory already on its way back: wait for it
            self._hold(cycle, request, plan[0])
            return True
        if plan is not None:
            gpus, victims = plan
            for victim in victims:
                cycle.revocations.append(
                    self.revoke(victim.id, "preempted", cycle.now, for_request=request.id)
                )
            self.counters["preemptions"] += 1
            self._nominations[request.id] = _Nomination(gpus, {v.id for v in victims})
            self._hold(cycle, request, gpus, own=True)
            return True
        self._hold(cycle, request, self._nominate(request, cycle))
        return False

    def _still_preempting(self, nomination: _Nomination) -> bool:
        if nomination.victims:
            return True
        return any(  # victims gone, but the probe has not shown it yet
            g in self._ledger and self._ledger.probe_seq(g) == seq
            for g, seq in nomination.probe_seqs.items()
        )

    def _nominate(self, request: Request, cycle: _Cycle) -> tuple[GpuId, ...]:
        """The GPUs where the request is closest to fitting (most room); () if none usable."""
        if request.gpus == 1:
            one = self._pick_one(request, cycle, need=None, spread=True, gate=False)
            return () if one is None else (one,)
        usable = [g for g in self._matching(request) if self._usable(g)]
        return self._best(request, usable, cycle, spread=True) or ()

    def _reserved(self, cycle: _Cycle, exclude: str) -> dict[GpuId, int]:
        """GPUs still pre-held for preemptors (other than ``exclude``) -> the highest base
        priority among them."""
        reserved: dict[GpuId, int] = {}
        for preemptor_id, gpus in cycle.preheld.items():
            if preemptor_id != exclude:
                priority = self.queue.get(preemptor_id).priority
                for gpu_id in gpus:
                    reserved[gpu_id] = max(reserved.get(gpu_id, -1), priority)
        return reserved

    def _hold(
        self, cycle: _Cycle, request: Request, gpus: tuple[GpuId, ...], *, own: bool = False
    ) -> None:
        """Holds ``gpus`` for ``request`` against the requests behind it (I6). Memory its own
        preemption frees (``own``) is always held; otherwise a GPU pre-held for a preemptor
        of equal or higher base priority stays its preemptor's (a request of higher base
        priority had that hold lifted for its turn, and may hold it)."""
        held = gpus
        if not own:
            reserved = self._reserved(cycle, exclude=request.id)
            held = tuple(g for g in gpus if reserved.get(g, -1) < request.priority)
        for gpu_id in held:
            cycle.holds[gpu_id] = cycle.holds.get(gpu_id, 0) + request.vram_mb
        cycle.journal.append((request.id, held, request.vram_mb))

    def _plan(
        self, request: Request, cycle: _Cycle
    ) -> tuple[tuple[GpuId, ...], tuple[Lease, ...]] | None:
        """The cheapest victims on one worker that make room for the request (I5); no victims
        when memory already being revoked will make room."""
        best: tuple[tuple[object, ...], tuple[GpuId, ...], tuple[Lease, ...]] | None = None
        usable = [g for g in self._matching(request) if self._usable(g)]
        for worker, ids in self._by_worker(usable).items():
            if len(ids) < request.gpus:
                continue
            plans: list[tuple[tuple[object, ...], GpuId, Plan]] = []
            for gpu_id in ids:
                plan = self._plan_gpu(request, gpu_id, cycle)
                if plan is not None:
                    plans.append((plan.cost, gpu_id, plan))
            if len(plans) < request.gpus:
                continue
            plans.sort(key=lambda item: (item[0], item[1]))
            chosen = plans[: request.gpus]
            victims = {v.id: v for _, _, plan in chosen for v in plan.victims}
            combined = Plan(tuple(sorted(victims.values(), key=lambda v: v.id)))
            key = (combined.cost, worker)
            if best is None or key < best[0]:
                best = (key, tuple(sorted(g for _, g, _ in chosen)), combined.victims)
        return None if best is None else (best[1], best[2])

    def _plan_gpu(self, request: Request, gpu_id: GpuId, cycle: _Cycle) -> Plan | None:
        held = cycle.holds.get(gpu_id, 0)
        revoking = {
            lid
            for lid in self._ledger.lease_ids(gpu_id)
            if self.leases[lid].state is LeaseState.REVOKING
        }
        candidates = []
        for lid in self._ledger.lease_ids(gpu_id):
            lease = self.leases[lid]
            if lid in cycle.granted:
                continue  # never take back in the cycle that granted it
            since = eligible_from(lease, request, self.policy)
            if since <= cycle.now:
                candidates.append(lease)
            else:  # eligible later (age, idle time, wait): run the cycle again then
                self._retry_at(since)

        def fits(victims: set[str]) -> bool:
            return self._ledger.free_after(gpu_id, victims | revoking) - held >= request.vram_mb

        if fits(set()):  # memory already on its way back: wait for it, revoke nothing
            return Plan(())
        if not candidates:
            return None
        deficit = request.vram_mb - (self._ledger.free_after(gpu_id, revoking) - held)
        return plan_for_gpu(candidates, deficit, fits)

    # ------------------------------------------------------------------ introspection

    def explain(self, request_id: str, now: float) -> PendingReason:
        """Why a pending request is still pending, against the last cycle's nominations."""
        request = self.queue.get(request_id)
        if self.paused:
            return PendingReason("paused", "the arbiter is paused; nothing is granted until resume")
        if not self.workers:
            return PendingReason("no_workers", "no worker is registered yet; waiting for one")
        nomination = self._nominations.get(request_id)
        if nomination is not None and self._still_preempting(nomination):
            return self._preempting(nomination, now)
        if self._journal_at is None:
            self._journal_at = {rid: i for i, (rid, _, _) in enumerate(self._journal)}
        index = self._journal_at.get(request_id, len(self._journal))
        holds: dict[GpuId, int] = {}
        holders: dict[GpuId, str] = {}
        for rid, gpus, mb in self._journal[:index]:
            for gpu_id in gpus:
                holds[gpu_id] = holds.get(gpu_id, 0) + mb
                holders.setdefault(gpu_id, rid)
        own = self._journal[index][1] if index < len(self._journal) else ()
        verdicts = tuple(self._verdict(request, g, holds) for g in sorted(self._ledger.ids()))
        return self._reason(request, verdicts, holders, own, now)

    def _preempting(self, nomination: _Nomination, now: float) -> PendingReason:
        """Waiting for victims to stop: the one that bounds the wait, by name (a victim past
        its grace first), or for the probe to show their memory free."""
        where = ", ".join(map(str, nomination.gpus))
        victims = [self.leases[v] for v in sorted(nomination.victims) if v in self.leases]
        if not victims:
            message = (
                f"the preempted leases on {where} have stopped; waiting for the GPU's next "
                "probe reading to show their memory free"
            )
            return PendingReason("preempting", message, nominated=nomination.gpus)
        stuck = self.overdue_revocations(now, among=nomination.victims)
        grace_s = self.policy.grace_s
        victim = (
            self.leases[stuck[0][0]]
            if stuck
            else max(victims, key=lambda v: (v.revoked_at or now, v.id))
        )
        blocker = Blocker(
            "revoking",
            victim.id,
            victim.request.holder,
            victim.gpus,
            since=victim.revoked_at if victim.revoked_at is not None else now,
            until=victim.grace_ends_at(grace_s),
            expires_at=victim.expires_at,
        )
        message = (
            f"waiting for {len(victims)} preempted lease(s) on {where} to stop and the memory "
            f"to show free: {revoking_sentence(blocker, now, grace_s)}"
        )
        return PendingReason(
            "preempting",
            message,
            nominated=nomination.gpus,
            blocked_by=victim.id if stuck else None,
            blocker=blocker,
        )

    def _loading_blocker(self, verdicts: tuple[GpuVerdict, ...]) -> Blocker | None:
        """The loading lease whose gate opens first among the GPUs held only by their gate."""
        found: list[Blocker] = []
        for verdict in verdicts:
            if verdict.code != "load_in_progress":
                continue
            for lease_id in sorted(self._ledger.lease_ids(verdict.gpu)):
                lease = self.leases[lease_id]
                if lease.loading:  # revoking while loading holds the gate too
                    found.append(
                        Blocker(
                            "loading",
                            lease.id,
                            lease.request.holder,
                            lease.gpus,
                            since=lease.granted_at,
                            until=lease.load_deadline,
                            expires_at=lease.expires_at,
                        )
                    )
        return min(
            found, key=lambda b: (min(b.until or 0.0, b.expires_at or 0.0), b.id), default=None
        )

    def _holding_blocker(self, request_id: str, gpu_id: GpuId) -> Blocker:
        """The request ahead whose nomination holds memory of ``gpu_id``."""
        ahead = self.queue.get(request_id) if request_id in self.queue else None
        return Blocker(
            "request",
            request_id,
            None if ahead is None else ahead.holder,
            (gpu_id,),
            since=0.0 if ahead is None else ahead.submitted_at,
        )

    def _verdict(self, request: Request, gpu_id: GpuId, holds: dict[GpuId, int]) -> GpuVerdict:
        gpu = self._ledger.gpu(gpu_id)
        worker = self.workers[gpu_id.worker]
        free = max(0, self._ledger.free_mb(gpu_id))
        common = {
            "need_mb": request.vram_mb,
            "free_mb": free,
            "committed_mb": self._ledger.committed_mb(gpu_id),
            "observed_mb": self._ledger.observed_mb(gpu_id),
            "held_mb": holds.get(gpu_id, 0),
        }
        code = mismatch(gpu, worker.labels, request.constraints, request.vram_mb)
        if code is None and gpu_id not in self._matching(request):
            code = "too_few_gpus_on_worker"
        if code is None and worker.status is not WorkerStatus.ONLINE:
            code = f"worker_{worker.status}"
        if code is None and self._ledger.stale(gpu_id):
            code = "probe_stale"
        if code is None:
            if free < request.vram_mb:
                code = "insufficient_vram"
            elif free - holds.get(gpu_id, 0) < request.vram_mb:
                code = "nominated_for"
            elif self._ledger.loading(gpu_id) >= self.policy.max_concurrent_loads:
                code = "load_in_progress"
            else:
                code = "fits"
        return GpuVerdict(gpu_id, code, **common)

    def _reason(
        self,
        request: Request,
        verdicts: tuple[GpuVerdict, ...],
        holders: dict[GpuId, str],
        own: tuple[GpuId, ...],
        now: float,
    ) -> PendingReason:
        fitting = Counter(v.gpu.worker for v in verdicts if v.code == "fits")
        if any(count >= request.gpus for count in fitting.values()):
            return PendingReason(
                "queued", "a GPU fits; waiting for the next scheduling cycle", verdicts, own
            )
        # GPUs with room, but too few of them on one worker for the request
        verdicts = tuple(
            evolve(v, code="too_few_gpus_on_worker") if v.code == "fits" else v for v in verdicts
        )
        codes = {v.code for v in verdicts}
        summary = summarize(verdicts, request.vram_mb)
        if "nominated_for" in codes:
            held = next(v for v in verdicts if v.code == "nominated_for")
            rid = holders.get(held.gpu)
            if rid is None:
                return PendingReason("nominated_for", summary, verdicts, own)
            blocker = self._holding_blocker(rid, held.gpu)
            message = f"{summary}; {holding_sentence(blocker, held.held_mb)}"
            return PendingReason("nominated_for", message, verdicts, own, rid, blocker)
        if "load_in_progress" in codes:
            loading = self._loading_blocker(verdicts)
            if loading is None:
                return PendingReason("load_in_progress", summary, verdicts, own)
            message = f"{summary}; {loading_sentence(loading, now)}"
            return PendingReason("load_in_progress", message, verdicts, own, loading.id, loading)
        if "insufficient_vram" in codes:
            return PendingReason("insufficient_vram", summary, verdicts, own)
        if codes & {"worker_draining", "worker_drained", "worker_offline", "probe_stale"}:
            return PendingReason("workers_draining", summary, verdicts, own)
        return PendingReason("no_matching_gpu", summary, verdicts, own)

    def overdue_revocations(
        self, now: float, among: Iterable[str] | None = None
    ) -> list[tuple[str, float]]:
        """Revoked leases still held past their grace, with the seconds since their
        revocation, longest first: holders that ignore their revocation."""
        ids = self.leases if among is None else among
        overdue = []
        for lease_id in ids:
            lease = self.leases.get(lease_id)
            grace_end = None if lease is None else lease.grace_ends_at(self.policy.grace_s)
            if lease is not None and grace_end is not None and now > grace_end:
                overdue.append((lease_id, now - (lease.revoked_at or now)))
        return sorted(overdue, key=lambda item: (-item[1], item[0]))

    def pending(self, now: float) -> Iterator[tuple[int, Request, int]]:
        """(position from 1, request, effective priority) in queue order; changes nothing."""
        for position, request in enumerate(self.queue.ordered(self.policy, now), start=1):
            yield position, request, self.policy.effective_priority(request, now)

    # ------------------------------------------------------------------ bookkeeping

    def _put(self, old: Lease, new: Lease) -> Lease:
        self._count_victim(old, -1)
        self.leases[new.id] = new
        self._count_victim(new, 1)
        return new

    def _forget_lease(self, lease: Lease) -> None:
        self._count_victim(lease, -1)

    def _count_victim(self, lease: Lease, delta: int) -> None:
        if lease.state is LeaseState.REVOKING or not (lease.idle or lease.request.preemptible):
            return
        counter = self._idle if lease.idle else self._victims
        priority = lease.request.priority
        count = counter.pop(priority, 0) + delta
        if count > 0:
            counter[priority] = count

    def _worker(self, name: str) -> Worker:
        try:
            return self.workers[name]
        except KeyError:
            raise NotFound(f"no worker {name!r}") from None
