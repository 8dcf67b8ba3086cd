"""The decision core's state, and every read a plan or a "why" makes of it.

:class:`State` holds the workers, the ledger, the held leases, the pending queue, the
preemptors' nominations, the timers and the last plan's diagnoses; it is the
:class:`~.view.View` a plan is made from. Only :class:`~.scheduler.Scheduler` (its
events, and :meth:`~.scheduler.Scheduler.apply`) writes it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

from .diagnosis import Diagnosis, Turn, diagnose
from .errors import NotFound
from .explain import explain, rejection
from .filters import mismatch
from .ledger import GpuFigures, Ledger
from .model import (
    Constraints,
    GpuId,
    Lease,
    LeaseState,
    Policy,
    Request,
    Worker,
    WorkerStatus,
    evolve,
)
from .nominations import Holds, Nomination
from .outcomes import Outcome
from .overlay import Overlay
from .plan import Plan
from .presence import Presence
from .queue import PendingQueue
from .reasons import PendingReason
from .stages import taking_work
from .timers import TimerKind, Timers

__all__ = ["State"]

_Shape = tuple[Constraints, int, int]


class State:
    def __init__(self, policy: Policy | None, next_token: int, next_seq: int, presence: bool):
        self.policy = policy or Policy()
        self.paused = False
        self.next_token = next_token
        self.next_seq = next_seq
        self.workers: dict[str, Worker] = {}
        self.leases: dict[str, Lease] = {}
        self.queue = PendingQueue()
        self.ledger = Ledger()
        self.nominations: dict[str, Nomination] = {}  # preemptors' (see .nominations)
        self.counters: Counter[str] = Counter()
        self._timers = Timers()
        self.presence = Presence(self._timers, presence)  # askers must show up (I8)
        self._worker_gpus: dict[str, list[GpuId]] = {}
        self._worker_leases: dict[str, set[str]] = {}
        self._drain_deadlines: dict[str, float] = {}
        self._victims: dict[int, int] = {}  # base priority -> busy preemptible leases
        self._idle: dict[int, int] = {}  # base priority -> idle preemptible leases
        self._match_cache: dict[_Shape, frozenset[GpuId]] = {}
        self._mismatch_cache: dict[_Shape, dict[Outcome, tuple[int, GpuId]]] = {}
        self._unusable: dict[GpuId, Outcome] | None = None  # worked out once per change
        self._drain_check: set[str] = set()  # draining workers that may have become empty
        self._reshaped = False  # the cluster lost GPUs or changed them: recheck pending requests
        self._plan: Plan | None = None  # the last plan applied
        self._turns: Mapping[str, Turn] = {}  # the last plan's
        self._grants: tuple[Lease, ...] = ()  # the last plan's
        self._holds: tuple[tuple[str, tuple[GpuId, ...], int], ...] = ()  # the last plan's
        self._last_holds: Holds | None = None  # made of _holds when a "why" needs it
        self._diagnosed: dict[object, Diagnosis] = {}  # worked out from the last plan, kept
        self._diagnosed_at: tuple[int, int] = (-1, -1)  # the versions they were worked out at
        self._workers_version = 0

    # ------------------------------------------------------------------ the view

    @property
    def reshaped(self) -> bool:
        return self._reshaped

    @property
    def drain_check(self) -> set[str]:
        return self._drain_check

    def due(self, now: float) -> list[tuple[TimerKind, str]]:
        return self._timers.due(now, self._timer_live)

    def next_deadline(self) -> float | None:
        """When ``decide`` must run next if no event comes first (None: never)."""
        return self._timers.next(self._timer_live)

    def retry_pending(self, at: float) -> bool:
        """Whether the cycle already runs again at ``at``."""
        return self._timers.retry_pending(at)

    def claimed_at_grant(self, request_id: str) -> bool:
        return self.presence.claimed_at_grant(request_id)

    def _timer_live(self, entry: tuple[float, int, TimerKind, str]) -> bool:
        at, _, kind, key = entry
        if kind is TimerKind.TTL:
            lease = self.leases.get(key)
            return lease is not None and lease.expires_at == at
        if kind is TimerKind.LOAD:
            lease = self.leases.get(key)
            return lease is not None and lease.loading and lease.load_deadline == at
        if kind is TimerKind.WAIT:
            return key in self.queue
        if kind is TimerKind.DRAIN:
            return self._drain_deadlines.get(key) == at
        if kind is TimerKind.ABSENT:
            return key in self.queue and self.presence.absent(key, at)
        if kind is TimerKind.CLAIM:
            lease = self.leases.get(key)
            return lease is not None and not lease.claimed and self.presence.unclaimed(key, at)
        return True  # RETRY: re-run the cycle once

    def lease(self, lease_id: str) -> Lease:
        try:
            return self.leases[lease_id]
        except KeyError:
            raise NotFound(f"no held lease {lease_id!r}") from None

    def gpu_ids(self, worker: str | None = None) -> list[GpuId]:
        if worker is not None:
            return list(self._worker_gpus.get(worker, []))
        return sorted(self.ledger.ids())

    def figures(self, gpu_id: GpuId) -> GpuFigures:
        return self.ledger.figures(gpu_id)

    def worker_lease_ids(self, name: str) -> set[str]:
        return set(self._worker_leases.get(name, ()))

    def matching(self, request: Request) -> frozenset[GpuId]:
        """GPUs that match the constraints, are big enough, and sit on a worker with at least
        ``gpus`` such GPUs (cached until workers change)."""
        key = (request.constraints, request.vram_mb, request.gpus)
        cached = self._match_cache.get(key)
        if cached is None:
            cached = self._match(key)
        return cached

    def mismatches(self, request: Request) -> Mapping[Outcome, tuple[int, GpuId]]:
        """The GPUs that never match the request, by outcome: how many, and one of them
        (for ``too_small``, the largest). Cached with :meth:`matching`."""
        key = (request.constraints, request.vram_mb, request.gpus)
        if key not in self._mismatch_cache:
            self._match(key)
        return self._mismatch_cache[key]

    def _match(self, key: _Shape) -> frozenset[GpuId]:
        constraints, vram_mb, gpus = key
        found: list[GpuId] = []
        missed: dict[Outcome, tuple[int, GpuId]] = {}

        def miss(code: Outcome, gpu_id: GpuId) -> None:
            count, sample = missed.get(code, (0, gpu_id))
            if code is Outcome.TOO_SMALL and (
                self.ledger.gpu(gpu_id).capacity_mb > self.ledger.gpu(sample).capacity_mb
            ):
                sample = gpu_id
            missed[code] = (count + 1, sample)

        for name, ids in self._worker_gpus.items():
            labels = self.workers[name].labels
            on_worker = []
            for gpu_id in ids:
                code = mismatch(self.ledger.gpu(gpu_id), labels, constraints, vram_mb)
                if code is None:
                    on_worker.append(gpu_id)
                else:
                    miss(code, gpu_id)
            if len(on_worker) >= gpus:
                found += on_worker
            else:
                for gpu_id in on_worker:
                    miss(Outcome.TOO_FEW_GPUS_ON_WORKER, gpu_id)
        matched = self._match_cache[key] = frozenset(found)
        self._mismatch_cache[key] = missed
        return matched

    def _workers_changed(self) -> None:
        """A worker's status changed: what may take new work is worked out again."""
        self._unusable = None
        self._workers_version += 1

    def unusable(self) -> Mapping[GpuId, Outcome]:
        """GPUs that may take no new work, and why: their worker is not online (I7), or
        their probe is stale (I2). Worked out again after a worker or a probe changed."""
        if self._unusable is None:
            candidates = [*self.ledger.stale_ids]
            for name, worker in self.workers.items():
                if worker.status is not WorkerStatus.ONLINE:
                    candidates += self._worker_gpus.get(name, ())
            found: dict[GpuId, Outcome] = {}
            for gpu_id in candidates:
                code = taking_work(self, gpu_id)  # the stages' own answer
                if code is not None:
                    found[gpu_id] = code
            self._unusable = found
        return self._unusable

    def victim_counts(self, *, copy: bool = True) -> tuple[dict[int, int], dict[int, int]]:
        """Base priority -> how many busy preemptible leases, and how many idle ones, may be
        victims (copies, unless ``copy`` is False: then only read them)."""
        if copy:
            return dict(self._victims), dict(self._idle)
        return self._victims, self._idle

    def revoked(
        self, lease: Lease, reason: str, now: float, for_request: str | None = None
    ) -> Lease:
        """``lease`` as it is once revoked: its expiry no later than grace + TTL from now."""
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
        return revoked

    def _revoked_expiry_cap(self, lease: Lease) -> float:
        """The latest expiry a revoked lease may have: grace + TTL after its revocation."""
        ttl = lease.request.ttl_s
        grace_end = lease.grace_ends_at(self.policy.grace_s)
        if ttl is None or grace_end is None:
            return math.inf
        return grace_end + ttl

    # ------------------------------------------------------------------ why

    def rejection_for(self, request: Request) -> PendingReason | None:
        """Why no registered GPU could ever satisfy ``request`` (see :mod:`.explain`)."""
        return rejection(self, request)

    def explain(self, request_id: str, now: float) -> PendingReason:
        """Why a pending request is still pending, from the last plan (see :mod:`.explain`)."""
        return explain(self, request_id, now)

    @property
    def last_plan(self) -> Plan | None:
        """The plan applied last (None before the first), read only: what its walk held
        (:meth:`~.plan.Plan.held`), granted and revoked. A check of I6 and I10 reads its
        holds here, never a "why"."""
        return self._plan

    def _last_plan(self, plan: Plan) -> None:
        """What a "why" reads of the plan just applied."""
        self._plan = plan
        self._turns, self._grants, self._holds = plan.turns, plan.grants, plan.holds
        self._last_holds = None
        self._diagnosed_at = (-1, -1)

    def diagnosis(self, request: Request) -> Diagnosis:
        """Why ``request`` was not placed by the last plan, worked out once from where the
        walk stood at its turn (:class:`~.diagnosis.Turn`): the state less the plan's grants
        made after it, against the holds ahead of it. A request the walk did not reach (its
        class dropped, the walk over) against all of the plan's holds and grants."""
        at = (self.ledger.version, self._workers_version)
        if at != self._diagnosed_at:  # the state changed since: worked out again
            self._diagnosed, self._diagnosed_at = {}, at
        turn = self._turns.get(request.id)
        key = (
            request.id if turn is not None else (request.constraints, request.vram_mb, request.gpus)
        )
        found = self._diagnosed.get(key)
        if found is not None:
            return found
        overlay = Overlay(self.ledger)
        if turn is None:
            holds = self._holds_of_last_plan()
        else:
            for lease in self._grants[turn.grants :]:
                held = self.leases.get(lease.id)
                if held is not None:
                    overlay.end(held, loading=held.loading)
            holds = Holds()
            holds.by_gpu.update(turn.held)
            holds.journal.extend(self._holds[: turn.holds])
        found = self._diagnosed[key] = diagnose(_Reads(self, overlay), request, holds)
        return found

    def waits_on(self, request_id: str) -> tuple[GpuId, ...]:
        """The GPUs where the last plan had ``request_id`` wait for memory already being
        revoked (the post-filter's answer), or ()."""
        turn = self._turns.get(request_id)
        return () if turn is None else turn.waits_on

    def held_by(self, request_id: str) -> tuple[GpuId, ...]:
        """The GPUs whose memory ``request_id`` held in the last plan."""
        return next((gpus for rid, gpus, _ in self._holds if rid == request_id), ())

    def _holds_of_last_plan(self) -> Holds:
        if self._last_holds is None:
            holds = Holds()
            for rid, gpus, mb in self._holds:
                for gpu_id in gpus:
                    holds.by_gpu[gpu_id] = holds.by_gpu.get(gpu_id, 0) + mb
                holds.journal.append((rid, gpus, mb))
            self._last_holds = holds
        return self._last_holds

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

    def position(self, request_id: str, now: float) -> tuple[int, int]:
        """(position from 1, effective priority) of a pending request, as :meth:`pending`
        would yield them, without walking the queue ahead of it; changes nothing."""
        request = self.queue.get(request_id)
        position = self.queue.position(request_id, self.policy, now)
        return position, self.policy.effective_priority(request, now)

    def pending(self, now: float) -> Iterator[tuple[int, Request, int]]:
        """(position from 1, request, effective priority) in queue order; changes nothing."""
        for position, request in enumerate(self.queue.ordered(self.policy, now), start=1):
            yield position, request, self.policy.effective_priority(request, now)

    def held_for_preemptors(self) -> dict[str, tuple[GpuId, ...]]:
        """Memory freed, or being freed, by preemption and held for its preemptor against
        every other request in the next cycle: request id -> its GPUs."""
        reads = _Reads(self)
        return {
            request_id: nomination.gpus
            for request_id, nomination in self.nominations.items()
            if request_id in self.queue
            and all(g in self.ledger for g in nomination.gpus)
            and (
                nomination.preempting(self.ledger)
                or all(
                    reads.usable(g) and self.ledger.free_mb(g) >= self.queue.get(request_id).vram_mb
                    for g in nomination.gpus
                )
            )
        }


class _Reads:
    """The state as a diagnosis reads it outside a plan: no change of the plan's own."""

    __slots__ = ("index", "ledger", "matching", "mismatches", "policy", "unusable", "workers")

    def __init__(self, state: State, overlay: Overlay | None = None) -> None:
        self.policy = state.policy
        self.workers = state.workers
        self.ledger = Overlay(state.ledger) if overlay is None else overlay
        self.index = state.ledger.by_free
        self.matching = state.matching
        self.mismatches = state.mismatches
        self.unusable = state.unusable

    def usable(self, gpu_id: GpuId) -> bool:
        return gpu_id not in self.unusable()
