"""The gateway's leg to a model server: keep-alive HTTP/1.1 connections on asyncio
streams, one pool per replica (at most ``keep`` idle connections are kept: the
replica's ``max_parallel``).

A request's line, headers and a small body leave in one write; a large body follows
the head as it is (never copied into one buffer with it), a piece at a time as the
transport has room (``WRITE_PIECE_BYTES``), and a body given as chunks
(the gateway streams a client's upload as it comes) is sent as they come, with the
client's ``Content-Length`` or chunked, and at most once. The answer's head is parsed
(httptools, llhttp's parser) and its body handed on as it arrives: by
``Content-Length``, chunked (the chunks decoded: the gateway's own server chunks the
body again) or up to the close. A connection goes back to the pool only after a whole
answer; one cut short or abandoned (the caller went away) is closed.

A connection is kept only where nothing says the server will close it: not after
``Connection: close``, an HTTP/1.0 answer without keep-alive, a body that ended with the
connection, a HEAD, or a chunked answer. A server may close right after a chunked
answer without saying so (llama.cpp's server does after every stream: its close comes
microseconds after the last chunk, and a request written in between is lost with the
connection), and no check before writing can tell a close still on its way; a streamed
answer costs one loopback connect instead. An idle connection is kept at most
``IDLE_MAX_S`` (4 s: servers commonly close idle ones after 5, uvicorn and llama.cpp's
among them), or a second less than the server's ``Keep-Alive: timeout=N`` (half of it
under 2 s): a request written as the server closes it would be lost.

A kept connection is used again only while it is quiet: one the server closed while
it was idle (its end read by the loop, or still waiting in the socket: a zero-wait
poll) is dropped before anything is written on it, and so is one whose first write
failed at once (nothing of the request left). Should a request still fail on a
reused connection before any byte of the answer came, it is sent once more, on a new
one, only if its method is idempotent (RFC 9110: GET, HEAD, OPTIONS, TRACE, PUT,
DELETE): the server may have received it. Any other (a POST) is never sent twice: the
caller gets the :class:`UpstreamError` (the gateway answers 502).
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import ssl
from collections.abc import AsyncIterable
from dataclasses import dataclass

import httptools

from .race import first

__all__ = ["Answer", "Body", "NotConnected", "Upstream", "UpstreamError"]

Headers = list[tuple[bytes, bytes]]
Body = bytes | bytearray | AsyncIterable[bytes | bytearray]
"""A request's body: its bytes, or its chunks as they come."""
READ_BYTES = 256 * 1024
ONE_WRITE_BYTES = 64 * 1024
"""A body up to this size leaves in the head's write; a larger one is written apart."""
WRITE_PIECE_BYTES = 256 * 1024
"""A larger body (or a held part of one) is written in pieces of this size, the next once
the transport has room: asyncio's transport copies what the socket does not take at
once, so a held body written whole cost about twice its size (uvloop's does not)."""
_FRAMING = (b"content-length", b"transfer-encoding")
IDLE_MAX_S = 4.0
"""An idle connection is closed after this long, or sooner where its server says so."""
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
"""Methods whose request may be sent again (RFC 9110, 9.2.2): all others at most once."""


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """A request as it is written: its head, then its body (bytes, or chunks sent with
    chunked framing when ``chunked``)."""

    head: bytes
    body: Body
    chunked: bool
    head_only: bool

    @property
    def streamed(self) -> bool:
        return not isinstance(self.body, bytes | bytearray)


class UpstreamError(Exception):
    """The server did not answer: refused, reset, or closed before the answer's head."""


class NotConnected(UpstreamError):
    """No connection could be made: nothing of the request left (it may go elsewhere)."""


class _Unanswered(UpstreamError):
    """Failed before any byte of the answer came."""


class _NotSent(_Unanswered):
    """Failed before any byte of the request left: it may go on another connection."""


