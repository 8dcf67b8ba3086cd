"""What a driver does with a cycle's decisions, in one order for every driver.

The asyncio engine, the controller and the simulator each run the cycle
(:meth:`~.scheduler.Scheduler.decide`) and carry its decisions out their own way —
wake a waiter, record and store a change, log a step — but they receive them the same
way: :func:`hand_over` gives each decision to the driver's :class:`Outcomes`, one
method per kind, causes before their effects::

    expired ─┐
    timed_out├─ leases and requests that ended, loads that finished
    rejected │
    loaded  ─┘
    drained ─── the drains those ends completed
    revoked ─── the revocations (a preemptor's victims)
    granted ─── last, the grants all of this made room for

After it, the driver moves its one timer to :meth:`~.scheduler.Scheduler.next_deadline`
(the core never polls, and never needs a tick).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .model import Lease, Request, WorkerStatus
from .reasons import PendingReason
from .scheduler import Decisions

__all__ = ["Outcomes", "hand_over"]


class Outcomes(Protocol):
    """A driver's reaction to each kind of decision."""

    def expired(self, lease: Lease) -> None: ...

    def timed_out(self, request: Request) -> None: ...

    def rejected(self, request: Request, reason: PendingReason) -> None: ...

    def loaded(self, lease: Lease) -> None: ...

    def drained(self, worker: str, previous: WorkerStatus, status: WorkerStatus) -> None: ...

    def revoked(self, leases: Sequence[Lease]) -> None: ...

    def granted(self, lease: Lease) -> None: ...


def hand_over(decisions: Decisions, outcomes: Outcomes) -> None:
    """Gives each of ``decisions`` to ``outcomes``, in the order of the module."""
    for lease in decisions.expired:
        outcomes.expired(lease)
    for request in decisions.timed_out:
        outcomes.timed_out(request)
    for request, reason in decisions.rejected:
        outcomes.rejected(request, reason)
    for lease in decisions.loaded:
        outcomes.loaded(lease)
    for name, previous, status in decisions.workers:
        outcomes.drained(name, previous, status)
    if decisions.revocations:
        outcomes.revoked(decisions.revocations)
    for lease in decisions.grants:
        outcomes.granted(lease)
