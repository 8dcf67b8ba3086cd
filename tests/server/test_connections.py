"""The listening socket's cap on connections (``web/connections.py``), on a real asyncio
loop with real loopback connections: a burst that arrives while the loop is busy is
refused at accept, so it never holds more descriptors than the cap."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from gpu_arbiter.web.connections import LINGERING_FILES, Listener, bound

pytestmark = pytest.mark.timeout(60)

CAP = 3
BURST = 40


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


class _Greeter(asyncio.Protocol):
    """Says hello to each connection it sees, and notes how many files the process had
    open then."""

    def __init__(self, served: _Served) -> None:
        self.served = served

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.served.files.append(_open_files())
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(b"hello")
        self.served.transports.append(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.served.lost.release()


class _Served:
    def __init__(self) -> None:
        self.before = 0
        self.files: list[int] = []
        self.transports: list[asyncio.BaseTransport] = []
        self.lost = threading.Semaphore(0)


@contextlib.contextmanager
def _serving(listener: Listener) -> Iterator[_Served]:
    """``listener`` served by an asyncio loop on a thread of its own."""
    served = _Served()
    loop = asyncio.new_event_loop()
    started = threading.Event()

    stop = asyncio.Event()

    async def serve() -> None:
        served.before = _open_files()  # the loop's own included
        server = await loop.create_server(lambda: _Greeter(served), sock=listener)
        started.set()
        async with server:
            await stop.wait()
            for transport in served.transports:
                transport.close()
            await asyncio.sleep(0)  # their connection_lost

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield served
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


def _first_bytes(sock: socket.socket) -> bytes:
    """The greeting, or the whole refusal (up to the server's close)."""
    sock.settimeout(10)
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while (received != b"hello") and (chunk := sock.recv(4096)):
            received += chunk
    return received


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def test_a_burst_beyond_the_cap_is_refused_at_accept_and_holds_no_more_files() -> None:
    listener = bound("127.0.0.1", 0)
    listener.cap = CAP
    listener.listen(2048)
    port = listener.getsockname()[1]
    clients = [_connect(port) for _ in range(BURST)]  # all wait in the queue: no loop yet
    try:
        with _serving(listener) as served:
            answers = [_first_bytes(client) for client in clients]
            assert answers.count(b"hello") == CAP
            refused = [answer for answer in answers if answer != b"hello"]
            assert len(refused) == BURST - CAP
            assert all(answer.startswith(b"HTTP/1.1 503 ") for answer in refused)
            # a connection was held open only within the cap, even the first one seen
            # (and those refused that linger for the rest of their request)
            assert max(served.files) <= served.before + CAP + LINGERING_FILES
            assert listener.open == CAP
    finally:
        for client in clients:
            client.close()


def _until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _reset(client: socket.socket) -> bool:
    try:
        client.send(b"x")
    except (ConnectionResetError, BrokenPipeError):
        return True
    return False


def test_a_refused_client_still_sending_its_request_reads_the_503_and_a_close() -> None:
    """A client that sent its request's head and sends its body after (as HTTP clients
    do) is refused with the head unread: it can send the body, and it reads the 503
    and then an end, not a reset (a socket closed with bytes unread is reset)."""
    listener = bound("127.0.0.1", 0)
    listener.cap = 0
    listener.linger_s = 60.0  # not what ends it here: the client's close does
    listener.listen(2048)
    port = listener.getsockname()[1]
    head = b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4096\r\n\r\n"
    clients = [_connect(port) for _ in range(BURST)]
    for client in clients:
        client.sendall(head)  # waits unread: no loop yet
    try:
        with _serving(listener):
            for client in clients:
                answer = b""
                while chunk := client.recv(4096):  # up to the server's end of file
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 503 ")
                client.sendall(b"x" * 4096)  # the body: the server still reads
            for client in clients:
                assert client.recv(4096) == b""  # no reset
                client.close()
            _until(lambda: not listener.lingering, "the refused connections to be closed")
    finally:
        for client in clients:
            client.close()


def test_a_refused_client_that_keeps_its_connection_is_closed_after_the_linger_time() -> None:
    listener = bound("127.0.0.1", 0)
    listener.cap = 0
    listener.linger_s = 0.2
    port = listener.getsockname()[1]
    with _serving(listener), _connect(port) as client:
        assert _first_bytes(client).startswith(b"HTTP/1.1 503 ")
        _until(lambda: not listener.lingering, "the linger time to pass")
        _until(lambda: _reset(client), "a reset: bytes sent to a closed socket")


def test_a_closed_connection_makes_room_for_the_next() -> None:
    listener = bound("127.0.0.1", 0)
    listener.cap = 1
    port = listener.getsockname()[1]
    with _serving(listener) as served:
        first = _connect(port)
        assert _first_bytes(first) == b"hello"
        with _connect(port) as second:
            assert _first_bytes(second).startswith(b"HTTP/1.1 503 ")
        first.close()
        assert served.lost.acquire(timeout=10)  # the server saw it end and closed its side
        with _connect(port) as third:
            assert _first_bytes(third) == b"hello"
            assert listener.open == 1  # (while it is open: its close may be seen at once)


def test_a_socket_dropped_without_closing_it_is_no_longer_counted() -> None:
    with bound("127.0.0.1", 0) as listener:
        listener.listen(8)
        with _connect(listener.getsockname()[1]):
            accepted, _ = listener.accept()
            assert listener.open == 1
            with pytest.warns(ResourceWarning, match="unclosed"):
                del accepted  # closed by its finalizer, as a socket is
            assert listener.open == 0


def test_a_port_in_use_is_an_error_and_leaves_no_socket_open() -> None:
    with bound("127.0.0.1", 0) as taken:
        taken.listen(1)
        files = _open_files()
        with pytest.raises(OSError, match="in use"):
            bound("127.0.0.1", taken.getsockname()[1])
        assert _open_files() == files
