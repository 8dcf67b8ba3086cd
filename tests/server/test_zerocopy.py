"""ASGI's zero-copy send (``web/zerocopy.py``) through a real uvicorn server with the
project's HTTP protocol (``bounded_http``), on asyncio's loop and on uvloop's, over real
loopback connections: the file's bytes arrive whole and in order, also to a client
whose receive buffer is small (the server waits for the socket to take more), on a kept
alive connection, over TLS (where it is not offered), cut short, or left half-way."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from gpu_arbiter.certs import create_ca, create_cert
from gpu_arbiter.web import zerocopy
from gpu_arbiter.web.connections import HeadLimits, bounded_http
from gpu_arbiter.web.zerocopy import ZEROCOPY

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.2"
DATA = os.urandom(6 << 20)  # beyond what a send queue may hold (tcp_wmem: 4 MiB at most)


class _App:
    """Answers ``GET /N-M`` with bytes N to M-1 of ``path`` (zero-copy where offered)
    and ``/short`` with a Content-Length beyond the file's end; notes what each request
    was offered."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offered: list[bool] = []
        self.errors: list[BaseException] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        offered = ZEROCOPY in scope.get("extensions", {})
        self.offered.append(offered)
        name = scope["path"].strip("/")
        size = len(DATA)
        start, end = (0, size + 10) if name == "short" else map(int, name.split("-"))
        headers = [(b"content-length", str(end - start).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        with self.path.open("rb") as file:
            if not offered:
                file.seek(start)
                await send({"type": "http.response.body", "body": file.read(end - start)})
                return
            try:
                await send({"type": ZEROCOPY, "file": file, "offset": start,
                            "count": end - start, "more_body": False})  # fmt: skip
            except Exception as error:
                self.errors.append(error)
                raise


@contextlib.contextmanager
def _serving(app: _App, loop: str, tls: ssl.SSLContext | None = None) -> Iterator[int]:
    """``app`` under uvicorn with ``bounded_http`` on a thread of its own; yields its port."""
    sock = socket.socket()
    sock.bind((HOST, 0))
    config = uvicorn.Config(
        app, http=bounded_http(HeadLimits()), loop="none", log_config=None, lifespan="off",
        ssl_context_factory=None if tls is None else (lambda config, default: tls),
    )  # fmt: skip
    server = uvicorn.Server(config)
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop

    def run() -> None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(server.serve(sockets=[sock]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        for _ in range(1000):
            if server.started:
                break
            thread.join(0.01)
        assert server.started
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


def _ask(sock: socket.socket, target: str) -> None:
    sock.sendall(f"GET /{target} HTTP/1.1\r\nhost: x\r\n\r\n".encode())


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    """One answer's status and body (its Content-Length's bytes, or what came before
    the server closed)."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError(f"closed within the head {head!r}")
        head += chunk
    lines = head.decode().split("\r\n")
    length = next(
        int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length")
    )
    body = bytearray()
    while len(body) < length and (chunk := sock.recv(min(65536, length - len(body)))):
        body += chunk
    return int(lines[0].split()[1]), bytes(body)


def _client(port: int, receive_buffer: int = 4096) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # before connecting
    sock.settimeout(30)
    sock.connect((HOST, port))
    return sock


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(DATA)
    return path


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the times the server waited for a socket to take more."""
    counted: list[int] = []
    real = zerocopy._writable

    async def counting(loop: asyncio.AbstractEventLoop, fd: int) -> None:
        counted.append(fd)
        await real(loop, fd)

    monkeypatch.setattr(zerocopy, "_writable", counting)
    return counted


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_range_goes_out_whole_and_in_order_on_a_kept_alive_connection(
    data_file: Path, waits: list[int], loop: str
) -> None:
    app = _App(data_file)
    with _serving(app, loop) as port, _client(port) as sock:
        for target in ("0-6291456", "1000-2500000", "7-8"):
            _ask(sock, target)
            status, body = _answer(sock)
            first, end = map(int, target.split("-"))
            assert (status, body == DATA[first:end]) == (200, True)
    assert app.offered == [True, True, True]
    assert waits, "the small receive buffer never made the server wait"
    assert app.errors == []


def test_over_tls_it_is_not_offered_and_the_body_goes_as_usual(
    data_file: Path, tmp_path: Path
) -> None:
    create_ca(tmp_path / "ca")
    create_cert(tmp_path / "ca", "host", ips=(HOST,))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "ca" / "host.pem", tmp_path / "ca" / "host-key.pem")
    client = ssl.create_default_context(cafile=tmp_path / "ca" / "ca.pem")
    app = _App(data_file)
    with (
        _serving(app, "uvloop", server) as port,
        _client(port, 1 << 20) as raw,
        client.wrap_socket(raw, server_hostname=HOST) as sock,
    ):
        _ask(sock, "5-1048581")
        assert _answer(sock) == (200, DATA[5:1048581])
    assert app.offered == [False]


def test_a_file_shorter_than_its_count_cuts_the_answer_and_the_server_goes_on(
    data_file: Path,
) -> None:
    app = _App(data_file)
    with _serving(app, "uvloop") as port:
        with _client(port, 1 << 20) as sock:
            _ask(sock, "short")
            status, body = _answer(sock)  # the close ends it short
            assert (status, body) == (200, DATA)
            assert sock.recv(1) == b""  # closed, not kept alive
        assert [type(error) for error in app.errors] == [OSError]
        assert "ended 10 bytes short" in str(app.errors[0])
        with _client(port) as sock:
            _ask(sock, "0-10")
            assert _answer(sock) == (200, DATA[:10])


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_client_gone_half_way_leaves_no_descriptor_behind(
    data_file: Path, waits: list[int]
) -> None:
    app = _App(data_file)
    with _serving(app, "uvloop") as port:
        before = _open_files()
        with _client(port) as sock:
            _ask(sock, "0-6291456")
            sock.recv(4096)
            for _ in range(1000):  # until the server waits for this client
                if waits:
                    break
                threading.Event().wait(0.01)
            assert waits
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
        for _ in range(3000):  # the reset reaches the server; its copy of the socket closes
            if _open_files() <= before:
                break
            threading.Event().wait(0.01)
        assert _open_files() <= before
        with _client(port) as sock:
            _ask(sock, "3-9")
            assert _answer(sock) == (200, DATA[3:9])


class _Cycle:
    """uvicorn's request-response cycle as the sender sees it, its head still buffered."""

    def __init__(self) -> None:
        self.scope = {"method": "GET"}
        self.response_started, self.response_complete = True, False
        self.chunked_encoding, self.expected_content_length = False, 100
        self.disconnected = False
        self.sent: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


class _Buffered:
    def get_extra_info(self, name: str) -> Any:
        return self if name == "socket" else None

    def fileno(self) -> int:
        return -1  # never written: the head is still in the transport's buffer

    def get_write_buffer_size(self) -> int:
        return 12  # a head not yet taken by the socket


async def test_with_the_head_still_buffered_the_file_goes_through_the_transport(
    data_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zerocopy, "CHUNK_BYTES", 1 << 20)
    cycle = _Cycle()
    transport = _Buffered()
    zerocopy.offer(cycle, transport)  # type: ignore[arg-type]
    with data_file.open("rb") as file:
        file.seek(1 << 20)
        await cycle.send({"type": ZEROCOPY, "file": file})  # from its place to its end
    assert b"".join(m["body"] for m in cycle.sent) == DATA[1 << 20 :]
    assert [m["more_body"] for m in cycle.sent] == [True] * 4 + [False]  # 5 MiB, 1 MiB reads
    assert {m["type"] for m in cycle.sent} == {"http.response.body"}
