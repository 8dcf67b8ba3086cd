"""What one HTTP connection may cost: bounded request heads, timed-out slow clients, and
as many open files as the system lets the process have.

uvicorn's httptools protocol buffers a request head for as long as it takes and as large
as it comes. :func:`bounded_http` subclasses it minimally:

- the head (request line and headers) is counted in bytes as it arrives, before the
  parser sees it: beyond ``max_header_bytes`` the answer is 431 and the connection is
  closed, so a head never costs more than that plus one read;
- beyond ``max_headers`` headers, 431 too;
- a request with more than one ``Host`` header is answered 400 and the connection
  closed (RFC 9112, 3.2: which one names the server is ambiguous; a guard reading the
  last and a proxy reading the first would judge different hosts);
- a connection has ``header_timeout_s`` from its opening, and from the first byte of each
  further request, to complete the head; a client that sends nothing or sends it slowly
  (slowloris) gets 408 and is closed then. Idle keep-alive between requests is uvicorn's
  ``timeout_keep_alive``.
- on a plain TCP connection a request's app may send a file with ASGI's zero-copy send
  (``sendfile``: ``zerocopy.py``).

Beyond the cap on connections (uvicorn's ``limit_concurrency``), a request is answered
503 (uvicorn) and a new connection is answered 503 and closed at once, by the listening
socket as it accepts (:class:`Listener`) and by the protocol when it sees the connection,
so that connections never take the descriptors the store needs, even in a burst that
comes while the loop is busy; the cap is kept below the limit of open files, raised to
its hard limit at start (:func:`raise_open_files_limit`).

A refused connection lingers before it is closed (as Apache's and nginx's lingering
close): its answer sent, its write side is shut (the client reads the answer and an
end) and what the client still sends is read and dropped, until the client closes,
``LINGER_BYTES`` or ``LINGER_S``. Closed with bytes of its request unread, the socket
would be reset (RST) instead, and a client still sending its body would fail to send
and never read the answer. At most ``LINGERING_FILES`` connections of the process linger
at once (set aside from the connections' descriptors); beyond them one is closed at
once, once the bytes already there are read.

Two listeners in one process (``serve --local --models``: the controller and the
gateway) share its descriptors. The second one sets its share aside before the first
sizes its cap (:func:`set_aside_files`), so that together they stay below the limit and
connections to one can never make the other unreachable. The limit is the process's,
so the record of what was set aside is the process's too (a module variable).
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from . import zerocopy

__all__ = [
    "HeadLimits",
    "Listener",
    "bound",
    "bounded_http",
    "raise_open_files_limit",
    "set_aside_files",
]

RESERVED_FILES = 64
"""Descriptors kept for the store, logs and the agent beside the connections."""

REFUSED_PER_TURN = 64
"""Connections beyond the cap one :meth:`Listener.accept` refuses before it lets the loop
go on (a flood cannot hold the loop for longer)."""

LINGER_S = 2.0
"""How long a refused connection may linger for the rest of its request."""

LINGER_BYTES = 256 * 1024
"""What a lingering connection may still send before it is closed all the same."""

LINGERING_FILES = 32
"""Refused connections that may linger at once in this process."""


@dataclass(frozen=True, slots=True)
class HeadLimits:
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0


class _Refused(Exception):
    """Raised from a parser callback: the head broke a limit (the parser stops there)."""


class _BoundedHttp(HttpToolsProtocol):
    limits = HeadLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._header_count = 0
        self._host_headers = 0
        self._reading_head = True
        self._refusal: tuple[int, str] | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_bytes: int | None = None  # while it lingers: what it may still send
        self._linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            self._refuse(503, "too many connections")  # so connections never use up the files
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            _lingering.give_back()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:  # what a refused client still sends is dropped
            if self._linger_bytes is not None:
                self._linger_bytes -= len(data)
                if self._linger_bytes <= 0:
                    self.transport.close()
            return
        if self._reading_head:
            room = self.limits.max_header_bytes - self._head_bytes
            if len(data) > room:  # the parser sees the head's allowance: does it end there?
                self._head_bytes += room
                super().data_received(data[:room])  # (a body may follow in the same read)
                if self._refusal is None and self._reading_head:
                    self._refuse(431, "request head larger than the limit")
                if self._refusal is not None:
                    return
                data = data[room:]
            else:
                self._head_bytes += len(data)
        super().data_received(data)  # a callback's _Refused comes back as send_400_response

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_head = True
        self._header_count = self._host_headers = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refusal = (431, "more request headers than the limit")
            raise _Refused
        if name.lower() == b"host":
            self._host_headers += 1
            if self._host_headers > 1:
                self._refusal = (400, "more than one Host header")
                raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._head_bytes = 0
        self._cancel_head_timer()
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before and self.cycle is not None and self.transport is not None:
            zerocopy.offer(self.cycle, self.transport)  # before its app runs (a task)

    def send_400_response(self, msg: str) -> None:
        self._refuse(*(self._refusal or (400, msg)))  # a parser error, or a limit's refusal

    def _refuse(self, status: int, text: str) -> None:
        """Answers ``status`` with ``text`` and closes the connection, lingering (the
        client's end of file closes it: uvicorn's ``eof_received`` keeps nothing open).
        Without room to linger, what the client sent is read from the socket first."""
        self._refusal = (status, text)
        self._cancel_head_timer()
        if self.transport.is_closing():
            return
        self.transport.write(_plain(status, text))
        sock = self.transport.get_extra_info("socket")
        more = LINGER_BYTES if sock is None else _drop_what_came(sock.fileno(), LINGER_BYTES)
        if not more or not self.transport.can_write_eof() or not _lingering.take():
            self.transport.close()
            return
        self.transport.write_eof()
        self._linger_bytes = LINGER_BYTES
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._reading_head:
            self._refuse(408, "request head not received in time")


def bounded_http(limits: HeadLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with ``limits`` (pass it as ``uvicorn.Config(http=)``)."""
    return type("BoundedHttp", (_BoundedHttp,), {"limits": limits})


