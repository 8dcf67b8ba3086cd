"""What one connection may cost the controller, through raw sockets on loopback: a
bounded request head, a bounded time to send it, and room for a normal client while
others hold connections open."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gpu_arbiter.web.connections import LINGERING_FILES

from .conftest import Server, burst_answers, burst_while_stopped, wait_for


def _connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _rss_kb(server: Server) -> int:
    assert server.proc is not None
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])


def _answer(sock: socket.socket, deadline_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (or a reset)."""
    sock.settimeout(deadline_s)
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


@pytest.fixture
def limited(start_server: Callable[..., Server]) -> Server:
    return start_server("--no-auth", "--header-timeout-s", "1", "--max-connections", "20")


def test_an_oversized_header_is_refused_without_reading_it(limited: Server) -> None:
    before = _rss_kb(limited)
    chunk = b"x" * (1 << 20)
    sent = 0
    started = time.monotonic()
    with _connect(limited) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
            while sent < 150 * len(chunk):  # 150 MiB, unless the server stops reading
                sock.sendall(chunk)
                sent += len(chunk)
        answer = _answer(sock)
    elapsed = time.monotonic() - started

    assert sent < 16 * len(chunk)  # it stopped reading after the limit (and socket buffers)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 ")
    assert elapsed < 15
    assert _rss_kb(limited) - before < 32 * 1024  # not grown by what was sent
    assert httpx.get(limited.url + "/healthz").status_code == 200


def test_too_many_headers_are_refused_with_431(limited: Server) -> None:
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(200))
    with _connect(limited) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n" + headers + b"\r\n")
        assert _answer(sock).startswith(b"HTTP/1.1 431 ")


def test_a_request_with_two_host_headers_is_refused_400_whichever_comes_last(
    limited: Server,
) -> None:
    """RFC 9112 (3.2): more than one Host is a 400 (judged by the last one, a foreign
    name first slipped past the Host check)."""
    for hosts in ((b"attacker.example", b"127.0.0.1"), (b"127.0.0.1", b"attacker.example")):
        with _connect(limited) as sock:
            lines = b"".join(b"Host: %s\r\n" % host for host in hosts)
            sock.sendall(b"GET /v1/workers HTTP/1.1\r\n" + lines + b"Connection: close\r\n\r\n")
            answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 400 "), (hosts, answer)
        assert answer.endswith(b"more than one Host header")


def test_a_head_within_the_limits_is_answered(limited: Server) -> None:
    with _connect(limited) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-A: " + b"a" * 30_000)
        sock.sendall(b"\r\nConnection: close\r\n\r\n")
        assert _answer(sock).startswith(b"HTTP/1.1 200 ")


def test_a_client_that_sends_its_headers_slowly_is_cut_off(limited: Server) -> None:
    started = time.monotonic()
    with _connect(limited) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n")
        sock.settimeout(0.2)
        answer = None
        for i in range(50):  # a header every 0.2 s, for 10 s at most
            with contextlib.suppress(TimeoutError):
                answer = sock.recv(4096)  # the server's 408, or its close
                break
            try:
                sock.sendall(b"X-Slow-%d: 1\r\n" % i)
            except (BrokenPipeError, ConnectionResetError):
                answer = b""
                break
    elapsed = time.monotonic() - started
    assert answer is not None
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
    assert 0.8 < elapsed < 5  # the header timeout is 1 s


@contextlib.contextmanager
def _idle_connections(server: Server, count: int) -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    try:
        for _ in range(count):
            opened.append(_connect(server))
        yield opened
    finally:
        for sock in opened:
            sock.close()


def _healthy(server: Server) -> bool:
    try:
        return httpx.get(server.url + "/healthz", timeout=10).status_code == 200
    except httpx.HTTPError:  # refused at once while the cap is reached
        return False


def _open_files(server: Server) -> int:
    assert server.proc is not None
    return len(list(Path(f"/proc/{server.proc.pid}/fd").iterdir()))


def test_idle_connections_beyond_the_cap_neither_use_up_files_nor_keep_a_client_out(
    limited: Server,
) -> None:
    files = _open_files(limited)
    with _idle_connections(limited, 200):  # the cap is 20
        time.sleep(0.3)  # every connection accepted (and the extra ones closed)
        # the cap's, and those refused that linger for the rest of their request
        assert _open_files(limited) <= files + 21 + 2 + LINGERING_FILES
        wait_for(
            lambda: _healthy(limited),
            timeout_s=10,
            what="the idle connections to be cut after the header timeout",
        )


def test_a_burst_while_the_controller_is_stopped_is_refused_at_accept_not_by_running_out(
    limited: Server,
) -> None:
    """200 connections arrive while the controller is stopped (SIGSTOP, as a loop busy
    elsewhere) under a limit of 128 open files; the cap is 20. Its listening socket
    accepts 20 and answers the rest 503 as it accepts them, so no accept fails for want
    of a descriptor (EMFILE) and the controller answers again once they are gone."""
    assert limited.proc is not None
    answers = burst_while_stopped(limited.proc.pid, limited.url)
    assert answers.count(b"HTTP/1.1 503 ") >= 200 - 20  # the 20 within the cap: 408 or 503
    assert set(answers) <= {b"HTTP/1.1 503 ", b"HTTP/1.1 408 ", b""}
    assert "out of system resource" not in limited.log.read_text()
    wait_for(lambda: _healthy(limited), timeout_s=20, what="the controller to answer")


def test_a_burst_of_requests_beyond_the_cap_is_answered_503_and_closed_not_reset(
    limited: Server,
) -> None:
    """As above, but each connection sends the start of a request's head before the
    controller runs again, so its bytes wait unread in the socket the listener refuses.
    A socket closed with bytes unread is reset (RST), and a reset can cost the client
    the answer (one still sending fails to send and may never read the 503): each one
    beyond the cap reads its 503 and then a close."""
    assert limited.proc is not None
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # still being sent
    answers = burst_answers(limited.proc.pid, limited.url, request=head)
    refused = [reset for status, reset in answers if status == b"HTTP/1.1 503 "]
    assert len(refused) >= 200 - 20  # the 20 within the cap: 408 or 503
    assert {status for status, _ in answers} <= {b"HTTP/1.1 503 ", b"HTTP/1.1 408 "}
    assert not any(reset for _, reset in answers)
