"""Real processes over TLS on loopback, with a CA made by the command: ``serve`` over
mutual TLS reached by the CLI, ArbiterClient and an agent; plain HTTP on its port
unanswered; its certificate rotated while requests flow; a gateway's HTTPS listener
served to the openai SDK without a client certificate."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509

from gpu_arbiter.certs import create_cert
from gpu_arbiter.client import ArbiterClient
from gpu_arbiter.tls import client_context

from .agents import AgentProcess, env_for
from .cluster import Host
from .conftest import SRC, Server, wait_for
from .gateways import GatewayProcess, model_entry

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.2"
_LISTENING = re.compile(rf"Uvicorn running on https://{re.escape(HOST)}:(\d+)")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gpu_arbiter", *args]
    full = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, env=full, timeout=60)


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    """A CA made by ``gpu-arbiter tls ca``, and certificates for the controller (ctl, on
    HOST), a client and an agent's host, made by ``tls cert``."""
    directory = tmp_path / "tls"
    assert _cli("tls", "ca", "--dir", str(directory)).returncode == 0
    for name, where in (("ctl", ["--ip", HOST]), ("cli", ["--dns", "cli"])):
        done = _cli("tls", "cert", name, "--dir", str(directory), *where)
        assert done.returncode == 0, done.stderr
    return directory