class _Connection:
    """One connection, and the parser's state of the answer being read on it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._quiet = select.poll()  # readable while idle = closed (or junk): not reusable
        self._quiet.register(writer.get_extra_info("socket").fileno(), select.POLLIN)
        self.reused = False
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: Headers = []
        self.body: list[bytes] = []
        self.head_done = False
        self.done = False
        self.until_close = False  # a body without length: it ends with the connection
        self.chunked = False
        self.keep_alive = False
        self.head_only = False
        self.idle_max_s = IDLE_MAX_S
        self.idle_until = 0.0  # (the loop's clock) kept, it is closed then

    # ------------------------------------------------------------------ parser callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # informational (103 Early Hints): the final head follows
            self.headers = []
            return
        self.status = status
        self.head_done = True
        framed = False
        for name, value in self.headers:
            lowered = name.lower()
            if lowered in _FRAMING:
                framed = True
                self.chunked = self.chunked or b"chunked" in value.lower()
            elif lowered == b"keep-alive":
                self.idle_max_s = _idle_max_s(value)
        self.until_close = not framed and status not in (204, 304)
        self.keep_alive = self.parser.should_keep_alive()  # known here, not at the end
        if self.head_only:
            self.done = True

    def on_body(self, body: bytes) -> None:
        if not self.head_only:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.done = True

    # ------------------------------------------------------------------ exchange

    def usable(self, now: float) -> bool:
        """Kept, it may be written on: not idle past its time, and quiet."""
        return now < self.idle_until and self._quiet_now()

    def _quiet_now(self) -> bool:
        """Not closed, and nothing waiting to be read: an idle connection's server sends
        nothing unless it closes it (its end may not have reached the loop yet)."""
        if self.reader.at_eof() or self.writer.is_closing():
            return False
        return not self._quiet.poll(0)

    async def send(self, request: _Outgoing) -> None:
        """Sends a request and reads up to the end of the answer's head."""
        self.head_only = request.head_only
        try:
            self.writer.write(request.head)  # tries the socket at once, buffers the rest
            if self.writer.is_closing():  # that first send failed: nothing of it left
                raise _NotSent("the connection failed before the request was sent")
            await self._send_body(request)
            while not self.head_done:
                if not await self.feed() and not self.head_done:
                    raise _Unanswered("the server closed the connection without answering")
        except (OSError, httptools.HttpParserError) as error:
            got = self.status or self.headers or not isinstance(error, OSError)
            kind = UpstreamError if got else _Unanswered
            raise kind(f"{error.__class__.__name__}: {error}") from error

    async def _send_body(self, request: _Outgoing) -> None:
        body = request.body
        if isinstance(body, bytes | bytearray):
            await self._send_held(body)
            return
        async for chunk in body:  # the caller's errors (its client went away) pass through
            if not chunk:
                continue  # (an empty chunk would end a chunked body)
            if request.chunked and len(chunk) <= WRITE_PIECE_BYTES:
                self.writer.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
            elif request.chunked:
                self.writer.write(b"%x\r\n" % len(chunk))
                await self._send_held(chunk)
                self.writer.write(b"\r\n")
            else:
                await self._send_held(chunk)
            await self.writer.drain()
        if request.chunked:
            self.writer.write(b"0\r\n\r\n")

    async def _send_held(self, data: bytes | bytearray) -> None:
        """Writes ``data`` a piece at a time (``WRITE_PIECE_BYTES``), the next once the
        transport has room, unless the server's answer starts first: then the rest at
        once, as a body was written before (the answer is read meanwhile)."""
        view = memoryview(data)
        for start in range(0, len(view), WRITE_PIECE_BYTES):
            self.writer.write(view[start : start + WRITE_PIECE_BYTES])
            more = start + WRITE_PIECE_BYTES < len(view)
            full = self.writer.transport.get_write_buffer_size() >= WRITE_PIECE_BYTES
            if more and full and await self._answer_came_first():
                self.writer.write(view[start + WRITE_PIECE_BYTES :])
                return

    async def _answer_came_first(self) -> bool:
        """Waits until the transport has room, or what the server sends comes (parsed
        here: its answer's start, or its end): True then."""
        return await first(self.feed(), self.writer.drain()) == 0  # the winner's error raised

    async def feed(self) -> bool:
        """Reads what came and parses it; False at the end of the connection (an
        answer without length ends there; any other is cut short: ``ConnectionError``)."""
        data = await self.reader.read(READ_BYTES)
        if data:
            self.parser.feed_data(data)
            return True
        if self.head_done and self.until_close:
            self.done = True
        elif self.head_done and not self.done:
            raise ConnectionResetError("the server closed the connection mid-answer")
        return False

    def reusable(self) -> bool:
        """A whole answer, and nothing said or known that the server closes it."""
        if not self.done or self.until_close or self.chunked or self.head_only:
            return False
        return self.keep_alive and self._quiet_now()

    def reset(self, now: float) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.headers, self.body = 0, [], []
        self.head_done = self.done = self.until_close = self.keep_alive = False
        self.chunked = self.head_only = False
        self.reused = True
        self.idle_until = now + self.idle_max_s
        self.idle_max_s = IDLE_MAX_S

    def close(self) -> None:
        self.writer.close()


class Answer:
    """A server's answer: ``status``, ``headers``, then the body by :meth:`read`;
    :meth:`close` hands the connection back (or closes it), whatever happened."""

    def __init__(self, upstream: Upstream, connection: _Connection) -> None:
        self._upstream = upstream
        self._connection: _Connection | None = connection
        self.status = connection.status
        self.headers = connection.headers

    async def read(self) -> bytes:
        """The body's next bytes as they came; ``b""`` at its end. Raises ``OSError``
        (or ``httptools.HttpParserError``) when the server cut it short."""
        connection = self._connection
        assert connection is not None
        while True:
            body = connection.body
            if body:
                data = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                return data
            if connection.done or not await connection.feed():
                return b""

    @property
    def ended(self) -> bool:
        """All of the body has been read."""
        connection = self._connection
        return connection is None or (connection.done and not connection.body)

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._upstream.put_back(connection)


