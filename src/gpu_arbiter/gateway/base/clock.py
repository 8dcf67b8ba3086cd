"""The gateway's time: :class:`Clock` (the time and sleeping; real: the event loop's
monotonic clock, :class:`LoopClock`; tests give a virtual one). How a waiting loop
sleeps on it, a sleep that an event cuts short, is :func:`.race.sleep_or` (importable
from here too)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol

from .race import Sleep, sleep_or

__all__ = ["Clock", "LoopClock", "sleep_or"]


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def sleep(self, seconds: float) -> Awaitable[None]: ...


class LoopClock:
    """The event loop's own clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def sleep(self, seconds: float) -> Sleep:
        """``seconds`` of sleep (a :class:`.race.Sleep`: :func:`sleep_or` starts no task
        for it)."""
        return Sleep(seconds)