class TlsServer(Server):
    """``serve`` on HOST over TLS: its URL is https, and it is asked with the CA."""

    def __init__(self, state_dir: Path, pki: Path, *args: str) -> None:
        tls = ["--tls-cert", str(pki / "ctl.pem"), "--tls-key", str(pki / "ctl-key.pem")]
        super().__init__(state_dir, "--host", HOST, *tls, *args)
        self.pki = pki

    def _port(self) -> str | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited: {self.log.read_text()}")
        found = _LISTENING.findall(self.log.read_text())
        if found:
            self.url = f"https://{HOST}:{found[-1]}"
        return found[-1] if found else None

    def start(self, timeout_s: float = 30.0, *, ready: bool = True) -> TlsServer:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        command = [sys.executable, "-m", "gpu_arbiter", "serve", "--port", "0"]
        command += ["--state-dir", str(self.state_dir), *self.args]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=log, env=env)
        try:
            wait_for(self._port, timeout_s, "the server to listen")
            wait_for(lambda: self._answers("/readyz"), timeout_s, "ready")
        except BaseException:
            self.end()
            raise
        return self

    def _answers(self, path: str) -> bool:
        try:
            with self.https() as client:
                return client.get(path, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def https(self) -> httpx.Client:
        context = client_context(
            ca=self.pki / "ca.pem", cert=self.pki / "cli.pem", key=self.pki / "cli-key.pem"
        )
        return httpx.Client(base_url=self.url, verify=context or True, timeout=10)


def _start(tmp_path: Path, pki: Path, *args: str) -> TlsServer:
    return TlsServer(tmp_path / "state", pki, "--simulate", "1x24G", *args).start()


def _client_env(pki: Path, url: str, token: str) -> dict[str, str]:
    return {
        "GPU_ARBITER_URL": url,
        "GPU_ARBITER_TOKEN": token,
        "GPU_ARBITER_CA": str(pki / "ca.pem"),
        "GPU_ARBITER_CLIENT_CERT": str(pki / "cli.pem"),
        "GPU_ARBITER_CLIENT_KEY": str(pki / "cli-key.pem"),
    }


def test_serve_over_mutual_tls_to_the_cli_the_client_and_an_agent(
    tmp_path: Path, pki: Path
) -> None:
    server = _start(tmp_path, pki, "--tls-client-ca", str(pki / "ca.pem"))
    try:
        token = server.admin_token
        env = _client_env(pki, server.url, token)
        done = _cli("status", env=env)
        assert done.returncode == 0, done.stderr
        assert "local" in done.stdout
        flags = ["--ca", env["GPU_ARBITER_CA"], "--client-cert", env["GPU_ARBITER_CLIENT_CERT"]]
        flags += ["--client-key", env["GPU_ARBITER_CLIENT_KEY"]]
        by_flags = _cli(
            *flags, "status", env={"GPU_ARBITER_URL": server.url, "GPU_ARBITER_TOKEN": token}
        )
        assert by_flags.returncode == 0, by_flags.stderr
        without = _cli(
            "status", env={**env, "GPU_ARBITER_CLIENT_CERT": "", "GPU_ARBITER_CLIENT_KEY": ""}
        )
        assert without.returncode == 69
        assert "requires a client certificate does without one" in without.stderr

        async def lease() -> str:
            context = client_context(
                ca=pki / "ca.pem", cert=pki / "cli.pem", key=pki / "cli-key.pem"
            )
            async with ArbiterClient(server.url, token=token, tls=context) as client:
                granted = await client.create_lease(vram_mb=1024, holder="tls-test")
                await client.release(granted["id"])
                return str(granted["state"])

        assert asyncio.run(lease()) in ("loading", "active")

        runtime = tmp_path / "agent"
        worker = server.token("worker", "box-t")
        agent = AgentProcess(server.url, worker, "box-t", runtime, "1x8G")
        os.environ.update({k: v for k, v in env.items() if k.startswith("GPU_ARBITER_C")})
        try:
            agent.start()
        finally:
            for name in ("GPU_ARBITER_CA", "GPU_ARBITER_CLIENT_CERT", "GPU_ARBITER_CLIENT_KEY"):
                os.environ.pop(name, None)
        try:
            with server.https() as client:
                client.headers["Authorization"] = f"Bearer {token}"

                def online() -> bool:
                    workers = client.get("/v1/workers").json()
                    return any(w["name"] == "box-t" and w["state"] == "online" for w in workers)

                wait_for(online, 30, "the agent to register over TLS")
                assert client.get("/").status_code == 200  # the dashboard
                assert client.get("/docs").status_code == 200
                assert client.get("/openapi.json").status_code == 200
        finally:
            agent.stop()
            agent.end()

        # plain HTTP on the TLS port: the handshake fails, the connection is closed unanswered
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection((HOST, port), timeout=10) as plain:
            plain.sendall(f"GET /healthz HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
            received = b""
            try:
                while chunk := plain.recv(4096):
                    received += chunk
            except ConnectionResetError:
                pass
        assert not received.startswith(b"HTTP/")
        assert received == b""
    finally:
        server.stop()
        server.end()


def _client_hello() -> bytes:
    """The first flight of a TLS client (its ClientHello), made in memory."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    hello = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="ctl")
    with pytest.raises(ssl.SSLWantReadError):
        hello.do_handshake()
    return outgoing.read()


def _closed_by_the_server(sock: socket.socket) -> bool:
    """Reads until the server closes the connection: True once it did (an end, or a
    reset), False if it was still open after the test's own generous limit (30 s: well
    below asyncio's own default handshake bound of 60 s)."""
    sock.settimeout(30.0)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_a_client_that_never_completes_its_handshake_is_closed(tmp_path: Path, pki: Path) -> None:
    """The handshake has the header timeout (0.5 s here); the test waits for the close,
    not for a time."""
    server = _start(tmp_path, pki, "--header-timeout-s", "0.5")
    try:
        port = int(server.url.rsplit(":", 1)[1])
        hello = _client_hello()
        assert len(hello) > 100
        for sent in (b"", hello[: len(hello) // 2]):  # nothing, then half a ClientHello
            with socket.create_connection((HOST, port), timeout=30) as sock:
                sock.sendall(sent)
                assert _closed_by_the_server(sock), f"still open after sending {len(sent)} B"
        with server.https() as client:  # a whole handshake is served as before
            assert client.get("/healthz").status_code == 200
    finally:
        server.stop()


def _served_serial(url: str, ca: Path) -> int:
    host, port = url.removeprefix("https://").rsplit(":", 1)
    context = ssl.create_default_context(cafile=ca)
    raw = socket.create_connection((host, int(port)), timeout=10)
    with context.wrap_socket(raw, server_hostname=host) as wrapped:
        der = wrapped.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_a_rotated_certificate_serves_new_handshakes_and_no_request_is_lost(
    tmp_path: Path, pki: Path
) -> None:
    server = _start(tmp_path, pki)
    try:
        old = _served_serial(server.url, pki / "ca.pem")
        env = {"GPU_ARBITER_CA": str(pki / "ca.pem")}
        context = client_context(env=env)

        async def flow(stop: asyncio.Event) -> tuple[int, int]:
            """Requests on a kept-alive connection and on a new one each, until stop."""
            done = 0
            async with ArbiterClient(server.url, token=server.admin_token, tls=context) as kept:
                while not stop.is_set():
                    await kept.status()
                    async with ArbiterClient(
                        server.url, token=server.admin_token, tls=context
                    ) as fresh:
                        await fresh.status()
                    done += 2
            return done, 0

        async def rotate() -> tuple[int, int]:
            stop = asyncio.Event()
            flowing = asyncio.create_task(flow(stop))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(create_cert, pki, "ctl", ips=(HOST,))
            new = x509.load_pem_x509_certificate((pki / "ctl.pem").read_bytes()).serial_number
            for _ in range(200):  # the reload looks every 2 s
                if await asyncio.to_thread(_served_serial, server.url, pki / "ca.pem") == new:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            stop.set()
            done, _ = await flowing  # any failed request raised here
            return done, new

        done, new = asyncio.run(rotate())
        assert new != old
        assert _served_serial(server.url, pki / "ca.pem") == new
        assert done > 10
        assert "TLS certificate" in server.log.read_text()
    finally:
        server.stop()
        server.end()


def test_a_gateway_serves_https_to_the_openai_sdk_without_a_client_certificate(
    tmp_path: Path, pki: Path
) -> None:
    create_cert(pki, "gw", ips=("127.0.0.1",))
    server = Server(tmp_path / "ctl", "--simulate", "1x24G").start()
    try:
        record = tmp_path / "records"
        record.mkdir()
        gateway_table = (
            "[gateway]\n"
            f'tls_cert = "{pki / "gw.pem"}"\n'
            f'tls_key = "{pki / "gw-key.pem"}"\n'
            f'tls_client_ca = "{pki / "ca.pem"}"\n'
        )
        gateway = GatewayProcess(
            server.url,
            server.admin_token,
            tmp_path / "gw",
            gateway_table + model_entry("chat", record, vram="1G"),
        )
        listening = re.compile(r"gateway on https://127\.0\.0\.1:(\d+)")

        def port() -> str | None:
            assert gateway.proc is not None
            assert gateway.proc.poll() is None, gateway.log.read_text()
            found = listening.findall(gateway.log.read_text(errors="replace"))
            return found[-1] if found else None

        gateway.runtime.mkdir(parents=True, exist_ok=True)
        gateway.config.write_text(gateway.models)
        with gateway.log.open("ab") as log:
            gateway.proc = subprocess.Popen(
                gateway.command, stdout=log, stderr=log, env=env_for(gateway.runtime)
            )
        url = f"https://127.0.0.1:{wait_for(port, 30, 'the gateway to listen')}"
        try:
            trusting = ssl.create_default_context(cafile=pki / "ca.pem")
            with httpx.Client(verify=trusting) as http:
                sdk = openai.OpenAI(base_url=url + "/v1", api_key="none", http_client=http)
                answer = sdk.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "hi"}]
                )
            assert answer.choices
            # a client certificate of another CA is refused at the handshake
            other = tmp_path / "other"
            assert _cli("tls", "ca", "--dir", str(other)).returncode == 0
            create_cert(other, "intruder", dns=("intruder",))
            trusting.load_cert_chain(other / "intruder.pem", other / "intruder-key.pem")
            with pytest.raises(httpx.HTTPError):
                httpx.get(url + "/v1/models", verify=trusting, timeout=10)
            # plain HTTP on its port: nothing comes back
            with pytest.raises(httpx.HTTPError):
                httpx.get(url.replace("https", "http") + "/v1/models", timeout=10)
        finally:
            gateway.stop()
            gateway.end()
    finally:
        server.stop()
        server.end()


def test_a_front_door_relays_to_its_peer_over_mutual_tls_and_an_sdk_caller_needs_none(
    tmp_path: Path, pki: Path, start_server: Callable[..., Server]
) -> None:
    """Two hosts whose gateways listen over HTTPS only, each with its own certificate
    (gw-2 on 127.0.0.2, gw-3 on 127.0.0.3) and the cluster's CA as client CA: an openai
    SDK caller without a certificate asks gw-2 (too small for chat) and is served by gw-3,
    relayed over HTTPS with gw-2's own certificate shown; a caller showing another CA's
    certificate is refused at the handshake."""
    server = start_server()
    admin = server.client()
    record = tmp_path / "records"
    record.mkdir()
    hosts = []
    try:
        for number, spec in ((2, "1x4G:sm_86"), (3, "1x24G:sm_86")):
            name = f"gw-{number}"
            create_cert(pki, name, ips=(f"127.0.0.{number}",))
            tls = (
                f'tls_cert = "{pki / f"{name}.pem"}"\n'
                f'tls_key = "{pki / f"{name}-key.pem"}"\n'
                f'tls_client_ca = "{pki / "ca.pem"}"\n\n'
            )
            models = tls + model_entry("chat", record, mb=6000, vram="8G", keep_alive="60s")
            hosts.append(Host(server, tmp_path, number, spec, models).start(admin))
        door = hosts[0]
        assert door.gateway.url.startswith("https://127.0.0.2:")
        trusting = ssl.create_default_context(cafile=pki / "ca.pem")

        def sees(host: Host, other: str) -> bool:
            listing = httpx.get(host.gateway.url + "/v1/models", verify=trusting).json()
            (chat,) = [m for m in listing["data"] if m["id"] == "chat"]
            return any(h["gateway"] == other and h["routable"] for h in chat["hosts"])

        def sees_gw3() -> bool:
            return sees(door, "gw-3")

        wait_for(lambda: sees_gw3() and sees(hosts[1], "gw-2"), what="each to see the other")
        with httpx.Client(verify=trusting, timeout=60) as http:
            sdk = openai.OpenAI(base_url=door.gateway.url + "/v1", api_key="none", http_client=http)
            raw = sdk.chat.completions.with_raw_response.create(
                model="chat", messages=[{"role": "user", "content": "hi"}]
            )
            assert raw.headers["x-served-by"] == "gw-3/chat"
            assert raw.parse().choices
        assert sees_gw3()  # its liveness asks, over HTTPS too, found it answering
        other = tmp_path / "other"
        assert _cli("tls", "ca", "--dir", str(other)).returncode == 0
        create_cert(other, "intruder", dns=("intruder",))
        trusting.load_cert_chain(other / "intruder.pem", other / "intruder-key.pem")
        with pytest.raises(httpx.HTTPError):
            httpx.get(door.gateway.url + "/v1/models", verify=trusting, timeout=10)
    finally:
        for host in reversed(hosts):
            host.stop()
        admin.close()
