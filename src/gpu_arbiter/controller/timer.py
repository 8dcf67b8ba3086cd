"""The controller's one timer: a ``call_later`` for the earliest deadline of the core,
of the heartbeats and of the running updates; when it fires it runs an empty change
(whose cycle expires, times out, revokes and sweeps what is due). Nothing polls.

Owns only its timer handle. Calls :meth:`~.change.Changes.change`, reads the
:class:`~.change.Gate`, and asks the deadline callables it was given.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from .change import Changes
from .values import ServiceUnavailable

__all__ = ["Timer"]

log = logging.getLogger("gpu_arbiter.controller")


class Timer:
    def __init__(self, changes: Changes, deadlines: Sequence[Callable[[], float | None]]) -> None:
        self._changes = changes
        self._deadlines = tuple(deadlines)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None

    def next_wakeup(self) -> float | None:
        found = [deadline() for deadline in self._deadlines]
        return min((d for d in found if d is not None), default=None)

    def arm(self) -> None:
        gate = self._changes.gate
        if gate.loop is None or gate.idle:
            return
        at = self.next_wakeup()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            delay = max(0.0, at - self._changes.clock())
            self._timer = gate.loop.call_later(delay, self._on_timer)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_at = None

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
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
