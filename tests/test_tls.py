"""TLS from PEM files (``tls.py``): a listener's context and its reload, a client's
context from the environment, and what a refused certificate says, each over a real
handshake on loopback (a server on 127.0.0.2 presenting the certificate under test)."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from gpu_arbiter.certs import create_ca, create_cert
from gpu_arbiter.client import ArbiterClient, ControllerUnreachable
from gpu_arbiter.core import InvalidInput
from gpu_arbiter.tls import Reloader, ServerTls, client_context, server_context

HOST = "127.0.0.2"


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    create_ca(tmp_path / "ca")
    create_cert(tmp_path / "ca", "ctl", ips=(HOST,))
    create_cert(tmp_path / "ca", "cli", dns=("client",))
    return tmp_path / "ca"


def _tls(directory: Path, name: str = "ctl", client_ca: bool = False) -> ServerTls:
    ca = directory / "ca.pem" if client_ca else None
    return ServerTls(directory / f"{name}.pem", directory / f"{name}-key.pem", ca)


def _serial(path: Path) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


async def _answering(context: ssl.SSLContext) -> AsyncIterator[int]:
    """A TLS server on HOST answering every request 200 ``{}``; yields its port."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (await reader.readuntil(b"\r\n\r\n")) and not writer.is_closing():
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async for port in _serving(answer, context):
        yield port


async def _serving(
    answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    context: ssl.SSLContext,
) -> AsyncIterator[int]:
    """A TLS server on HOST whose connections ``answer`` handles; yields its port."""
    server = await asyncio.start_server(answer, HOST, 0, ssl=context)
    async with server:
        yield server.sockets[0].getsockname()[1]


async def _peer_serial(port: int, context: ssl.SSLContext) -> int:
    _, writer = await asyncio.open_connection(HOST, port, ssl=context)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


def test_a_file_that_cannot_be_loaded_is_named_by_its_setting(ca: Path) -> None:
    with pytest.raises(InvalidInput) as missing:
        server_context(ServerTls(ca / "nope.pem", ca / "ctl-key.pem"))
    assert missing.value.field == "tls_cert"
    assert "no such file" in missing.value.reason
    with pytest.raises(InvalidInput) as mismatched:
        server_context(ServerTls(ca / "ctl.pem", ca / "cli-key.pem"))
    assert mismatched.value.field == "tls_cert"
    assert "the key is not the certificate's" in mismatched.value.reason
    with pytest.raises(InvalidInput) as client_ca:
        server_context(ServerTls(ca / "ctl.pem", ca / "ctl-key.pem", ca / "ctl-key.pem"))
    assert client_ca.value.field == "tls_client_ca"


def test_a_client_context_comes_from_the_environment(ca: Path) -> None:
    assert client_context(env={}) is None
    context = client_context(env={"GPU_ARBITER_CA": str(ca / "ca.pem")})
    assert context is not None
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    with pytest.raises(InvalidInput) as bad:
        client_context(env={"GPU_ARBITER_CA": str(ca / "missing.pem")})
    assert bad.value.field == "GPU_ARBITER_CA"
    with pytest.raises(InvalidInput) as alone:
        client_context(env={"GPU_ARBITER_CLIENT_KEY": str(ca / "cli-key.pem")})
    assert alone.value.field == "GPU_ARBITER_CLIENT_CERT"


async def test_a_changed_certificate_serves_the_next_handshakes(ca: Path) -> None:
    tls = _tls(ca)
    reloader = Reloader(server_context(tls), tls)
    trusting = client_context(ca=ca / "ca.pem")
    assert trusting is not None
    old = _serial(ca / "ctl.pem")
    async for port in _answering(reloader.context):
        assert await _peer_serial(port, trusting) == old
        assert not reloader.check()  # nothing changed
        key = (ca / "ctl-key.pem").read_bytes()
        create_cert(ca, "ctl", ips=(HOST,))
        (ca / "ctl-key.pem").write_bytes(key)  # the new cert beside the old key: refused
        assert not reloader.check()
        assert await _peer_serial(port, trusting) == old  # the old pair serves on
        create_cert(ca, "ctl", ips=(HOST,))
        new = _serial(ca / "ctl.pem")
        assert reloader.check()
        assert await _peer_serial(port, trusting) == new
        assert reloader.reloads == 1


async def _telling_client_serial(context: ssl.SSLContext) -> AsyncIterator[int]:
    """A TLS server on HOST that requires a client certificate and answers each request
    with the serial number of the one the client presented, then closes the connection
    (so that every request is a new connection and handshake); yields its port."""
    from cryptography import x509

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
            body = str(x509.load_der_x509_certificate(der).serial_number).encode()
            head = f"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async for port in _serving(answer, context):
        yield port