class Upstream:
    """The connections to one server (``127.0.0.1:port``); with ``tls``, over TLS (a
    peer gateway's HTTPS listener: the context verifies it against the cluster's CA and
    may present this gateway's own certificate), its certificate checked for ``host``."""

    def __init__(
        self, port: int, keep: int, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.keep = keep
        self.tls = tls
        self._idle: list[_Connection] = []
        self._sweep_at: asyncio.TimerHandle | None = None  # the next idle one's end
        self._closed = False
        self._host_header = f"host: {host}:{port}\r\n".encode()

    async def request(
        self, method: str, target: bytes, headers: Headers, body: Body, length: int | None = None
    ) -> Answer:
        """Sends a request; the answer once its head came. Raises :class:`UpstreamError`
        when the server did not answer. Cancelled, the connection is closed. ``body``
        as chunks: ``length`` is their total when known (else they are sent chunked);
        an exception they raise closes the connection and passes through."""
        head = [method.encode(), b" ", target, b" HTTP/1.1\r\n", self._host_header]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        data = _outgoing(method, head, body, length)
        while self._idle:
            connection = self._idle.pop()
            if not connection.usable(asyncio.get_running_loop().time()):
                connection.close()
                continue
            if method not in IDEMPOTENT or data.streamed:  # at most once: the caller's
                try:
                    return await self._exchange(connection, data)
                except _NotSent:
                    continue
                except _Unanswered as error:
                    raise UpstreamError(f"{error} (a {method} is not sent twice)") from None
            with contextlib.suppress(_Unanswered):  # closed while idle: the next one
                return await self._exchange(connection, data)
        return await self._exchange(await self._connect(), data)

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.open_connection(
                self.host, self.port, limit=READ_BYTES, ssl=self.tls
            )
        except ssl.SSLCertVerificationError as error:
            why = error.verify_message or str(error)
            raise NotConnected(f"its TLS certificate was refused: {why}") from error
        except OSError as error:
            raise NotConnected(f"{error.__class__.__name__}: {error}") from error
        return _Connection(reader, writer)

    async def _exchange(self, connection: _Connection, data: _Outgoing) -> Answer:
        try:
            await connection.send(data)
        except _Unanswered:
            connection.close()
            if connection.reused:
                raise
            raise UpstreamError("the server closed the connection without answering") from None
        except BaseException:
            connection.close()
            raise
        return Answer(self, connection)

    def put_back(self, connection: _Connection) -> None:
        if self._closed or len(self._idle) >= self.keep or not connection.reusable():
            connection.close()
            return
        loop = asyncio.get_running_loop()
        connection.reset(loop.time())
        self._idle.append(connection)
        if self._sweep_at is None:
            self._sweep_at = loop.call_at(connection.idle_until, self._sweep)

    def _sweep(self) -> None:
        """Closes the idle connections past their time, at the time (after a burst, dozens
        of them would otherwise stay open until the next requests take them); again at
        the end of the next one's."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for connection in [c for c in self._idle if c.idle_until <= now]:
            self._idle.remove(connection)
            connection.close()
        ends = [connection.idle_until for connection in self._idle]
        self._sweep_at = loop.call_at(min(ends), self._sweep) if ends else None

    def close(self) -> None:
        """Closes the idle connections, and each in use when its answer is done."""
        self._closed = True
        if self._sweep_at is not None:
            self._sweep_at.cancel()
            self._sweep_at = None
        for connection in self._idle:
            connection.close()
        self._idle.clear()


def _idle_max_s(keep_alive: bytes) -> float:
    """How long to keep a connection idle by the server's ``Keep-Alive`` header
    (``timeout=5, max=100``): a second less than its timeout, half of one under 2 s."""
    for part in keep_alive.split(b","):
        name, _, value = part.partition(b"=")
        if name.strip().lower() == b"timeout":
            try:
                timeout_s = float(value.strip())
            except ValueError:
                break
            if timeout_s == timeout_s:  # not NaN
                return max(0.0, min(IDLE_MAX_S, timeout_s - 1 if timeout_s >= 2 else timeout_s / 2))
    return IDLE_MAX_S


def _outgoing(method: str, head: list[bytes], body: Body, length: int | None) -> _Outgoing:
    """The request's bytes: its framing by the body's kind and size (see above)."""
    head_only = method == "HEAD"
    if not isinstance(body, bytes | bytearray):
        if length is None:
            head.append(b"transfer-encoding: chunked\r\n\r\n")
        else:
            head.append(b"content-length: %d\r\n\r\n" % length)
        return _Outgoing(b"".join(head), body, length is None, head_only)
    head.append(b"content-length: %d\r\n\r\n" % len(body))
    if len(body) <= ONE_WRITE_BYTES:
        return _Outgoing(b"".join(head) + body, b"", False, head_only)
    return _Outgoing(b"".join(head), body, False, head_only)
