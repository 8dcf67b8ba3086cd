"""The controller's one timer: a ``call_later`` for the earliest deadline of the core,
of the heartbeats and of the running updates; when it fires it runs an empty change
(whose cycle expires, times out, revokes and sweeps what is due). Nothing polls. It is
the core's :class:`~..core.Alarm`, as the engine's and the simulator's timers are, on the
controller's clock with its callbacks on the server's loop.

Its part of every change (a :class:`~.change.Participant`): :meth:`Timer.committed`
arms it for the deadlines as the change left them.

Owns only its alarm. Calls :meth:`~.change.Changes.change`, reads the
:class:`~.change.Gate`, and asks the deadline callables it was given.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from ..core import Alarm
from .change import Changes, Participant
from .values import ServiceUnavailable

__all__ = ["Timer"]

log = logging.getLogger("gpu_arbiter.controller")


class _OnLoop:
    """The controller's clock (:attr:`Changes.clock`, which tests move), its callbacks run
    on the server's loop when that clock reaches their time."""

    __slots__ = ("_changes",)

    def __init__(self, changes: Changes) -> None:
        self._changes = changes

    def now(self) -> float:
        return self._changes.clock()

    def call_at(self, when: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        loop = self._changes.gate.loop
        assert loop is not None, "armed only once the server's loop runs"
        return loop.call_later(max(0.0, when - self.now()), callback)


class Timer(Participant):
    def __init__(self, changes: Changes, deadlines: Sequence[Callable[[], float | None]]) -> None:
        self._changes = changes
        self._deadlines = tuple(deadlines)
        self._alarm = Alarm(_OnLoop(changes), self._on_timer)

    def next_wakeup(self) -> float | None:
        found = [deadline() for deadline in self._deadlines]
        return min((d for d in found if d is not None), default=None)

    def arm(self) -> None:
        gate = self._changes.gate
        if gate.loop is None or gate.idle:
            return
        self._alarm.set(self.next_wakeup())

    def committed(self) -> None:
        """A change is done, or a deadline moved outside one: the alarm follows."""
        self.arm()

    def stop(self) -> None:
        self._alarm.cancel()

    def _on_timer(self) -> None:
        gate = self._changes.gate
        if gate.broken is not None or gate.idle:
            return
        try:
            with self._changes.change():
                pass
        except ServiceUnavailable:
            pass
        except Exception:  # a bug must not stop the timer for good
            log.exception("timer cycle failed")
            self.arm()