class Listener(socket.socket):
    """A listening TCP socket that keeps at most ``cap`` of the connections it accepted
    open: beyond it, :meth:`accept` answers a connection 503 and closes it at once.

    asyncio accepts up to its backlog (uvicorn's 2,048) connections each time the socket
    is readable, and a protocol sees its connection only turns of the loop later. A cap
    checked there (``connection_made``) lets a burst that arrived while the loop was busy
    take every descriptor of the process first: then no listener of the process can
    accept (EMFILE) and the store cannot open a file. Here the cap holds at ``accept``,
    before a descriptor is kept. uvloop accepts in libuv, not through this method: there
    the check in ``connection_made`` is what holds.
    """

    cap = 1 << 30
    """Set by the server once it knows its cap on connections."""

    linger_s = LINGER_S

    def __init__(self, family: int) -> None:
        super().__init__(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio: NODELAY
        self.open = 0  # accepted here, not yet closed
        self.lingering: set[_Lingering] = set()  # refused here, not yet closed

    def accept(self) -> tuple[socket.socket, Any]:
        for _ in range(REFUSED_PER_TURN):
            fd, address = self._accept()  # type: ignore[attr-defined]  # BlockingIOError: none
            if self.open < self.cap:
                self.open += 1
                return _Accepted(self, fd), address
            self._refuse(socket.socket(fileno=fd))
        raise BlockingIOError  # more are waiting: the next turn of the loop takes them

    def close(self) -> None:
        for refused in list(self.lingering):
            refused.close()
        super().close()

    def _refuse(self, sock: socket.socket) -> None:
        """Answers 503 and shuts ``sock`` for writing; it lingers, on the running loop,
        unless its client is done already or no loop or room is there for it."""
        sock.setblocking(False)
        try:
            sock.send(_plain(503, "too many connections"))
            sock.shutdown(socket.SHUT_WR)
            more = _drop_what_came(sock.fileno(), LINGER_BYTES)
        except OSError:  # the client may be gone already
            more = 0
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            more = 0
        if more and _lingering.take():
            _Lingering(sock, loop, more, self)
        else:
            sock.close()


class _Accepted(socket.socket):
    """A connection :class:`Listener` counts until it is closed."""

    def __init__(self, listener: Listener, fd: int) -> None:
        super().__init__(listener.family, listener.type, listener.proto, fileno=fd)
        self._listener: Listener | None = listener

    def close(self) -> None:
        self._uncount()
        super().close()

    def detach(self) -> int:
        self._uncount()
        return super().detach()

    def __del__(self) -> None:  # a socket dropped without close() is closed here
        self._uncount()
        super().__del__()  # type: ignore[misc]

    def _uncount(self) -> None:
        if self._listener is not None:
            self._listener.open -= 1
            self._listener = None


class _Room:
    """How many refused connections linger in this process (at most
    ``LINGERING_FILES``)."""

    def __init__(self) -> None:
        self.count = 0

    def take(self) -> bool:
        if self.count >= LINGERING_FILES:
            return False
        self.count += 1
        return True

    def give_back(self) -> None:
        self.count -= 1


_lingering = _Room()


class _Lingering:
    """A connection :class:`Listener` refused, answered and shut for writing: what its
    client still sends is read and dropped until it closes, ``more`` bytes or the
    listener's ``linger_s``; then closed (and removed from the loop)."""

    def __init__(
        self, sock: socket.socket, loop: asyncio.AbstractEventLoop, more: int, listener: Listener
    ) -> None:
        self._sock, self._loop, self._more, self._listener = sock, loop, more, listener
        listener.lingering.add(self)
        loop.add_reader(sock.fileno(), self._read)
        self._timer = loop.call_later(listener.linger_s, self.close)

    def _read(self) -> None:
        self._more = _drop_what_came(self._sock.fileno(), self._more)
        if not self._more:
            self.close()

    def close(self) -> None:
        if self not in self._listener.lingering:
            return
        self._listener.lingering.discard(self)
        _lingering.give_back()
        self._timer.cancel()
        if not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()


def _drop_what_came(fd: int, more: int) -> int:
    """Reads and drops what the non-blocking socket ``fd`` has received, up to ``more``
    bytes; what it may still receive after, 0 once its client closed or failed."""
    while more > 0:
        try:
            chunk = os.read(fd, min(more, 64 * 1024))
        except BlockingIOError:
            return more
        except OSError:
            return 0
        if not chunk:
            return 0
        more -= len(chunk)
    return 0


def bound(host: str, port: int) -> Listener:
    """A :class:`Listener` bound to ``host:port`` (``OSError`` if it cannot be)."""
    sock = Listener(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _plain(status: int, text: str) -> bytes:
    """An answer ``status`` with ``text`` that closes the connection."""
    body = text.encode("ascii")
    return (
        STATUS_LINE[status]
        + b"content-type: text/plain; charset=utf-8\r\n"
        + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        + body
    )


_set_aside: list[int] = [0]
"""Descriptors set aside in this process for a second listener (:func:`set_aside_files`)."""


def raise_open_files_limit() -> int:
    """Raises the soft limit of open files to the hard limit; returns how many of them
    connections may use (the rest is kept for the store, the logs and the agent, for
    refused connections that linger, and for what another listener of this process set
    aside)."""
    return max(1, _open_files_limit() - RESERVED_FILES - LINGERING_FILES - _set_aside[0])


def set_aside_files(wanted: int) -> int:
    """Sets aside up to ``wanted`` descriptors for a listener started later in this
    process, at most half of those :func:`raise_open_files_limit` offers (the listener
    already there keeps the other half); returns how many were set aside."""
    share = max(1, min(wanted, raise_open_files_limit() // 2))
    _set_aside[0] += share
    return share


def _open_files_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # the soft limit stays as it is
    return soft
