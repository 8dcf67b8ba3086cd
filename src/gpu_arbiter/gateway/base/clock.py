"""The gateway's time: :class:`Clock` (the time and sleeping; real: the event loop's
monotonic clock, :class:`LoopClock`; tests give a virtual one) and :func:`sleep_or`,
how a waiting loop sleeps on it: a sleep that an event cuts short."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Protocol

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


async def sleep_or(sleeping: Awaitable[Any], event: asyncio.Event) -> bool:
    """Waits for ``sleeping`` (a clock's sleep) or ``event``; True when the event came."""
    if event.is_set():
        if asyncio.iscoroutine(sleeping):
            sleeping.close()
        return True
    sleeper = asyncio.ensure_future(sleeping)
    woken = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({sleeper, woken}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        woken.cancel()
    return event.is_set()
