"""The gateway's HTTP/1.1 client over mutual TLS (a front door's relay to a peer that
listens over HTTPS): its kept-alive connections are used again, one handshake each, on
asyncio's loop and on uvloop's (the gateway's)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_arbiter.certs import create_ca, create_cert
from gpu_arbiter.gateway.base.upstream import Upstream
from gpu_arbiter.tls import ServerTls, client_context, server_context

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def _loops() -> list[object]:
    """asyncio's loop, and uvloop's where it is installed (the gateway runs on it)."""
    loops: list[object] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:  # not on every platform
        return loops
    return [*loops, pytest.param(uvloop.new_event_loop, id="uvloop")]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, the peer's certificate for 127.0.0.1 and the front door's own."""
    directory = tmp_path_factory.mktemp("tls")
    create_ca(directory)
    create_cert(directory, "peer", ips=("127.0.0.1",))
    create_cert(directory, "door", ips=("127.0.0.2",))
    return directory


class Peer:
    """A peer over mutual TLS that answers every request ``OK``, and counts the
    connections it accepted and the client certificates shown on them."""

    def __init__(self) -> None:
        self.accepted = 0
        self.certified = 0
        self.requests = 0
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.certified += writer.get_extra_info("peercert") is not None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.requests += 1
                writer.write(OK)
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()


async def _call(upstream: Upstream) -> bytes:
    answer = await upstream.request("POST", b"/v1/completions", [], b"{}")
    try:
        data = b""
        while chunk := await answer.read():
            data += chunk
        return data
    finally:
        answer.close()


async def _reuse(pki: Path) -> Peer:
    peer = Peer()
    listening = server_context(ServerTls(pki / "peer.pem", pki / "peer-key.pem", pki / "ca.pem"))
    server = await asyncio.start_server(peer.serve, "127.0.0.1", 0, ssl=listening)
    peer.port = server.sockets[0].getsockname()[1]
    door = client_context(pki / "ca.pem", pki / "door.pem", pki / "door-key.pem")
    upstream = Upstream(peer.port, 8, "127.0.0.1", door)
    try:
        for _ in range(20):  # one after the other: one connection
            assert await _call(upstream) == b"ok"
        assert peer.accepted == 1
        for _ in range(4):  # waves of 8 at once: 8 connections, made by the first wave
            assert await asyncio.gather(*(_call(upstream) for _ in range(8))) == [b"ok"] * 8
        assert peer.accepted == 8
        assert peer.certified == 8  # the front door's certificate shown on each
        assert peer.requests == 20 + 4 * 8
    finally:
        upstream.close()
        server.close()
        await server.wait_closed()
    return peer


@pytest.mark.parametrize("loop", _loops())
def test_kept_alive_connections_to_a_peer_over_mutual_tls_are_used_again(
    pki: Path, loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    with asyncio.Runner(loop_factory=loop) as runner:
        runner.run(_reuse(pki))
