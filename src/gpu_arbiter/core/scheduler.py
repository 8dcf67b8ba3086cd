"""The decision core's state: state in, a plan out. Pure: no asyncio, no I/O, no clock.

Callers (the asyncio engine, the controller, the simulator) report events —
``submit``, ``release``, ``ready``, ``set_probe``, ``drain`` ... — each with the
time as an argument, then run a cycle with the time::

    event ──► Scheduler ──tick(now)──► timers fired (expiries, lapsed loads, drain
                 ▲                     deadlines) and requests no GPU could ever take
                 │        plan(now) ──► Plan (grants, revocations, nominations,
                 │                      time-outs, drained workers): the state unchanged
                 └────── apply(plan) ◄─ the driver carries it out

:meth:`Scheduler.decide` is the three at once, returning :class:`Decisions`; the
caller carries them out (wakes waiters, cancels holders, persists).
:meth:`next_deadline` says when the cycle must run again if nothing else happens: no
polling. The plan is made by :mod:`.cycle` from the stages of :mod:`.stages` and the
nominations of :mod:`.nominations`; :func:`~.verify.check_plan` checks one against the
state it was made from. "Why is it pending" (:meth:`Scheduler.explain`) is what the
stages say of each GPU, against the holds of the last plan.

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

With ``presence`` (the service, whose askers can vanish), a pending request whose asker
is unseen for its ``ttl_s`` ends (``abandoned``), and a grant its holder has not taken up
within its claim bound is given back (``unclaimed``): see :mod:`.presence`. Renewing,
readying, marking idle or busy, shrinking, and an agent reporting the lease's process
take a grant up.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from . import cycle
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
    slot_init,
)
from .nominations import Nomination
from .plan import Plan
from .presence import Presence
from .queue import PendingQueue
from .reasons import (
    Blocker,
    GpuVerdict,
    PendingReason,
    holding_sentence,
    lease_blockers,
    loading_sentence,
    revoking_sentence,
    summarize,
    waiting_sentence,
)
from .stages import outcome, usable
from .timers import TimerKind, Timers
from .units import format_mb

__all__ = ["Decisions", "Scheduler"]


@slot_init
@dataclass(frozen=True, slots=True)
class Decisions:
    grants: tuple[Lease, ...] = ()
    revocations: tuple[Lease, ...] = ()
    expired: tuple[Lease, ...] = ()
    timed_out: tuple[Request, ...] = ()
    loaded: tuple[Lease, ...] = ()
    workers: tuple[tuple[str, WorkerStatus, WorkerStatus], ...] = ()
    rejected: tuple[tuple[Request, PendingReason], ...] = ()
    abandoned: tuple[Request, ...] = ()
    unclaimed: tuple[Lease, ...] = ()

    @staticmethod
    def of_cycle(fired: Decisions, applied: Decisions) -> Decisions:
        """One cycle's decisions: what :meth:`Scheduler.tick` fired, then what
        :meth:`Scheduler.apply` carried out."""
        return Decisions(
            grants=applied.grants,
            revocations=fired.revocations + applied.revocations,
            expired=fired.expired,
            timed_out=applied.timed_out,
            loaded=fired.loaded,
            workers=applied.workers,
            rejected=fired.rejected,
            abandoned=fired.abandoned,
            unclaimed=fired.unclaimed,
        )

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
                self.abandoned,
                self.unclaimed,
            )
        )


_NOTHING = Decisions()


class Scheduler:
    def __init__(
        self,
        policy: Policy | None = None,
        *,
        next_token: int = 1,
        next_seq: int = 1,
        presence: bool = False,
    ):
        self.policy = policy or Policy()
        self.paused = False
        self.next_token = next_token
        self.next_seq = next_seq
        self.workers: dict[str, Worker] = {}
        self.leases: dict[str, Lease] = {}
        self.queue = PendingQueue()
        self.ledger = Ledger()  # read by the cycle; changed only here
        self._worker_gpus: dict[str, list[GpuId]] = {}
        self._worker_leases: dict[str, set[str]] = {}
        self._drain_deadlines: dict[str, float] = {}
        self.nominations: dict[str, Nomination] = {}  # preemptors' (see .nominations)
        self._victims: dict[int, int] = {}  # base priority -> busy preemptible leases
        self._idle: dict[int, int] = {}  # base priority -> idle preemptible leases
        self._timers = Timers()
        self.presence = Presence(self._timers, presence)  # askers must show up (I8)
        self._waits: list[str] = []  # pending requests whose wait ended, for the next plan
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
                if self.ledger.lease_ids(old):
                    self.ledger.set_probe(old, None)
                    new_ids.append(old)
                else:
                    self.ledger.drop_gpu(old)
        for gpu in gpus:
            self.ledger.put_gpu(gpu)
        self._worker_gpus[worker.name] = sorted(new_ids)
        self._worker_leases.setdefault(worker.name, set())
        self._match_cache.clear()

    def _reshaped(self, worker: Worker, gpus: Sequence[Gpu]) -> bool:
        """Whether re-registering ``worker`` changes its labels or GPUs (so pending requests
        may no longer be satisfiable); a new worker only adds room."""
        old = self.workers.get(worker.name)
        if old is None:
            return False
        before = {self.ledger.gpu(g) for g in self._worker_gpus.get(worker.name, ())}
        return dict(old.labels) != dict(worker.labels) or before != set(gpus)

    def remove_worker(self, name: str) -> None:
        """Forgets a worker and its GPUs. Its leases must have ended first."""
        self._worker(name)
        if self._worker_leases.get(name):
            raise Conflict(f"worker {name} still holds {len(self._worker_leases[name])} lease(s)")
        self._shrunk = True
        for gpu_id in self._worker_gpus.pop(name, []):
            self.ledger.drop_gpu(gpu_id)
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
            self._timers.push(now + deadline_s, TimerKind.DRAIN, name)
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
        if gpu_id not in self.ledger:
            raise NotFound(f"no GPU {gpu_id}")
        self.ledger.set_probe(gpu_id, probe)

    def gpu_ids(self, worker: str | None = None) -> list[GpuId]:
        if worker is not None:
            return list(self._worker_gpus.get(worker, []))
        return sorted(self.ledger.ids())

    def figures(self, gpu_id: GpuId) -> GpuFigures:
        return self.ledger.figures(gpu_id)

    def worker_lease_ids(self, name: str) -> set[str]:
        return set(self._worker_leases.get(name, ()))

    # ------------------------------------------------------------------ requests and leases

    def rejection_for(self, request: Request) -> PendingReason | None:
        """Why no registered GPU could ever satisfy ``request``; None if one could (or no
        worker is registered yet, in which case the request waits for one)."""
        if not self.workers or self.matching(request):
            return None
        unknown = [str(g) for g in request.constraints.gpu_ids if g not in self.ledger]
        if unknown:
            return PendingReason(
                "no_matching_gpu", f"constraints.gpu_ids: no GPU {', '.join(unknown)} is registered"
            )
        matching = self.matching(request)  # cached per shape: the common case is cheap
        if request.gpus == 1 and matching:
            return None
        if len(matching) >= request.gpus and request.gpus <= max(
            Counter(g.worker for g in matching).values()
        ):
            return None
        per_worker: Counter[str] = Counter()
        codes: Counter[str] = Counter()
        largest = 0  # the capacity of the largest GPU that matches all but the size
        for name, ids in self._worker_gpus.items():
            labels = self.workers[name].labels
            for gpu_id in ids:
                gpu = self.ledger.gpu(gpu_id)
                code = mismatch(gpu, labels, request.constraints, request.vram_mb)
                codes[code or "fits"] += 1
                per_worker[name] += code is None
                if code == "too_small":
                    largest = max(largest, gpu.capacity_mb)
        if any(count >= request.gpus for count in per_worker.values()):
            return None
        if codes["fits"]:
            code, message = "too_few_gpus", f"no worker has {request.gpus} matching GPUs"
        elif codes["too_small"]:
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
        self.presence.seen(request, now)
        if request.max_wait_s is not None:
            self._timers.push(request.submitted_at + request.max_wait_s, TimerKind.WAIT, request.id)
        self.counters["submitted"] += 1
        return request

    def cancel(self, request_id: str) -> Request:
        request = self.queue.remove(request_id)
        self.nominations.pop(request_id, None)
        self.presence.forget(request_id)
        self.counters["cancelled"] += 1
        return request

    def seen(self, request_id: str, now: float) -> None:
        """A pending request's asker showed up (see :mod:`.presence`)."""
        if request_id in self.queue:
            self.presence.seen(self.queue.get(request_id), now)

    def watch(self, request_id: str) -> None:
        """An answer to a pending request's asker is open (a long-poll): it is present."""
        self.presence.watch(request_id)

    def unwatch(self, request_id: str, now: float) -> None:
        """The answer opened by :meth:`watch` closed at ``now``."""
        pending = self.queue.get(request_id) if request_id in self.queue else None
        self.presence.unwatch(pending, request_id, now)

    def claim(self, lease_id: str) -> Lease:
        """Its holder took the grant up (a read of it): it is no longer given back."""
        lease = self.lease(lease_id)
        if lease.claimed:
            return lease
        self.presence.forget(lease_id)
        return self._put(lease, evolve(lease, claimed=True))

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
        self.presence.forget(lease_id)
        self.ledger.uncommit(lease)
        del self.leases[lease_id]
        worker = lease.worker
        self._worker_leases[worker].discard(lease_id)
        if self.workers[worker].status is WorkerStatus.DRAINING:
            self._drain_check.add(worker)
        for nomination in self.nominations.values():
            nomination.victim_ended(lease_id, self.ledger)
        self.counters[str(state)] += 1
        return evolve(lease, state=state, ended_at=now, loading=False)

    def ready(self, lease_id: str, now: float) -> Lease:
        """The load finished (its holder said so: the grant is taken up): the GPU's load
        gate opens."""
        self.claim(lease_id)
        return self._loaded(lease_id, now)

    def _loaded(self, lease_id: str, now: float) -> Lease:
        """The load finished, or ran past its ``load_timeout_s``: the load gate opens."""
        lease = self.lease(lease_id)
        if not lease.loading:
            return lease
        self.ledger.finish_loading(lease)
        state = LeaseState.ACTIVE if lease.state is LeaseState.LOADING else lease.state
        return self._put(lease, evolve(lease, loading=False, state=state, last_used_at=now))

    def renew(self, lease_id: str, now: float, ttl_s: float | None = None) -> Lease:
        """Moves the expiry to ``now + ttl``. A revoked lease: only within its grace, and
        never past ``revoked_at + grace_s + ttl_s`` (else :class:`Conflict`)."""
        lease = self.claim(lease_id)
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
        self._timers.push(renewed.expires_at, TimerKind.TTL, lease_id)
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
        lease = self.claim(lease_id) if supervised else self.lease(lease_id)
        if lease.supervised == supervised:
            return lease
        changed = self._put(lease, evolve(lease, supervised=supervised))
        if not supervised:
            self._timers.push(changed.expires_at, TimerKind.TTL, lease_id)
        return changed

    def set_idle(self, lease_id: str, idle: bool, now: float) -> Lease:
        lease = self.claim(lease_id)
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
        lease = self.claim(lease_id)
        if vram_mb == lease.vram_mb:
            return lease
        self.ledger.shrink(lease, vram_mb)
        self.counters["shrunk"] += 1
        return self._put(lease, evolve(lease, shrunk_to_mb=vram_mb))

    def revoke(
        self, lease_id: str, reason: str, now: float, *, for_request: str | None = None
    ) -> Lease:
        """Starts taking a lease back. Its memory stays committed until it ends (I4)."""
        lease = self.lease(lease_id)
        if lease.state is LeaseState.REVOKING:
            return lease
        return self._put_revoked(lease, self.revoked(lease, reason, now, for_request))

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def restore_lease(self, lease: Lease, now: float | None = None) -> None:
        """Puts back a lease loaded from storage (the controller's restart at ``now``: a
        grant not taken up yet has its claim bound again from then)."""
        if lease.id in self.leases or not lease.state.holds_memory:
            raise Conflict(f"cannot restore lease {lease.id!r} in state {lease.state}")
        self._add_lease(lease, lease.granted_at if now is None else now)
        self.next_token = max(self.next_token, lease.token + 1)
        self.next_seq = max(self.next_seq, lease.request.seq + 1)

    # ------------------------------------------------------------------ the cycle

    def decide(self, now: float) -> Decisions:
        """One cycle: the timers due fire, then the plan of :meth:`plan` is applied."""
        due = self._due(now)
        if not self.queue and not self._drain_check and not due:
            return _NOTHING
        fired = self.tick(now) if due or self._shrunk else _NOTHING
        applied = self.apply(self.plan(now))
        return applied if fired is _NOTHING else Decisions.of_cycle(fired, applied)

    def tick(self, now: float) -> Decisions:
        """What time and the cluster's shape decide before placement: leases whose TTL
        lapsed expire (or, supervised, are revoked), loads past ``load_timeout_s`` count
        as done, drain deadlines revoke what is left, and, after the cluster shrank,
        pending requests no registered GPU could ever satisfy are rejected. Pending
        requests whose wait ended are timed out by the next plan unless it grants them.
        With presence, requests whose asker is gone end and grants not taken up are
        given back (see :mod:`.presence`)."""
        expired: list[Lease] = []
        loaded: list[Lease] = []
        revoked: list[Lease] = []
        abandoned: list[Request] = []
        unclaimed: list[Lease] = []
        for kind, key in self._timers.due(now, self._timer_live):
            if kind is TimerKind.TTL and self.leases[key].supervised:
                if self.leases[key].state is not LeaseState.REVOKING:  # its agent stops it
                    revoked.append(self.revoke(key, "ttl_lapsed", now))
            elif kind is TimerKind.TTL:
                expired.append(self.release(key, now, LeaseState.EXPIRED))
            elif kind is TimerKind.LOAD:
                loaded.append(self._loaded(key, now))
            elif kind is TimerKind.DRAIN:
                del self._drain_deadlines[key]
                revoked += self._revoke_worker(key, "drain_deadline", now)
            elif kind is TimerKind.ABSENT:
                abandoned.append(self._abandon(key))
            elif kind is TimerKind.CLAIM:  # no process yet: nothing to wait for (I4)
                unclaimed.append(self.release(key, now))
            else:
                self._waits.append(key)
        rejected = self._reject_unplaceable(now) if self._shrunk else []
        if not (expired or loaded or revoked or rejected or abandoned or unclaimed):
            return _NOTHING
        return Decisions(
            revocations=tuple(revoked),
            expired=tuple(expired),
            loaded=tuple(loaded),
            rejected=tuple(rejected),
            abandoned=tuple(abandoned),
            unclaimed=tuple(unclaimed),
        )

    def plan(self, now: float) -> Plan:
        """What a cycle at ``now`` would grant, revoke, hold and time out (see
        :mod:`.cycle`), against the state as it is; the state does not change. Run
        :meth:`tick` first: a plan is made against the state after its timers fired."""
        drained = self.drains_finished() if self._drain_check else ()
        return cycle.plan(self, now, self._waits, drained)

    def apply(self, plan: Plan) -> Decisions:
        """Carries out ``plan``, made by :meth:`plan` against the state as it still is."""
        grants = plan.grants
        if grants:
            for lease in grants:
                self.presence.forget(lease.id)  # pending no more
                self._add_lease(lease, lease.granted_at)
                self.queue.remove(lease.request.id)
            self.next_token = plan.first_token + len(grants)
            self.counters["granted"] += len(grants)
        for revoked in plan.revocations:
            self._put_revoked(self.leases[revoked.id], revoked)
        if plan.nominations is not None:
            self.nominations = dict(plan.nominations)
        if self.nominations:
            for lease in grants:
                self.nominations.pop(lease.request.id, None)
        timed_out = tuple(self._end_wait(rid) for rid in plan.timed_out) if plan.timed_out else ()
        if self._waits:
            self._waits = []
        for name, _, status in plan.drained:
            self.workers[name] = evolve(self.workers[name], status=status)
            self._drain_deadlines.pop(name, None)
        self._drain_check.clear()
        for at in plan.retries:
            self._timers.retry(at)
        self._journal = list(plan.journal)
        self._journal_at = None
        self.counters["examined"] += plan.examined
        if plan.revocations:
            self.counters["preemptions"] += len({r.preempted_for for r in plan.revocations})
        return Decisions(
            grants=plan.grants,
            revocations=plan.revocations,
            timed_out=timed_out,
            workers=plan.drained,
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
                self.nominations.pop(request.id, None)
                self.presence.forget(request.id)
                self.counters["rejected"] += 1
                rejected.append((request, reason))
        return rejected

    def _due(self, now: float) -> bool:
        deadline = self.next_deadline()
        return deadline is not None and deadline <= now

    def next_deadline(self) -> float | None:
        """When ``decide`` must run next if no event comes first (None: never)."""
        return self._timers.next(self._timer_live)

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

    def retry_pending(self, at: float) -> bool:
        """Whether the cycle already runs again at ``at``."""
        return self._timers.retry_pending(at)

    def _end_wait(self, request_id: str) -> Request:
        self.nominations.pop(request_id, None)
        self.presence.forget(request_id)
        self.counters["timed_out"] += 1
        return self.queue.remove(request_id)

    def _abandon(self, request_id: str) -> Request:
        """A pending request whose asker is gone ends (I8's dual)."""
        self.nominations.pop(request_id, None)
        self.presence.forget(request_id)
        self.counters["abandoned"] += 1
        return self.queue.remove(request_id)

    def drains_finished(self) -> tuple[tuple[str, WorkerStatus, WorkerStatus], ...]:
        """Draining workers that may have become empty and are: (name, from, to)."""
        if not self._drain_check:
            return ()
        changes = []
        for name in sorted(self._drain_check):
            worker = self.workers.get(name)
            if worker is None:
                continue
            if worker.status is WorkerStatus.DRAINING and not self._worker_leases.get(name):
                changes.append((name, WorkerStatus.DRAINING, WorkerStatus.DRAINED))
        return tuple(changes)

    # ------------------------------------------------------------------ what the cycle reads

    def matching(self, request: Request) -> frozenset[GpuId]:
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
                        self.ledger.gpu(gpu_id), labels, request.constraints, request.vram_mb
                    )
                    is None
                ]
                if len(on_worker) >= request.gpus:
                    found += on_worker
            cached = self._match_cache[key] = frozenset(found)
        return cached

    def victim_counts(self, *, copy: bool = True) -> tuple[dict[int, int], dict[int, int]]:
        """Base priority -> how many busy preemptible leases, and how many idle ones, may be
        victims (copies, unless ``copy`` is False: then only read them)."""
        if copy:
            return dict(self._victims), dict(self._idle)
        return self._victims, self._idle

    def holds_memory(self, request: Request, nomination: Nomination) -> bool:
        """Whether a preemptor's nomination still holds its memory: its victims have not all
        stopped (or the probe has not shown it yet), or the preemptor fits there now."""
        return nomination.preempting(self.ledger) or all(
            usable(self, g) and self.ledger.free_mb(g) >= request.vram_mb for g in nomination.gpus
        )

    def held_for_preemptors(self) -> dict[str, tuple[GpuId, ...]]:
        """Memory freed, or being freed, by preemption and held for its preemptor against
        every other request in the next cycle: request id -> its GPUs."""
        return {
            request_id: nomination.gpus
            for request_id, nomination in self.nominations.items()
            if request_id in self.queue
            and all(g in self.ledger for g in nomination.gpus)
            and self.holds_memory(self.queue.get(request_id), nomination)
        }

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

    def _put_revoked(self, lease: Lease, revoked: Lease) -> Lease:
        self.counters[f"revoked:{revoked.revoke_reason}"] += 1
        if revoked.expires_at != lease.expires_at:
            self._timers.push(revoked.expires_at, TimerKind.TTL, lease.id)
        return self._put(lease, revoked)

    def _add_lease(self, lease: Lease, since: float) -> None:
        """A held lease joins the state (granted or restored at ``since``)."""
        lease_id = lease.request.id
        self.leases[lease_id] = lease
        self.ledger.commit(lease)
        self._worker_leases.setdefault(lease.worker, set()).add(lease_id)
        self._count_victim(lease, 1)
        self._timers.push(lease.expires_at, TimerKind.TTL, lease_id)
        if lease.loading:
            self._timers.push(lease.load_deadline, TimerKind.LOAD, lease_id)
        self.presence.granted(lease, since, self.policy.claim_bound_s(lease.request.ttl_s))

    # ------------------------------------------------------------------ introspection

    def explain(self, request_id: str, now: float) -> PendingReason:
        """Why a pending request is still pending, against the last cycle's nominations."""
        request = self.queue.get(request_id)
        if self.paused:
            return PendingReason("paused", "the arbiter is paused; nothing is granted until resume")
        if not self.workers:
            return PendingReason("no_workers", "no worker is registered yet; waiting for one")
        nomination = self.nominations.get(request_id)
        if nomination is not None and nomination.preempting(self.ledger):
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
        verdicts = tuple(self._verdict(request, g, holds) for g in sorted(self.ledger.ids()))
        return self._reason(request, verdicts, holders, own, now)

    def _preempting(self, nomination: Nomination, now: float) -> PendingReason:
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
            for lease_id in sorted(self.ledger.lease_ids(verdict.gpu)):
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
        """What the stages say of ``gpu_id`` for ``request`` (see :mod:`.stages`), with the
        figures behind it."""
        return GpuVerdict(
            gpu_id,
            outcome(self, request, gpu_id, holds) or "fits",
            need_mb=request.vram_mb,
            free_mb=max(0, self.ledger.free_mb(gpu_id)),
            committed_mb=self.ledger.committed_mb(gpu_id),
            observed_mb=self.ledger.observed_mb(gpu_id),
            held_mb=holds.get(gpu_id, 0),
        )

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
            return self._insufficient(request, verdicts, own, summary, now)
        if codes & {"worker_draining", "worker_drained", "worker_offline", "probe_stale"}:
            return PendingReason("workers_draining", summary, verdicts, own)
        return PendingReason("no_matching_gpu", summary, verdicts, own)

    def _insufficient(
        self,
        request: Request,
        verdicts: tuple[GpuVerdict, ...],
        own: tuple[GpuId, ...],
        summary: str,
        now: float,
    ) -> PendingReason:
        """Too full: the leases in the way by name, when nothing else is (see :mod:`.reasons`)."""
        blockers = lease_blockers(request, verdicts, self.leases, self.ledger, self.policy)
        if not blockers:
            return PendingReason("insufficient_vram", summary, verdicts, own)
        message = f"{summary}; {waiting_sentence(blockers, request.priority, now)}"
        last = blockers[0]
        return PendingReason(
            "insufficient_vram", message, verdicts, own, last.id, last, blockers=blockers
        )

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
