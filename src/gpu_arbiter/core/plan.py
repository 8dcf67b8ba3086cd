"""A plan: what one scheduling cycle proposes, against the state it was made from.

:meth:`~.scheduler.Scheduler.plan` makes one without changing the state;
:meth:`~.scheduler.Scheduler.apply` carries it out. A driver that stores what it
decides stores the plan first: a plan that could not be stored is simply dropped.
:func:`~.verify.check_plan` checks one against the state it was made from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .model import GpuId, Lease, WorkerStatus, slot_init
from .nominations import Nomination

__all__ = ["Plan"]


@slot_init
@dataclass(frozen=True, slots=True)
class Plan:
    """``grants``: new leases, tokens from ``first_token`` on, in walk order;
    ``revocations``: held leases as they will be once revoked (``preempted_for`` names
    the preemptor); ``nominations``: the preemptors' nominations after the cycle (None:
    as they were); ``timed_out``: pending requests whose wait ended ungranted;
    ``drained``: draining workers left empty; ``retries``: times the cycle must run
    again (a victim becomes eligible then); ``journal``: who held which GPUs' memory, in
    walk order (what "why is it pending" replays); ``examined``: requests walked."""

    now: float
    first_token: int
    grants: tuple[Lease, ...] = ()
    revocations: tuple[Lease, ...] = ()
    nominations: Mapping[str, Nomination] | None = None
    timed_out: tuple[str, ...] = ()
    drained: tuple[tuple[str, WorkerStatus, WorkerStatus], ...] = ()
    retries: tuple[float, ...] = ()
    journal: tuple[tuple[str, tuple[GpuId, ...], int], ...] = ()
    examined: int = 0

    def __bool__(self) -> bool:
        return bool(self.grants or self.revocations or self.timed_out or self.drained)
