"""ASGI's zero-copy send (``http.response.zerocopysend``) on a plain TCP connection: a
file's bytes go from the page cache to the socket with ``sendfile(2)`` and never pass
through Python. A model file served to a peer (``GET /files/NAME``) took 0.6 to 0.9 ms
of the serving gateway's CPU per MiB read and written through the event loop, and
0.08 ms with ``sendfile`` (``bench/bench_file_copy.py``).

:func:`offer` puts the extension in a request's scope (``scope["extensions"]``) when
its connection is plain TCP: over TLS every byte is encrypted in this process, so the
extension is not offered and the app sends its body as usual. The message (the ASGI
spec's): ``file`` (an open file), ``offset`` (None: the file's position), ``count``
(None: to its end), ``more_body``. Its bytes count against the answer's
Content-Length as a body message's do.

The socket is written on the event loop, without blocking: ``sendfile`` on the
non-blocking socket sends what its buffer takes, and the loop waits until it takes
more (a reader that stops holds only its own coroutine, as flow control holds a body
message's). The writes go to a duplicate of the connection's descriptor, so that the
loop's transport closing its own (the client went away) cannot let the number name
another connection meanwhile. A head still in the transport's buffer (a slow client of
a kept-alive connection) would be overtaken by bytes written beside it: the file is
then sent through the transport, read in a thread, :data:`CHUNK_BYTES` at a time.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

__all__ = ["CHUNK_BYTES", "ZEROCOPY", "offer"]

ZEROCOPY = "http.response.zerocopysend"
CHUNK_BYTES = 1 << 20
"""A read of the file when it must go through the transport."""

Message = Any  # an ASGI message (a mapping)


def offer(cycle: Any, transport: asyncio.Transport) -> None:
    """Offers the extension to ``cycle`` (uvicorn's request-response cycle, before its
    app runs) when ``transport`` is plain TCP on a system with ``sendfile``."""
    if not hasattr(os, "sendfile") or transport.get_extra_info("sslcontext") is not None:
        return
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    cycle.scope.setdefault("extensions", {})[ZEROCOPY] = {}
    cycle.send = _Sender(cycle, transport, sock.fileno()).send


class _Sender:
    """``cycle.send`` taking :data:`ZEROCOPY` messages too; any other message is the
    cycle's own."""

    def __init__(self, cycle: Any, transport: asyncio.Transport, fd: int) -> None:
        self.cycle = cycle
        self.inner = cycle.send
        self.transport = transport
        self.fd = fd

    async def send(self, message: Message) -> None:
        if message["type"] != ZEROCOPY:
            await self.inner(message)
            return
        cycle = self.cycle
        if not cycle.response_started or cycle.response_complete:
            raise RuntimeError(f"{ZEROCOPY} sent outside an answer's body")
        file_fd = message["file"].fileno()
        offset = message.get("offset")
        if offset is None:
            offset = os.lseek(file_fd, 0, os.SEEK_CUR)
        count = message.get("count")
        if count is None:
            count = os.fstat(file_fd).st_size - offset
        more_body = bool(message.get("more_body", False))
        direct = (
            not cycle.chunked_encoding
            and cycle.scope["method"] != "HEAD"
            and self.transport.get_write_buffer_size() == 0
        )
        if not direct:
            await self._through_transport(file_fd, offset, count, more_body)
            return
        if count > cycle.expected_content_length:
            raise RuntimeError("Response content longer than Content-Length")
        if not cycle.disconnected:
            try:
                await _sendfile(self.fd, file_fd, offset, count)
            except ConnectionError:  # the client went away: dropped, as a body message is
                cycle.disconnected = True
                self.transport.close()
                return
        cycle.expected_content_length -= count
        await self.inner({"type": "http.response.body", "body": b"", "more_body": more_body})

    async def _through_transport(self, file_fd: int, offset: int, count: int, more: bool) -> None:
        """The file's bytes as body messages (read in a thread), when ``sendfile`` may not
        write beside the transport."""
        end = offset + count
        while True:
            most = min(CHUNK_BYTES, end - offset)
            chunk = await asyncio.to_thread(os.pread, file_fd, most, offset)
            if count and not chunk:
                raise OSError(f"the file ended {end - offset} bytes short")
            offset += len(chunk)
            last = offset >= end
            body = {"type": "http.response.body", "body": chunk, "more_body": more or not last}
            await self.inner(body)
            if last:
                return


async def _sendfile(sock_fd: int, file_fd: int, offset: int, count: int) -> None:
    """``count`` bytes of ``file_fd`` from ``offset`` to the socket, on the event loop;
    OSError when the file ends short."""
    loop = asyncio.get_running_loop()
    out = os.dup(sock_fd)  # ours until the end, whatever the transport does with its own
    try:
        end = offset + count
        while offset < end:
            try:
                sent = os.sendfile(out, file_fd, offset, end - offset)
            except BlockingIOError:
                await _writable(loop, out)
                continue
            if sent == 0:
                raise OSError(f"the file ended {end - offset} bytes short")
            offset += sent
    finally:
        os.close(out)


async def _writable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(fd, wake)
    try:
        await ready
    finally:
        loop.remove_writer(fd)