async def test_a_long_lived_client_presents_its_renewed_certificate_on_new_connections(
    ca: Path,
) -> None:
    """A client certificate renewed on disk is presented from the next connection on, by
    the very client that was built before (an agent's, a gateway's), over the async and
    the sync transports of httpx; a new cert beside the old key is not loaded (the old
    pair goes on), and nothing is loaded while the files stay as they are."""
    import httpx

    context = client_context(ca=ca / "ca.pem", cert=ca / "cli.pem", key=ca / "cli-key.pem")
    assert context is not None
    reloader = context.reloader  # type: ignore[attr-defined]
    reloader.every_s = 0.0  # looked at before every connection (RELOAD_S otherwise)
    old = _serial(ca / "cli.pem")
    async for port in _telling_client_serial(server_context(_tls(ca, client_ca=True))):
        url = f"https://{HOST}:{port}/"
        async with httpx.AsyncClient(verify=context) as client:

            async def presented(url: str = url) -> int:
                return int((await client.get(url)).text)

            def presented_sync(url: str = url) -> int:
                with httpx.Client(verify=context) as sync:
                    return int(sync.get(url).text)

            assert await presented() == old
            assert await presented() == old
            assert reloader.reloads == 0  # the files did not change

            key = (ca / "cli-key.pem").read_bytes()
            create_cert(ca, "cli", dns=("client",))
            (ca / "cli-key.pem").write_bytes(key)  # the new cert, the old key: not loaded
            assert await presented() == old
            assert reloader.reloads == 0

            create_cert(ca, "cli", dns=("client",))  # renewed: cert and key
            new = _serial(ca / "cli.pem")
            assert new != old
            assert await presented() == new
            assert await asyncio.to_thread(presented_sync) == new
            assert reloader.reloads == 1


async def test_a_client_looks_at_its_certificate_files_at_most_every_reload_s(ca: Path) -> None:
    context = client_context(ca=ca / "ca.pem", cert=ca / "cli.pem", key=ca / "cli-key.pem")
    assert context is not None
    reloader = context.reloader  # type: ignore[attr-defined]
    looked: list[bool] = []
    check = reloader.check
    reloader.check = lambda: looked.append(True) or check()
    reloader.every_s = 3600.0
    for _ in range(3):
        context.wrap_bio(ssl.MemoryBIO(), ssl.MemoryBIO(), server_hostname=HOST)
    assert looked == [True]  # the first connection looked, the next two did not
    assert client_context(ca=ca / "ca.pem").reloader is None  # type: ignore[union-attr]


def _another_ca(tmp_path: Path) -> Path:
    other = tmp_path / "other"
    create_ca(other)
    create_cert(other, "ctl", ips=(HOST,))
    return other


@pytest.mark.parametrize(
    ("case", "words"),
    [
        (
            "another CA",
            "certificate was refused: unable to get local issuer certificate: not signed",
        ),
        ("expired", "certificate was refused: certificate has expired"),
        ("another name", "certificate was refused: IP address mismatch"),
    ],
)
async def test_a_controller_whose_certificate_is_not_trusted_is_refused_in_words(
    ca: Path, tmp_path: Path, case: str, words: str
) -> None:
    if case == "another CA":  # a man in the middle, with a certificate for the address
        served = _tls(_another_ca(tmp_path))
    elif case == "expired":
        long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
        create_cert(ca, "old", ips=(HOST,), days=1, now=long_ago)
        served = _tls(ca, "old")
    else:
        create_cert(ca, "elsewhere", ips=("127.0.0.3",), dns=("box-9",))
        served = _tls(ca, "elsewhere")
    async for port in _answering(server_context(served)):
        trusting = client_context(ca=ca / "ca.pem")
        async with ArbiterClient(f"https://{HOST}:{port}", tls=trusting) as client:
            with pytest.raises(ControllerUnreachable) as refused:
                await client.status()
        assert words in str(refused.value)
        # the same server is answered once its certificate is trusted (the test's own check)
        if case == "another CA":
            trusting_it = client_context(ca=tmp_path / "other" / "ca.pem")
            async with ArbiterClient(f"https://{HOST}:{port}", tls=trusting_it) as client:
                assert await client.status() == {}


async def test_a_listener_asking_for_client_certificates_says_so(ca: Path) -> None:
    context = server_context(_tls(ca, client_ca=True))
    async for port in _answering(context):
        url = f"https://{HOST}:{port}"
        with_cert = client_context(ca=ca / "ca.pem", cert=ca / "cli.pem", key=ca / "cli-key.pem")
        async with ArbiterClient(url, tls=with_cert) as client:
            assert await client.status() == {}
        async with ArbiterClient(url, tls=client_context(ca=ca / "ca.pem")) as client:
            with pytest.raises(ControllerUnreachable) as refused:
                await client.status()
        assert "client certificate" in str(refused.value)


async def test_a_gateways_listener_closes_a_client_that_never_completes_its_handshake(
    ca: Path,
) -> None:
    """The gateway's uvicorn server with TLS gives a handshake its bound (0.3 s here, its
    header timeout in a gateway); the test waits for the close, not for a time, at most
    30 s (asyncio's own default bound is 60 s)."""
    import socket

    import uvicorn

    from gpu_arbiter.gateway.serve import _Server

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        return None

    tls = _tls(ca)
    context = server_context(tls)
    config = uvicorn.Config(
        app, lifespan="off", log_config=None, ssl_context_factory=lambda c, d: context
    )
    server = _Server(config, Reloader(context, tls), handshake_timeout_s=0.3)
    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen()
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(30):
            while not server.started:
                await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(HOST, sock.getsockname()[1])
        try:
            async with asyncio.timeout(30):
                assert await reader.read() == b""  # closed by the server, nothing sent
        finally:
            writer.close()
    finally:
        server.should_exit = True
        await serving
        sock.close()
