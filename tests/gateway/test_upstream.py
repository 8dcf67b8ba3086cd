"""The gateway's HTTP/1.1 client to model servers, against scripted servers on loopback."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import httptools
import pytest

from gpu_arbiter.gateway.base.upstream import IDLE_MAX_S, Upstream, UpstreamError, _idle_max_s

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
UNTIL_CLOSE = b"HTTP/1.1 200 OK\r\n\r\nall of it"
CLOSING = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"
CUT = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"
# (connection number, request number on it) -> (answer, close after it), or None: close
# the connection without answering
Script = Callable[[int, int], tuple[bytes, bool] | None]


class Scripted:
    """A server that answers as its script says, and counts requests and connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed = asyncio.Event()
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        try:
            for request in range(1000):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                step = self.script(number, request)
                if step is None:
                    break
                writer.write(step[0])
                await writer.drain()
                if step[1]:
                    break
            else:
                await reader.read()  # until the client closes
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Script], Scripted]]:
    listeners: list[asyncio.AbstractServer] = []

    async def start(script: Script) -> Scripted:
        found = Scripted(script)
        listener = await asyncio.start_server(found.serve, "127.0.0.1", 0)
        found.port = listener.sockets[0].getsockname()[1]
        listeners.append(listener)
        return found

    yield start  # type: ignore[misc]
    for listener in listeners:
        listener.close()


async def _body(upstream: Upstream, method: str = "POST", body: bytes = b"{}") -> bytes:
    answer = await upstream.request(method, b"/v1/x?q=1", [(b"x-a", b"1")], body)
    try:
        data = b""
        while chunk := await answer.read():
            data += chunk
        assert answer.ended
        return data
    finally:
        answer.close()


async def test_one_write_per_request_and_the_connection_is_kept(scripted: Callable) -> None:
    server = await scripted(lambda c, r: (OK, False))
    upstream = Upstream(server.port, keep=4)
    assert [await _body(upstream) for _ in range(3)] == [b"ok", b"ok", b"ok"]
    assert server.connections == 1  # kept
    assert server.requests[0] == (
        b"POST /v1/x?q=1 HTTP/1.1\r\nhost: 127.0.0.1:%d\r\nx-a: 1\r\ncontent-length: 2\r\n\r\n{}"
        % server.port
    )
    upstream.close()


async def test_connection_close_and_a_body_up_to_the_close_are_not_kept(
    scripted: Callable,
) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"
    answers = {(0, 0): (CLOSING, True), (1, 0): (UNTIL_CLOSE, True), (2, 1): (head, False)}
    server = await scripted(lambda c, r: answers.get((c, r), (OK, False)))
    upstream = Upstream(server.port, keep=4)
    assert await _body(upstream) == b"ok"
    assert await _body(upstream) == b"all of it"
    assert await _body(upstream) == b"ok"
    assert server.connections == 3  # neither of the first two was used again
    assert await _body(upstream, "HEAD") == b""  # no body, whatever its content-length says
    assert await _body(upstream) == b"ok"
    assert server.connections == 4  # not after a HEAD
    upstream.close()


async def test_an_idempotent_request_unanswered_on_a_kept_connection_is_sent_once_more(
    scripted: Callable,
) -> None:
    server = await scripted(lambda c, r: (OK, False) if r == 0 else None)
    upstream = Upstream(server.port, keep=4)
    assert await _body(upstream, "GET") == b"ok"
    assert await _body(upstream, "GET") == b"ok"  # the kept one failed unanswered: a new one
    assert server.connections == 2
    assert len(server.requests) == 3  # the server read the second GET twice
    upstream.close()


async def test_a_post_unanswered_on_a_kept_connection_is_an_error_and_sent_once(
    scripted: Callable,
) -> None:
    server = await scripted(lambda c, r: (OK, False) if r == 0 else None)
    upstream = Upstream(server.port, keep=4)
    assert await _body(upstream) == b"ok"
    with pytest.raises(UpstreamError, match="a POST is not sent twice"):
        await _body(upstream)  # the server read it: sending it again could run it twice
    assert server.connections == 1
    assert len(server.requests) == 2
    upstream.close()


