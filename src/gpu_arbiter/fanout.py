"""``Fanout``: wakes many waiters (event streams) cheaply, whatever their number.

- Waking is coalesced: :meth:`Fanout.wake_soon` asks for a wake; one comes after
  ``min_interval_s``, or later when the last one took long (fan-out keeps at most
  ``1 / (1 + spacing)`` of the event loop), carrying everything since.
- A wake sets the waiters' futures a slice at a time, one slice per turn of the loop:
  requests are served in between, so thousands of waiters never hold the loop.
- Nothing waits on a timer of its own: every waiter is woken at least every
  ``tick_s`` (one timer for all), which is when idle streams send their keep-alives.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["Fanout"]

SLICE = 16
"""Waiters woken per turn of the event loop."""


class Fanout:
    def __init__(self, *, min_interval_s: float, tick_s: float, spacing: float = 4.0) -> None:
        self.min_interval_s = min_interval_s
        self.tick_s = tick_s
        self.spacing = spacing
        self._waiters: list[asyncio.Future[None]] = []
        self._pending: asyncio.TimerHandle | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._next_at = 0.0  # the earliest time the next wake may start (loop time)
        self.wakes = 0  # how many wakes were run (for tests and figures)

    async def wait(self) -> None:
        """Returns at the next wake (or tick); always suspends."""
        loop = asyncio.get_running_loop()
        if self._tick is None:
            self._tick = loop.call_later(self.tick_s, self._on_tick)
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        await waiter

    def wake_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """A wake, at the earliest ``min_interval_s`` from now (or the last wake's spacing)."""
        if self._pending is None:
            delay = max(self.min_interval_s, self._next_at - loop.time())
            self._pending = loop.call_later(delay, self.wake_now)

    def wake_now(self) -> None:
        """Wakes every waiter now (in slices)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        waiters, self._waiters = self._waiters, []
        if waiters:
            self.wakes += 1
            self._wake_slice(waiters, 0, time.perf_counter())

    def _wake_slice(self, waiters: list[asyncio.Future[None]], start: int, began: float) -> None:
        for waiter in waiters[start : start + SLICE]:
            if not waiter.done():  # a cancelled waiter: its stream went
                waiter.set_result(None)
        loop = asyncio.get_running_loop()
        if start + SLICE < len(waiters):
            loop.call_soon(self._wake_slice, waiters, start + SLICE, began)
        else:
            took = time.perf_counter() - began
            self._next_at = loop.time() + took * self.spacing

    def _on_tick(self) -> None:
        self._tick = None
        self.wake_now()
