"""A cancel scope (Trio's, over ``asyncio.timeout``): code runs inside ``async with
scope:``, and whoever holds the scope (the replica that cuts its relays at the end of
a grace, the watcher of a client's disconnect) cancels that code from anywhere with
:meth:`CancelScope.cancel`. The code inside is cancelled at its next await and the
scope swallows it: after the block, ``cancelled_caught`` says it happened and
``reason`` why. A cancellation from anywhere else propagates as usual, so no
``uncancel()`` bookkeeping is needed by those who cancel."""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["CancelScope"]


class CancelScope:
    __slots__ = ("_timeout", "cancelled_caught", "reason")

    def __init__(self) -> None:
        self._timeout: asyncio.Timeout | None = None
        self.reason: str | None = None
        self.cancelled_caught = False

    def cancel(self, reason: str) -> None:
        """Cancels the code inside (now, or as soon as it enters); the first reason stays."""
        if self.reason is None:
            self.reason = reason
        if self._timeout is not None and not self._timeout.expired():
            self._timeout.reschedule(asyncio.get_running_loop().time())

    async def __aenter__(self) -> CancelScope:
        self._timeout = asyncio.timeout(None)
        await self._timeout.__aenter__()
        if self.reason is not None:
            self._timeout.reschedule(asyncio.get_running_loop().time())
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        timeout, self._timeout = self._timeout, None  # once out, a cancel changes nothing
        assert timeout is not None
        try:
            await timeout.__aexit__(kind, error, traceback)
        except TimeoutError:
            if self.reason is None:
                raise
            self.cancelled_caught = True
            return True
        return False
