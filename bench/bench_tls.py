"""The cost of TLS on the controller's lease round trip, against plain HTTP, in one run.

Two real ``gpu-arbiter serve`` processes (memory store, one simulated worker of 64 GPUs): one in
plain HTTP, one over mutual TLS (a CA and certificates made by ``certs.py``, as
``gpu-arbiter tls`` makes them; the client presents its certificate). Each round trip
is POST /v1/leases then DELETE /v1/leases/{id} on kept-alive connections (the
handshake is paid once per connection, so this is the cost of encrypting the bytes);
``--clients`` connections at once. The two servers are measured in turns (plain, TLS,
plain, ...), ``--rounds`` each, and the medians and p99 of every sample are compared.
A second figure: a new connection per request (``status``), where every request pays
a full handshake. Run: ``python bench/bench_tls.py [--seconds 3] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_http import Server, pct
from gpu_arbiter.certs import create_ca, create_cert


class TlsConn:
    """One keep-alive HTTP/1.1 connection, over TLS where ``context`` is given."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str):
        self.reader, self.writer, self.token = reader, writer, token

    @classmethod
    async def open(cls, port: int, token: str, context: ssl.SSLContext | None) -> TlsConn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        return cls(reader, writer, token)

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {self.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        self.writer.write(head.encode() + data)
        status = int((await self.reader.readline()).split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        payload = await self.reader.readexactly(length)
        return status, json.loads(payload) if payload else None

    def close(self) -> None:
        self.writer.close()


class TlsServer(Server):
    """bench_http's server over TLS: it is ready once it answers over TLS."""

    context: ssl.SSLContext

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit((self.dir / "server.log").read_text())
            url = f"https://127.0.0.1:{self.port}/readyz"
            try:
                with urllib.request.urlopen(url, timeout=1, context=self.context):
                    return
            except OSError:
                time.sleep(0.05)
        raise SystemExit("the server did not become ready")


async def leases(
    port: int, token: str, context: ssl.SSLContext | None, clients: int, seconds: float
) -> list[float]:
    """Each round trip's seconds (create + release) on ``clients`` kept-alive connections."""
    conns = [await TlsConn.open(port, token, context) for _ in range(clients)]
    times: list[float] = []
    end = time.perf_counter() + seconds

    async def loop(conn: TlsConn) -> None:
        while time.perf_counter() < end:
            start = time.perf_counter()
            status, lease = await conn.call("POST", "/v1/leases", {"vram_mb": 1, "holder": "b"})
            assert status in (201, 202), lease  # 202: queued behind a GPU's load gate
            status, _ = await conn.call("DELETE", f"/v1/leases/{lease['id']}")
            assert status == 200, status
            times.append(time.perf_counter() - start)

    await asyncio.gather(*(loop(c) for c in conns))
    for conn in conns:
        conn.close()
    return times


async def fresh(port: int, token: str, context: ssl.SSLContext | None, count: int) -> list[float]:
    """Seconds of ``count`` requests, each on a new connection (a handshake each)."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        conn = await TlsConn.open(port, token, context)
        status, _ = await conn.call("GET", "/v1/status")
        assert status == 200
        conn.close()
        times.append(time.perf_counter() - start)
    return times


def row(name: str, times: list[float], seconds: float) -> dict[str, float]:
    median, p99 = statistics.median(times) * 1e3, pct(times, 0.99) * 1e3
    rate = len(times) / seconds
    print(f"  {name:<6} {rate:>8.0f}/s  median {median:6.2f} ms  p99 {p99:6.2f} ms")
    return {"rate": rate, "median": median, "p99": p99}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 10])
    args = parser.parse_args()
    pki = Path(tempfile.mkdtemp(prefix="gpu-arbiter-bench-tls-"))
    create_ca(pki)
    create_cert(pki, "ctl", ips=("127.0.0.1",))
    create_cert(pki, "cli", dns=("cli",))
    client = ssl.create_default_context(cafile=pki / "ca.pem")
    client.load_cert_chain(pki / "cli.pem", pki / "cli-key.pem")
    TlsServer.context = client
    common = ("--store", "memory", "--simulate", "64x80G")
    plain = Server(*common)
    tls = TlsServer(
        *common, "--tls-cert", str(pki / "ctl.pem"), "--tls-key", str(pki / "ctl-key.pem"),
        "--tls-client-ca", str(pki / "ca.pem"),
    )  # fmt: skip
    try:
        servers = (("http", plain, None), ("https", tls, client))
        for clients in args.clients:
            found: dict[str, list[float]] = {"http": [], "https": []}
            for _ in range(args.rounds):
                for name, server, context in servers:
                    found[name] += asyncio.run(
                        leases(server.port, server.token, context, clients, args.seconds)
                    )
            print(f"lease round trip (create + release), {clients} kept-alive connection(s):")
            total_s = args.seconds * args.rounds
            figures = {name: row(name, times, total_s) for name, times in found.items()}
            ratio = figures["https"]["median"] / figures["http"]["median"]
            ratio_p99 = figures["https"]["p99"] / figures["http"]["p99"]
            print(f"  https/http: median {ratio:.2f}x, p99 {ratio_p99:.2f}x")
        print("a new connection per request (GET /v1/status), 200 each:")
        handshakes = {}
        for name, server, context in servers:
            times = asyncio.run(fresh(server.port, server.token, context, 200))
            handshakes[name] = statistics.median(times) * 1e3
            p99 = pct(times, 0.99) * 1e3
            print(f"  {name:<6} median {handshakes[name]:6.2f} ms  p99 {p99:6.2f} ms")
        print(f"  https/http: median {handshakes['https'] / handshakes['http']:.2f}x")
    finally:
        plain.stop()
        tls.stop()


if __name__ == "__main__":
    main()