async def test_a_connection_the_server_closed_after_answering_is_not_written_on(
    scripted: Callable,
) -> None:
    server = await scripted(lambda c, r: (OK, True))  # keep-alive said, yet closed at once
    upstream = Upstream(server.port, keep=4)
    assert await _body(upstream) == b"ok"
    assert await _body(upstream) == b"ok"  # its end seen before writing: a POST, on a new one
    assert server.connections == 2
    assert len(server.requests) == 2
    upstream.close()


async def test_a_post_never_goes_on_a_connection_after_a_chunked_answer(
    scripted: Callable,
) -> None:
    """llama.cpp's server closes the connection right after every streamed (chunked)
    answer without saying so; the close can come after any check before the write.
    Here the server closes as the next request comes: on that connection it is lost."""
    server = await scripted(lambda c, r: (CHUNKED, False) if r == 0 else None)
    upstream = Upstream(server.port, keep=4)
    assert await _body(upstream) == b"abcde"  # decoded
    assert await _body(upstream) == b"abcde"  # on a new connection, the only one it reached
    assert await _body(upstream) == b"abcde"
    assert server.connections == 3
    assert len(server.requests) == 3  # each POST reached the server exactly once
    upstream.close()


async def test_a_post_goes_on_a_new_connection_when_the_kept_one_fails_its_first_write(
    scripted: Callable,
) -> None:
    """A kept connection that looks quiet but cannot send (here: shut for writing) fails
    the write at once, before any byte left: the request goes on a new connection."""
    server = await scripted(lambda c, r: (OK, False))
    upstream = Upstream(server.port, keep=4)
    answer = await upstream.request("POST", b"/", [], b"{}")
    sock = answer._connection.writer.get_extra_info("socket")  # type: ignore[union-attr]
    assert await answer.read() == b"ok"
    answer.close()  # kept
    sock.shutdown(socket.SHUT_WR)
    assert await _body(upstream) == b"ok"
    assert server.connections == 2
    assert len(server.requests) == 2  # the second POST reached the server once
    upstream.close()


@pytest.mark.parametrize("keep_alive", [b"timeout=0", b"timeout=1, max=100"])
async def test_an_idle_connection_is_kept_no_longer_than_its_server_says(
    scripted: Callable, keep_alive: bytes
) -> None:
    """``Keep-Alive: timeout=1``: the server closes it idle after 1 s; it is used again
    for at most half of that (0: not at all). This server never closes it itself."""
    said = b"HTTP/1.1 200 OK\r\nkeep-alive: %s\r\ncontent-length: 2\r\n\r\nok" % keep_alive
    server = await scripted(lambda c, r: (said, False))
    upstream = Upstream(server.port, keep=4)
    assert await _body(upstream) == b"ok"
    await asyncio.sleep(0.6)  # past the half second (a sleep never ends early)
    assert await _body(upstream) == b"ok"
    assert server.connections == 2
    upstream.close()


async def test_idle_connections_are_closed_at_their_time_without_another_request(
    scripted: Callable,
) -> None:
    """A burst leaves several idle connections; each is closed once idle past its time
    (``timeout=1``: half a second), with no request coming to take it."""
    said = b"HTTP/1.1 200 OK\r\nkeep-alive: timeout=1\r\ncontent-length: 2\r\n\r\nok"
    server = await scripted(lambda c, r: (said, False))
    upstream = Upstream(server.port, keep=8)
    assert await asyncio.gather(*(_body(upstream) for _ in range(4))) == [b"ok"] * 4
    assert server.connections == 4
    assert len(upstream._idle) == 4
    async with asyncio.timeout(30):  # a bound, not a speed: each is closed after 0.5 s
        while upstream._idle:
            await asyncio.sleep(0.05)
    await asyncio.wait_for(server.closed.wait(), 30)  # the server saw its end
    assert await _body(upstream) == b"ok"  # a new connection, the pool still works
    assert server.connections == 5
    upstream.close()
    assert upstream._sweep_at is None


@pytest.mark.parametrize(
    ("keep_alive", "idle_max_s"),
    [
        (b"timeout=5, max=100", 4.0),
        (b"max=3, Timeout = 3", 2.0),
        (b"timeout=1", 0.5),
        (b"timeout=60", IDLE_MAX_S),
        (b"timeout=nan", IDLE_MAX_S),
        (b"timeout=x", IDLE_MAX_S),
        (b"max=5", IDLE_MAX_S),
    ],
)
def test_the_idle_time_a_keep_alive_header_allows(keep_alive: bytes, idle_max_s: float) -> None:
    assert _idle_max_s(keep_alive) == idle_max_s


