"""What a driver does with a cycle's decisions, in one order for every driver.

The asyncio engine, the controller and the simulator each run the cycle
(:meth:`~.scheduler.Scheduler.decide`) and carry its decisions out their own way —
wake a waiter, record and store a change, log a step — but they receive them the same
way: :func:`hand_over` gives each decision to the driver's :class:`Outcomes`, one
method per kind, causes before their effects::

    expired  ─┐
    unclaimed │
    timed_out ├─ leases and requests that ended, loads that finished
    abandoned │
    rejected  │
    loaded   ─┘
    drained ─── the drains those ends completed
    revoked ─── the revocations (a preemptor's victims)
    granted ─── last, the grants all of this made room for

After it, the driver moves its one timer to :meth:`~.scheduler.Scheduler.next_deadline`
(the core never polls, and never needs a tick). That timer is an :class:`Alarm` for
every driver: armed at one deadline at a time on the driver's :class:`Clock` (the event
loop's, the controller's, a test's virtual one, the simulator's event heap), moved only
when the deadline moves, and disarmed by its own ringing, so that a timer that rang a
moment early is armed again rather than taken for the one still due.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from .model import Lease, Request, WorkerStatus
from .reasons import PendingReason
from .scheduler import Decisions

__all__ = ["Alarm", "Clock", "Outcomes", "Timer", "hand_over"]


class Outcomes(Protocol):
    """A driver's reaction to each kind of decision."""

    def expired(self, lease: Lease) -> None: ...

    def timed_out(self, request: Request) -> None: ...

    def abandoned(self, request: Request) -> None: ...

    def unclaimed(self, lease: Lease) -> None: ...

    def rejected(self, request: Request, reason: PendingReason) -> None: ...

    def loaded(self, lease: Lease) -> None: ...

    def drained(self, worker: str, previous: WorkerStatus, status: WorkerStatus) -> None: ...

    def revoked(self, leases: Sequence[Lease]) -> None: ...

    def granted(self, lease: Lease) -> None: ...


def hand_over(decisions: Decisions, outcomes: Outcomes) -> None:
    """Gives each of ``decisions`` to ``outcomes``, in the order of the module."""
    for lease in decisions.expired:
        outcomes.expired(lease)
    for lease in decisions.unclaimed:
        outcomes.unclaimed(lease)
    for request in decisions.timed_out:
        outcomes.timed_out(request)
    for request in decisions.abandoned:
        outcomes.abandoned(request)
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


class Timer(Protocol):
    """A callback a :class:`Clock` will run unless cancelled first."""

    def cancel(self) -> None: ...


class Schedules(Protocol):
    """What an :class:`Alarm` needs of a clock: a callback run at a time."""

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer: ...


class Clock(Schedules, Protocol):
    """A driver's time: monotonic seconds, and a callback run at a time."""

    def now(self) -> float: ...


class Alarm:
    """A driver's one timer: ``ring`` is called once the deadline it was last
    :meth:`set` to has come (None or an infinite one: never). Setting the deadline it is
    already armed for changes nothing, so that a driver may set it after every event
    without cancelling and arming a timer each time."""

    __slots__ = ("_clock", "_ring", "_timer", "at")

    def __init__(self, clock: Schedules, ring: Callable[[], object]) -> None:
        self._clock = clock
        self._ring = ring
        self._timer: Timer | None = None
        self.at: float | None = None
        """The deadline it is armed for; None when disarmed."""

    def set(self, deadline: float | None) -> None:
        if deadline == self.at:  # the common case: first, and nothing else to do
            return
        if deadline is not None and not math.isfinite(deadline):
            deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.at = deadline
        if deadline is not None:
            self._timer = self._clock.call_at(deadline, self._rang)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self.at = None

    def _rang(self) -> None:
        self._timer = None
        self.at = None
        self._ring()
