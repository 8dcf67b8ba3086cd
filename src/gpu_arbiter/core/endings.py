"""What time and the cluster's shape end before placement, as the first part of a plan.

Read from the timers due at ``now`` (:meth:`~.timers.Timers.due`, which changes
nothing), in the order they fell due:

    a lease's TTL lapsed            it expires; a lease an agent supervises is revoked
                                    (``ttl_lapsed``) instead: its memory stays committed
                                    until the agent confirms the process exited (I4)
    a load ran past its timeout     it counts as done: the GPU's load gate opens (I3)
    a drain's deadline passed       the worker's leases are revoked (``drain_deadline``)
    an asker unseen for its TTL     its pending request ends (``abandoned``, I8's dual)
    a grant not taken up in time    it is given back (``unclaimed``): no process yet
    a request's max_wait_s ended    it times out, unless the same plan grants it

and, after the cluster shrank (a worker removed or registered again with other GPUs or
labels), the pending requests no registered GPU could ever take any more: rejected, as
a new one would be. :func:`endings` only reads; the walk then sees the state as these
leave it (:class:`~.overlay.Overlay`), and :meth:`~.scheduler.Scheduler.apply` carries
them out first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from .model import Lease, LeaseState, Request, evolve
from .queue import PendingQueue
from .reasons import PendingReason
from .timers import TimerKind

__all__ = ["Endings", "endings"]


@dataclass(slots=True)
class Endings:
    """``expired`` and ``unclaimed``: leases as they end; ``loaded``: leases as their load
    counts as done; ``revocations``: leases as revoked (``ttl_lapsed``, ``drain_deadline``);
    ``abandoned``, ``waits`` (wait over: timed out unless granted), ``rejected``: pending
    requests; ``deadlines``: workers whose drain deadline passed."""

    expired: list[Lease] = field(default_factory=list)
    unclaimed: list[Lease] = field(default_factory=list)
    loaded: list[Lease] = field(default_factory=list)
    revocations: list[Lease] = field(default_factory=list)
    abandoned: list[Request] = field(default_factory=list)
    waits: list[str] = field(default_factory=list)
    rejected: list[tuple[Request, PendingReason]] = field(default_factory=list)
    deadlines: list[str] = field(default_factory=list)
    leases: dict[str, Lease | None] = field(default_factory=dict)  # as they are now; None: gone
    requests: set[str] = field(default_factory=set)  # pending requests ended

    def lease(self, held: Mapping[str, Lease], lease_id: str) -> Lease | None:
        return self.leases[lease_id] if lease_id in self.leases else held.get(lease_id)


def endings(
    due: Iterable[tuple[TimerKind, str]],
    now: float,
    *,
    leases: Mapping[str, Lease],
    queue: PendingQueue,
    worker_leases: Callable[[str], Iterable[str]],
    revoked: Callable[[Lease, str, float], Lease],
    reject: Callable[[Request], PendingReason | None] | None,
    ordered: Callable[[], Iterable[Request]],
) -> Endings:
    """What the timers ``due`` at ``now`` end (see the module), and, with ``reject``
    (after the cluster shrank), the pending requests it refuses, in queue order."""
    out = Endings()
    for kind, key in due:
        if kind is TimerKind.WAIT:
            if key not in out.requests:
                out.waits.append(key)
        elif kind is TimerKind.ABSENT:
            if key not in out.requests:
                out.requests.add(key)
                out.abandoned.append(queue.get(key))
        elif kind is TimerKind.DRAIN:
            out.deadlines.append(key)
            for lease_id in sorted(worker_leases(key)):
                _revoke(out, leases, lease_id, "drain_deadline", now, revoked)
        else:
            _lease_timer(out, kind, key, leases, now, revoked)
    if reject is not None:
        for request in ordered():
            reason = None if request.id in out.requests else reject(request)
            if reason is not None:
                out.requests.add(request.id)
                out.rejected.append((request, reason))
    return out


def _lease_timer(
    out: Endings,
    kind: TimerKind,
    key: str,
    leases: Mapping[str, Lease],
    now: float,
    revoked: Callable[[Lease, str, float], Lease],
) -> None:
    """A lease's TTL, load timeout or claim bound came due."""
    lease = out.lease(leases, key)
    if lease is None:
        return  # ended earlier in this plan
    if kind is TimerKind.TTL and lease.supervised:
        _revoke(out, leases, key, "ttl_lapsed", now, revoked)
    elif kind is TimerKind.TTL:
        out.expired.append(evolve(lease, state=LeaseState.EXPIRED, ended_at=now, loading=False))
        out.leases[key] = None
    elif kind is TimerKind.LOAD:
        state = LeaseState.ACTIVE if lease.state is LeaseState.LOADING else lease.state
        loaded = evolve(lease, loading=False, state=state, last_used_at=now)
        out.loaded.append(loaded)
        out.leases[key] = loaded
    elif kind is TimerKind.CLAIM:  # no process yet: nothing to wait for (I4)
        out.unclaimed.append(evolve(lease, state=LeaseState.RELEASED, ended_at=now, loading=False))
        out.leases[key] = None


def _revoke(
    out: Endings,
    leases: Mapping[str, Lease],
    lease_id: str,
    reason: str,
    now: float,
    revoked: Callable[[Lease, str, float], Lease],
) -> None:
    lease = out.lease(leases, lease_id)
    if lease is None or lease.state is LeaseState.REVOKING:
        return
    gone = revoked(lease, reason, now)
    out.revocations.append(gone)
    out.leases[lease_id] = gone
