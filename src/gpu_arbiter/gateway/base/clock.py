"""The gateway's time: :class:`Clock` (the time and sleeping; real: the event loop's
monotonic clock, :class:`LoopClock`; tests give a virtual one). How a waiting loop
sleeps on it, a sleep that an event cuts short, is :func:`.race.sleep_or` (importable
from here too)."""

from __future__ import annotations

import asyncio
from typing import Protocol

from .race import sleep_or

__all__ = ["Clock", "LoopClock", "sleep_or"]


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    """The event loop's own clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
