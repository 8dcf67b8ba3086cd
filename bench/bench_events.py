"""Event fan-out: what open ``GET /v1/events`` streams cost a lease round trip.

A real controller process (``gpu-arbiter serve``, SQLite store) on loopback. For each
count of open streams (0, 1,000 and 5,000 by default), the streams are opened first
(each subscribed to every event, its client reading and discarding what arrives, as a
dashboard does), then one client makes lease create+release round trips (POST +
DELETE; each round trip commits three events, which every stream receives) one after
another for ``--seconds``. Prints the median and p99 latency of a round trip and their
ratio to the figures with no stream open.

Each connection is a file descriptor in both processes: the benchmark raises its soft
``RLIMIT_NOFILE`` to the hard limit, and starts the server with the same. The whole run
is bounded: each phase stops after ``--seconds``, opening streams gives up after 60 s.
Run: ``python bench/bench_events.py [--seconds 5] [--streams 0,1000,5000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from bench_http import Server

OPEN_TIMEOUT_S = 60.0


def raise_file_limit() -> int:
    """Raises this process's soft limit on open files to its hard limit; returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


class Discard(asyncio.Protocol):
    """An idle stream's client: reads whatever arrives and drops it."""

    def __init__(self) -> None:
        self.received = 0
        self.transport: asyncio.BaseTransport | None = None

    def data_received(self, data: bytes) -> None:
        self.received += len(data)


async def open_streams(port: int, token: str, count: int) -> list[Discard]:
    request = (
        f"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        "Accept: text/event-stream\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    streams: list[Discard] = []

    async def one() -> None:
        transport, protocol = await loop.create_connection(Discard, "127.0.0.1", port)
        protocol.transport = transport
        transport.write(request)
        streams.append(protocol)

    for start in range(0, count, 200):
        await asyncio.gather(*(one() for _ in range(start, min(count, start + 200))))
    deadline = time.monotonic() + OPEN_TIMEOUT_S
    while any(s.received == 0 for s in streams):  # each answered (its headers, retry:)
        if time.monotonic() > deadline:
            raise SystemExit("the streams were not all answered in time")
        await asyncio.sleep(0.05)
    return streams


async def call(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str, method: str, path: str
) -> tuple[int, Any]:
    data = b"" if method != "POST" else json.dumps({"vram_mb": 1, "holder": "bench"}).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    payload = await reader.readexactly(length)
    return status, json.loads(payload) if payload else None


async def round_trips(port: int, token: str, seconds: float) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds
    try:
        while time.perf_counter() < stop_at:
            began = time.perf_counter()
            status, lease = await call(reader, writer, token, "POST", "/v1/leases")
            assert status in (201, 202), lease
            status, _ = await call(reader, writer, token, "DELETE", f"/v1/leases/{lease['id']}")
            assert status == 200
            latencies.append(time.perf_counter() - began)
    finally:
        writer.close()
    return latencies


async def hold_streams(port: int, token: str, count: int) -> None:
    """The streams' process: opens them, says so on stdout, reads them until stdin
    closes, then says how many bytes they received."""
    streams = await open_streams(port, token, count)
    print("open", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    print(sum(s.received for s in streams), flush=True)


class Streams:
    """``count`` idle streams held by a process of their own, so that reading them
    does not delay the measuring client's loop."""

    def __init__(self, server: Server, count: int) -> None:
        command = [sys.executable, __file__, "--hold", str(count), "--port", str(server.port)]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "BENCH_TOKEN": server.token},
            text=True,
            preexec_fn=raise_file_limit,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "open":
            self.proc.kill()
            raise SystemExit(f"the streams could not be opened: {line!r}")

    def close(self) -> int:
        """Closes the streams; returns the bytes they received."""
        received, _ = self.proc.communicate(timeout=60)
        return int(received.strip() or 0)


def measure(server: Server, count: int, seconds: float) -> dict[str, float]:
    streams = Streams(server, count) if count else None
    try:
        asyncio.run(round_trips(server.port, server.token, min(1.0, seconds)))  # warm up
        latencies = asyncio.run(round_trips(server.port, server.token, seconds))
    finally:
        received = streams.close() if streams is not None else 0
    time.sleep(0.5)  # the server sees the streams go
    return {
        "trips": len(latencies),
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": sorted(latencies)[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3,
        "kb_per_stream": received / max(1, count) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="of round trips per count")
    parser.add_argument("--streams", default="0,1000,5000", help="counts of open streams")
    parser.add_argument("--hold", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    limit = raise_file_limit()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if args.hold is not None:  # the streams' process (see Streams)
        asyncio.run(hold_streams(args.port, os.environ["BENCH_TOKEN"], args.hold))
        return
    counts = [int(c) for c in args.streams.split(",")]
    if max(counts) + 100 > limit:
        raise SystemExit(f"{max(counts)} streams need more open files than the limit {limit}")
    print("lease create+release round trips (POST + DELETE, one client) with idle event streams")
    print(
        f"{'streams':>7} {'trips':>6} {'p50 ms':>8} {'p99 ms':>8} {'x p50':>6} {'x p99':>6} "
        f"{'KiB/stream':>10}"
    )
    server = Server(
        "--simulate",
        "1x80G",
        "--store",
        "sqlite",
        "--max-streams-per-token",
        str(max(counts) + 1),
        preexec_fn=raise_file_limit,
    )
    base: dict[str, float] | None = None
    try:
        for count in counts:
            r = measure(server, count, args.seconds)
            base = base or r
            print(
                f"{count:>7} {r['trips']:>6.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                f"{r['p50_ms'] / base['p50_ms']:>6.2f} {r['p99_ms'] / base['p99_ms']:>6.2f} "
                f"{r['kb_per_stream']:>10.1f}"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
