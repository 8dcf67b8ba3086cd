"""A plan: everything one scheduling cycle decides, against the state it was made from.

:func:`~.cycle.plan` makes one from a read-only :class:`~.view.View`;
:meth:`~.scheduler.Scheduler.apply` carries it out, and ``decide(now)`` is exactly
``apply(plan(now))``. A driver that stores what it decides can store the plan before
applying it: a plan that could not be stored is simply dropped, the state untouched.
:func:`~.verify.check_plan` checks one against the state it was made from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .diagnosis import Turn
from .model import GpuId, Lease, Request, WorkerStatus, slot_init
from .nominations import Hold, Nomination
from .reasons import PendingReason

__all__ = ["Plan"]


@slot_init
@dataclass(frozen=True, slots=True)
class Plan:
    """What time ends first (:mod:`.endings`): ``expired`` and ``unclaimed`` leases as
    they end, ``loaded`` leases whose load timed out, ``abandoned`` and ``rejected``
    pending requests, ``deadlines``: workers whose drain deadline passed (their leases'
    revocations lead ``revocations``).

    Then placement (:mod:`.cycle`): ``grants``: new leases, tokens from ``first_token``
    on, in walk order; ``revocations``: held leases as they will be once revoked
    (``preempted_for`` names a preemptor); ``nominations``: the preemptors' nominations
    after the cycle (None: as they were); ``timed_out``: pending requests whose wait ended
    ungranted; ``drained``: draining workers left empty; ``retries``: times the cycle
    must run again (a victim becomes eligible then); ``turns``: where the walk stood for
    each request it examined and did not place (its "why" is worked out from it);
    ``holds``: who held which GPUs' memory, in walk order, the first ``preholds`` of them
    the memory preemption freed, pre-held for its preemptors (:meth:`held` reads them
    typed); ``examined``: requests walked."""

    now: float
    first_token: int
    expired: tuple[Lease, ...] = ()
    unclaimed: tuple[Lease, ...] = ()
    loaded: tuple[Lease, ...] = ()
    abandoned: tuple[Request, ...] = ()
    rejected: tuple[tuple[Request, PendingReason], ...] = ()
    deadlines: tuple[str, ...] = ()
    grants: tuple[Lease, ...] = ()
    revocations: tuple[Lease, ...] = ()
    nominations: Mapping[str, Nomination] | None = None
    timed_out: tuple[str, ...] = ()
    drained: tuple[tuple[str, WorkerStatus, WorkerStatus], ...] = ()
    retries: tuple[float, ...] = ()
    turns: Mapping[str, Turn] = field(default_factory=dict)
    holds: tuple[tuple[str, tuple[GpuId, ...], int], ...] = ()
    preholds: int = 0
    examined: int = 0

    def held(self) -> tuple[Hold, ...]:
        """The walk's holds in walk order, each saying whether it is a prehold (see
        :mod:`.nominations`): what a check of I6 and I10 reads, never the "why"."""
        preholds = self.preholds
        return tuple(
            Hold(rid, gpus, mb, i < preholds) for i, (rid, gpus, mb) in enumerate(self.holds)
        )

    def __bool__(self) -> bool:
        return bool(
            self.grants
            or self.revocations
            or self.timed_out
            or self.drained
            or self.expired
            or self.unclaimed
            or self.loaded
            or self.abandoned
            or self.rejected
        )
