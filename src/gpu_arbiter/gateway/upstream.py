"""The gateway's leg to a model server: keep-alive HTTP/1.1 connections on asyncio
streams, one pool per replica (at most ``keep`` idle connections are kept: the
replica's ``max_parallel``).

A request's line, headers and body leave in one write. The answer's head is parsed
(httptools, llhttp's parser) and its body handed on as it arrives: by
``Content-Length``, chunked (the chunks decoded: the gateway's own server chunks the
body again) or up to the close. A connection goes back to the pool only after a whole
answer that lets it stay open; one cut short, abandoned (the caller went away) or
answered with ``Connection: close`` is closed.

A kept connection is used again only while it is quiet: one the server closed while
it was idle (its end read by the loop, or still waiting in the socket: a zero-wait
poll) is dropped before anything is written on it. Should a request still fail on a
reused connection before any byte of the answer came, it is sent once more, on a new
one, only if its method is idempotent (RFC 9110: GET, HEAD, OPTIONS, TRACE, PUT,
DELETE): the server may have received it. Any other (a POST) is never sent twice: the
caller gets the :class:`UpstreamError` (the gateway answers 502).
"""

from __future__ import annotations

import asyncio
import contextlib
import select

import httptools

__all__ = ["Answer", "Upstream", "UpstreamError"]

Headers = list[tuple[bytes, bytes]]
READ_BYTES = 256 * 1024
_FRAMING = (b"content-length", b"transfer-encoding")
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
"""Methods whose request may be sent again (RFC 9110, 9.2.2): all others at most once."""


class UpstreamError(Exception):
    """The server did not answer: refused, reset, or closed before the answer's head."""


class _Unanswered(UpstreamError):
    """Failed before any byte of the answer came."""


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
        self.keep_alive = False
        self.head_only = False

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
        framed = any(n.lower() in _FRAMING for n, _ in self.headers)
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

    def usable(self) -> bool:
        """Not closed, and nothing waiting to be read: an idle connection's server sends
        nothing unless it closes it (its end may not have reached the loop yet)."""
        if self.reader.at_eof() or self.writer.is_closing():
            return False
        return not self._quiet.poll(0)

    async def send(self, data: bytes, head_only: bool) -> None:
        """Sends a request and reads up to the end of the answer's head."""
        self.head_only = head_only
        try:
            self.writer.write(data)
            while not self.head_done:
                if not await self.feed() and not self.head_done:
                    raise _Unanswered("the server closed the connection without answering")
        except (OSError, httptools.HttpParserError) as error:
            got = self.status or self.headers or not isinstance(error, OSError)
            kind = UpstreamError if got else _Unanswered
            raise kind(f"{error.__class__.__name__}: {error}") from error

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
        return (
            self.done
            and not self.until_close
            and not self.head_only
            and self.keep_alive
            and self.usable()
        )

    def reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.headers, self.body = 0, [], []
        self.head_done = self.done = self.until_close = self.keep_alive = False
        self.head_only = False
        self.reused = True

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
    """The connections to one server (``127.0.0.1:port``)."""

    def __init__(self, port: int, keep: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port
        self.keep = keep
        self._idle: list[_Connection] = []
        self._closed = False
        self._host_header = f"host: {host}:{port}\r\n".encode()

    async def request(self, method: str, target: bytes, headers: Headers, body: bytes) -> Answer:
        """Sends a request; the answer once its head came. Raises :class:`UpstreamError`
        when the server did not answer. Cancelled, the connection is closed."""
        head = [method.encode(), b" ", target, b" HTTP/1.1\r\n", self._host_header]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        data = b"".join(head) + body
        head_only = method == "HEAD"
        while self._idle:
            connection = self._idle.pop()
            if not connection.usable():
                connection.close()
                continue
            if method not in IDEMPOTENT:  # at most once: a failure is the caller's
                try:
                    return await self._exchange(connection, data, head_only)
                except _Unanswered as error:
                    raise UpstreamError(f"{error} (a {method} is not sent twice)") from None
            with contextlib.suppress(_Unanswered):  # closed while idle: the next one
                return await self._exchange(connection, data, head_only)
        return await self._exchange(await self._connect(), data, head_only)

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port, limit=READ_BYTES)
        except OSError as error:
            raise UpstreamError(f"{error.__class__.__name__}: {error}") from error
        return _Connection(reader, writer)

    async def _exchange(self, connection: _Connection, data: bytes, head_only: bool) -> Answer:
        try:
            await connection.send(data, head_only)
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
        connection.reset()
        self._idle.append(connection)

    def close(self) -> None:
        """Closes the idle connections, and each in use when its answer is done."""
        self._closed = True
        for connection in self._idle:
            connection.close()
        self._idle.clear()