async def test_no_answer_on_a_new_connection_is_an_error_and_not_retried(
    scripted: Callable,
) -> None:
    server = await scripted(lambda c, r: None)
    upstream = Upstream(server.port, keep=4)
    with pytest.raises(UpstreamError, match="without answering"):
        await _body(upstream)
    assert server.connections == 1
    with pytest.raises(UpstreamError, match="ConnectionRefused"):
        await _body(Upstream(1, keep=1))


async def test_a_body_cut_short_raises_and_its_connection_is_not_kept(scripted: Callable) -> None:
    server = await scripted(lambda c, r: (CUT, True))
    upstream = Upstream(server.port, keep=4)
    answer = await upstream.request("POST", b"/", [], b"")
    assert answer.status == 200
    assert await answer.read() == b"abc"
    with pytest.raises((OSError, httptools.HttpParserError)):
        await answer.read()
    answer.close()
    assert server.connections == 1


async def test_a_cancelled_request_closes_its_connection(scripted: Callable) -> None:
    server = await scripted(lambda c, r: (b"HTTP/1.1 200 OK\r\n", False))  # the head never ends
    upstream = Upstream(server.port, keep=4)
    task = asyncio.ensure_future(upstream.request("POST", b"/", [], b""))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(server.closed.wait(), 5)  # the server saw the connection closed


class Reader:
    """A server that reads each request's body by its framing (chunked or sized) and
    answers with its size; it records each request's head and body."""

    def __init__(self) -> None:
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.closed = asyncio.Event()
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body = await (
                    self._chunked(reader) if b"chunked" in head else self._sized(reader, head)
                )
                self.requests.append((head, body))
                size = b"%d" % len(body)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(size), size))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()

    @staticmethod
    async def _sized(reader: asyncio.StreamReader, head: bytes) -> bytes:
        return await reader.readexactly(int(head.split(b"content-length: ")[1].split(b"\r\n")[0]))

    @staticmethod
    async def _chunked(reader: asyncio.StreamReader) -> bytes:
        body = b""
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        await reader.readexactly(2)
        return body


@pytest.fixture
async def reading() -> AsyncIterator[Reader]:
    found = Reader()
    listener = await asyncio.start_server(found.serve, "127.0.0.1", 0)
    found.port = listener.sockets[0].getsockname()[1]
    yield found
    listener.close()


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        await asyncio.sleep(0)
        yield part


async def _read_all(upstream: Upstream, body: Any, length: int | None = None) -> bytes:
    answer = await upstream.request("POST", b"/up", [], body, length)
    try:
        data = b""
        while chunk := await answer.read():
            data += chunk
        return data
    finally:
        answer.close()


async def test_a_body_as_chunks_is_sent_as_they_come_chunked_or_by_its_length(
    reading: Reader,
) -> None:
    upstream = Upstream(reading.port, keep=4)
    assert await _read_all(upstream, _chunks(b"abc", b"", b"de")) == b"5"
    assert await _read_all(upstream, _chunks(b"abc", b"de"), length=5) == b"5"
    large = bytes(range(256)) * 1024  # beyond one write's size: written after the head
    assert await _read_all(upstream, large) == b"%d" % len(large)
    [(chunked, first), (sized, second), (_, third)] = reading.requests
    assert b"transfer-encoding: chunked\r\n" in chunked and first == b"abcde"
    assert b"content-length: 5\r\n" in sized and second == b"abcde"
    assert third == large
    assert reading.connections == 1  # each answer complete: the connection kept
    upstream.close()


async def test_an_error_of_the_body_closes_the_connection_and_passes_through(
    reading: Reader,
) -> None:
    class Gone(Exception):
        pass

    async def failing() -> AsyncIterator[bytes]:
        yield b"abc"
        raise Gone

    upstream = Upstream(reading.port, keep=4)
    with pytest.raises(Gone):
        await upstream.request("PUT", b"/up", [], failing())
    await asyncio.wait_for(reading.closed.wait(), 5)  # closed: never half a body reused
    assert not reading.requests
    upstream.close()
