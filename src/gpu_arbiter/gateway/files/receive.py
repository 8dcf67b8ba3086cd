"""A peer's answer read straight into the chunks the store writes: an asyncio
``BufferedProtocol`` whose socket reads land in a chunk's own buffer (no copy between
the socket and the file but the kernel's), at most :data:`AHEAD` chunks ahead of the
store (reading pauses beyond: the memory a copy holds is bounded). A chunk the store is
done with comes back (:meth:`Receiver.give_back`) and is filled again."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import cast

__all__ = ["AHEAD", "Receiver"]

AHEAD = 2
"""Full chunks held for the store at most before reading pauses."""


class Receiver(asyncio.BufferedProtocol):
    """One connection's bytes in ``chunk_bytes`` chunks: :meth:`head`, then
    :meth:`chunk` until the body's end (b"" once the peer closed: a cut)."""

    def __init__(self, chunk_bytes: int) -> None:
        self._size = chunk_bytes
        self._buffer = bytearray(chunk_bytes)
        self._filled = 0
        self._ready: deque[bytearray] = deque()
        self._spare: list[bytearray] = []
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.done = False
        self.error: BaseException | None = None
        self.transport: asyncio.Transport | None = None

    # ------------------------------------------------------------------ the protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buffer)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._filled == self._size:
            self._ready.append(self._buffer)
            self._buffer, self._filled = self._fresh(), 0
            if len(self._ready) >= AHEAD and self.transport is not None:
                self.transport.pause_reading()
                self._paused = True
        self._wake()

    def eof_received(self) -> bool:
        self.done = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.done, self.error = True, exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _more(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # ------------------------------------------------------------------ the reader

    async def head(self, most: int) -> bytes | None:
        """The answer's head, up to its blank line (None: beyond ``most`` bytes, or the
        peer closed before); the body's first bytes stay for :meth:`chunk`."""
        while True:
            end = self._buffer.find(b"\r\n\r\n", 0, self._filled)
            if end >= 0:
                end += 4
                head = bytes(self._buffer[:end])
                rest = self._filled - end
                self._buffer[:rest] = self._buffer[end : self._filled]
                self._filled = rest
                return head
            if self._filled > most or self.done or self._ready:
                return None
            await self._more()

    async def chunk(self, left: int) -> bytearray:
        """The body's next chunk (``left``: its bytes still to come); empty once the
        peer closed before them."""
        while True:
            if self._ready:
                found = self._ready.popleft()
                if self._paused and len(self._ready) < AHEAD and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return found
            if self._filled and (self._filled >= left or self.done):
                found = self._buffer[: self._filled]  # a copy: the buffer is filled again
                self._filled = 0
                return found
            if self.done:
                return bytearray()
            await self._more()

    def give_back(self, chunk: bytearray) -> None:
        """``chunk``, read and no longer used, to be filled again (a full chunk; anything
        else is left alone)."""
        if len(chunk) == self._size:
            self._spare.append(chunk)

    def _fresh(self) -> bytearray:
        return self._spare.pop() if self._spare else bytearray(self._size)
