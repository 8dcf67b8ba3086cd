"""The decision core: events in, a plan out, the plan applied. Pure: no asyncio, no I/O,
no clock.

Callers (the asyncio engine, the controller, the simulator) report events —
``submit``, ``release``, ``ready``, ``set_probe``, ``drain`` ... — each with the
time as an argument, then run a cycle with the time::

    event ──► Scheduler (its State) ──plan(now)──► Plan: what the timers due end, then
                 ▲                                 grants, revocations, nominations,
                 │                                 time-outs, drained workers, and why
                 │                                 each request examined waits; the
                 │                                 state only read (:mod:`.cycle`)
                 └──────────── apply(plan) ◄────── the driver carries it out

:meth:`Scheduler.decide` is ``apply(plan(now))``, returning :class:`Decisions`; the
caller carries them out (wakes waiters, cancels holders, persists). A driver may store
a plan before applying it and drop it if that fails: making it changed nothing.
:meth:`~.state.State.next_deadline` says when the cycle must run again if nothing else
happens: no polling. "Why is it pending" (:meth:`~.state.State.explain`) reads the last
plan's diagnoses (:mod:`.explain`).

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

from dataclasses import dataclass

from . import cycle
from .errors import Conflict, InvalidInput, Unschedulable
from .model import (
    Lease,
    LeaseState,
    Policy,
    Request,
    WorkerStatus,
    evolve,
    slot_init,
)
from .plan import Plan
from .reasons import PendingReason
from .timers import TimerKind
from .units import format_mb
from .workers import WorkerEvents

__all__ = ["Decisions", "Scheduler"]


@slot_init
@dataclass(frozen=True, slots=True)
class Decisions:
    """What one applied plan did, for the driver to carry out."""

    grants: tuple[Lease, ...] = ()
    revocations: tuple[Lease, ...] = ()
    expired: tuple[Lease, ...] = ()
    timed_out: tuple[Request, ...] = ()
    loaded: tuple[Lease, ...] = ()
    workers: tuple[tuple[str, WorkerStatus, WorkerStatus], ...] = ()
    rejected: tuple[tuple[Request, PendingReason], ...] = ()
    abandoned: tuple[Request, ...] = ()
    unclaimed: tuple[Lease, ...] = ()

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


class Scheduler(WorkerEvents):
    def __init__(
        self,
        policy: Policy | None = None,
        *,
        next_token: int = 1,
        next_seq: int = 1,
        presence: bool = False,
    ):
        super().__init__(policy, next_token, next_seq, presence)

    # ------------------------------------------------------------------ requests and leases

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
        """One cycle: ``apply(plan(now))``."""
        if not self.queue and not self._drain_check and not self._reshaped:
            deadline = self.next_deadline()
            if deadline is None or deadline > now:
                return _NOTHING
        return self.apply(self.plan(now))

    def plan(self, now: float) -> Plan:
        """What a cycle at ``now`` would end, grant, revoke, hold and time out (see
        :mod:`.cycle`), against the state as it is; the state does not change."""
        return cycle.plan(self, now)

    def apply(self, plan: Plan) -> Decisions:
        """Carries out ``plan``, made by :meth:`plan` against the state as it still is:
        what time ended first (in the order :mod:`.endings` gives), then placement."""
        now = plan.now
        self._timers.drop_due(now)
        for revoked in plan.revocations:
            self._put_revoked(self.leases[revoked.id], revoked)
        for lease in plan.loaded:
            self._loaded(lease.id, now)
        expired = tuple(self.release(e.id, now, LeaseState.EXPIRED) for e in plan.expired)
        unclaimed = tuple(self.release(u.id, now) for u in plan.unclaimed)
        for request in plan.abandoned:
            self._forget_request(request.id, "abandoned")
        for request, _ in plan.rejected:
            self._forget_request(request.id, "rejected")
        for name in plan.deadlines:
            self._drain_deadlines.pop(name, None)
        self._reshaped = False
        self._place(plan)
        timed_out = tuple(self._forget_request(rid, "timed_out") for rid in plan.timed_out)
        for name, _, status in plan.drained:
            self.workers[name] = evolve(self.workers[name], status=status)
            self._drain_deadlines.pop(name, None)
            self._workers_changed()
        self._drain_check.clear()
        for at in plan.retries:
            self._timers.retry(at)
        self._last_plan(plan)
        self.counters["examined"] += plan.examined
        return Decisions(
            grants=plan.grants,
            revocations=plan.revocations,
            expired=expired,
            timed_out=timed_out,
            loaded=plan.loaded,
            workers=plan.drained,
            rejected=plan.rejected,
            abandoned=plan.abandoned,
            unclaimed=unclaimed,
        )

    def _place(self, plan: Plan) -> None:
        """The plan's grants and its preemptors' nominations."""
        grants = plan.grants
        for lease in grants:
            self.presence.forget(lease.id)  # pending no more
            self._add_lease(lease, lease.granted_at)
            self.queue.remove(lease.request.id)
        if grants:
            self.next_token = plan.first_token + len(grants)
            self.counters["granted"] += len(grants)
        if plan.nominations is not None:
            self.nominations = dict(plan.nominations)
        if self.nominations:
            for lease in grants:
                self.nominations.pop(lease.request.id, None)
        preemptions = {r.preempted_for for r in plan.revocations if r.preempted_for}
        if preemptions:
            self.counters["preemptions"] += len(preemptions)

    def _forget_request(self, request_id: str, why: str) -> Request:
        """A pending request ends without a grant (timed out, abandoned, rejected)."""
        self.nominations.pop(request_id, None)
        self.presence.forget(request_id)
        self.counters[why] += 1
        return self.queue.remove(request_id)

    # ------------------------------------------------------------------ bookkeeping

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
