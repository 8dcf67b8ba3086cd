"""HTTP benchmarks of the controller (``gpu-arbiter serve``), against a real server process.

1. Lease create+release round trips per second over HTTP with 1, 10 and 50
   concurrent clients, median and p99 latency of one round trip (POST + DELETE),
   with the SQLite store and with the memory store: the ratio is the cost of
   durability. ``--store postgresql://...`` also measures the PostgreSQL store (on
   that database; a controller leads it for the run). ``--baseline SRC`` also runs the
   ``src`` directory of other code (``git worktree add /tmp/base COMMIT``, then
   ``--baseline /tmp/base/src``) in the same run, each measurement right after ours,
   and prints our throughput and p99 against it.
   ``--rate R`` measures instead at a fixed offered rate: ``R`` round trips a second
   arrive on schedule, whether or not the earlier ones were answered, over up to 50
   keep-alive connections, and each one's latency counts from its scheduled arrival (so
   a server that falls behind shows its queue, not a slower client). 50 clients that
   each wait for their answer cannot see a p99 under 20 ms below 2,500 round trips a
   second (Little's law: 50 in flight / 20 ms); the fixed rate is how "p99 at 1,000/s"
   is measured (with ``--baseline SRC``, each store on ours then on the other code).
2. Heartbeats: 1,000 simulated workers of 8 GPUs each. The most heartbeats per
   second the controller sustains, and the controller's CPU while the 1,000
   workers heartbeat every 5 seconds (200 per second).

The clients are a minimal keep-alive HTTP/1.1 client on asyncio streams, so that
the client's own cost disturbs the server (on the same machine) as little as
possible. Run: ``python bench/bench_http.py [--seconds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
TICKS = os.sysconf("SC_CLK_TCK")


class Conn:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str):
        self.reader, self.writer, self.token = reader, writer, token

    @classmethod
    async def open(cls, port: int, token: str) -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer, token)

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {self.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        self.writer.write(head.encode() + data)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        payload = await self.reader.readexactly(length)
        return status, json.loads(payload) if payload else None

    def close(self) -> None:
        self.writer.close()


class Server:
    """A real ``gpu-arbiter serve`` on a free loopback port (``preexec_fn`` runs in the
    server's process before it starts: e.g. a raised limit of open files)."""

    def __init__(
        self,
        *args: str,
        preexec_fn: Callable[[], object] | None = None,
        src: Path = SRC,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpu-arbiter-bench-"))
        log = (self.dir / "server.log").open("wb")
        env = {**os.environ, "PYTHONPATH": str(src)}
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        command = [sys.executable, "-m", "gpu_arbiter", "serve", "--port", str(self.port)]
        command += ["--state-dir", str(self.dir), "--log-level", "warning", *args]
        self.proc = subprocess.Popen(
            command, stdout=log, stderr=log, env=env, preexec_fn=preexec_fn
        )
        self._wait_ready()
        self.token = (self.dir / "admin.token").read_text().strip()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit((self.dir / "server.log").read_text())
            try:  # ready: it accepts changes (a PostgreSQL store's leader is elected first)
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=1):
                    return
            except OSError:  # not listening yet, or 503 (urllib's HTTPError is an OSError)
                time.sleep(0.05)
        raise SystemExit("the server did not become ready")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def round_trips(server: Server, clients: int, seconds: float) -> dict[str, float]:
    conns = [await Conn.open(server.port, server.token) for _ in range(clients)]
    latencies: list[float] = []
    granted = 0
    stop_at = time.perf_counter() + seconds

    async def loop(conn: Conn) -> None:
        nonlocal granted
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            status, lease = await conn.call("POST", "/v1/leases", {"vram_mb": 1, "holder": "b"})
            assert status in (201, 202), lease
            granted += status == 201  # 202: queued behind a GPU's load gate
            status, _ = await conn.call("DELETE", f"/v1/leases/{lease['id']}")
            assert status == 200
            latencies.append(time.perf_counter() - start)

    began = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in conns))
    elapsed = time.perf_counter() - began
    for conn in conns:
        conn.close()
    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": pct(latencies, 0.99) * 1e3,
        "granted": granted / max(1, len(latencies)),
    }


async def paced_round_trips(
    server: Server, rate: float, seconds: float, connections: int = 50
) -> dict[str, float]:
    """Round trips arriving every ``1 / rate`` s for ``seconds``, each on a free
    connection (or waiting for one), its latency from its scheduled arrival."""
    free: asyncio.Queue[Conn] = asyncio.Queue()
    for _ in range(connections):
        free.put_nowait(await Conn.open(server.port, server.token))
    latencies: list[float] = []

    async def one(due: float) -> None:
        conn = await free.get()
        try:
            status, lease = await conn.call("POST", "/v1/leases", {"vram_mb": 1, "holder": "b"})
            assert status in (201, 202), lease
            status, _ = await conn.call("DELETE", f"/v1/leases/{lease['id']}")
            assert status == 200
            latencies.append(time.perf_counter() - due)
        finally:
            free.put_nowait(conn)

    began = time.perf_counter()
    trips = []
    for k in range(int(rate * seconds)):
        due = began + k / rate
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        trips.append(asyncio.create_task(one(due)))
    await asyncio.gather(*trips)
    elapsed = time.perf_counter() - began
    while not free.empty():
        free.get_nowait().close()
    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": pct(latencies, 0.99) * 1e3,
        "within_20ms": sum(t <= 0.020 for t in latencies) / len(latencies),
    }


def bench_rate(seconds: float, gpus: int, rate: float, baseline: Path | None) -> None:
    print(
        f"lease create+release round trips over HTTP at a fixed offered rate of {rate:g}/s "
        f"(up to 50 connections; latency from each one's scheduled arrival)"
    )
    print(f"{'store':>11} {'trips/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'<=20 ms':>8}")
    sides = {"": SRC, **({"base ": baseline} if baseline is not None else {})}
    for name in ("sqlite", "memory"):
        for side, src in sides.items():
            server = Server("--simulate", f"{gpus}x80G", "--store", name, src=src)
            try:
                asyncio.run(round_trips(server, 4, 0.5))  # warm up
                r = asyncio.run(paced_round_trips(server, rate, seconds))
            finally:
                server.stop()
            print(
                f"{side + name:>11} {r['rps']:>9.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                f"{r['within_20ms']:>8.1%}"
            )


def measure(
    name: str, store: list[str], gpus: int, seconds: float, src: Path
) -> dict[int, dict[str, float]]:
    """Round trips with 1, 10 and 50 clients against one server of ``src``."""
    server = Server("--simulate", f"{gpus}x80G", "--store", *store, src=src)
    results: dict[int, dict[str, float]] = {}
    try:
        asyncio.run(round_trips(server, 4, 0.5))  # warm up
        for clients in (1, 10, 50):
            r = asyncio.run(round_trips(server, clients, seconds))
            results[clients] = r
            print(
                f"{name:>11} {clients:>7} {r['rps']:>9.0f} {r['p50_ms']:>8.2f} "
                f"{r['p99_ms']:>8.2f} {r['granted']:>8.0%}"
            )
    finally:
        server.stop()
    return results


def bench_against(seconds: float, gpus: int, baseline: Path) -> None:
    """Ours and ``baseline``'s, store by store, one right after the other."""
    print(f"\nagainst {baseline} (base), same run")
    print(f"{'store':>11} {'clients':>7} {'trips/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'granted':>8}")
    for name in ("sqlite", "memory"):
        ours = measure(name, [name], gpus, seconds, SRC)
        base = measure(f"base {name}", [name], gpus, seconds, baseline)
        for clients in (1, 10, 50):
            o, b = ours[clients], base[clients]
            print(
                f"  {name} {clients:>2} clients: throughput {o['rps'] / b['rps']:.2f}x, "
                f"p50 {o['p50_ms'] / b['p50_ms']:.2f}x, p99 {o['p99_ms'] / b['p99_ms']:.2f}x "
                "of base"
            )


def bench_round_trips(seconds: float, gpus: int, postgres: str | None) -> None:
    print(
        f"lease create+release round trips over HTTP (one round trip = POST + DELETE), "
        f"one simulated worker of {gpus} GPUs"
    )
    print(f"{'store':>11} {'clients':>7} {'trips/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'granted':>8}")
    stores = {"sqlite": ["sqlite"], "memory": ["memory"]}
    if postgres is not None:
        # PostgreSQL flushes its log at every commit by default: so does SQLite with
        # --sync full (the default, normal, survives a crash of the process, not of power).
        stores["sqlite-full"] = ["sqlite", "--sync", "full"]
        stores["postgres"] = [postgres]
    results: dict[tuple[str, int], dict[str, float]] = {}
    for name, store in stores.items():
        for clients, r in measure(name, store, gpus, seconds, SRC).items():
            results[(name, clients)] = r
    pairs = [("sqlite", "memory"), ("postgres", "sqlite"), ("postgres", "sqlite-full")]
    for name, base in pairs:
        if name not in stores:
            continue
        for clients in (1, 10, 50):
            ours, theirs = results[(name, clients)], results[(base, clients)]
            print(
                f"  {clients:>2} clients: {name}/{base} throughput "
                f"{ours['rps'] / theirs['rps']:.2f}, p99 {ours['p99_ms'] / theirs['p99_ms']:.2f}x"
            )


def _heartbeat(i: int, beat: int) -> dict[str, Any]:
    return {"gpus": [{"index": g, "used_mb": 1000 + (beat + g) % 7} for g in range(8)]}


async def register_workers(server: Server, count: int) -> None:
    conns = [await Conn.open(server.port, server.token) for _ in range(8)]

    async def register(conn: Conn, names: range) -> None:
        for i in names:
            body = {
                "name": f"w{i}",
                "gpus": [{"index": g, "total_mb": 81920, "arch": "sm_90"} for g in range(8)],
            }
            status, answer = await conn.call("POST", "/v1/workers", body)
            assert status in (200, 201), answer

    await asyncio.gather(*(register(c, range(k, count, 8)) for k, c in enumerate(conns)))
    for conn in conns:
        conn.close()


async def heartbeats(server: Server, workers: int, seconds: float, rate: float | None) -> float:
    """Heartbeats sent round-robin over the workers; ``rate`` per second, or as fast as
    possible with 16 connections. Returns heartbeats per second achieved."""
    conns = [await Conn.open(server.port, server.token) for _ in range(16)]
    sent = 0
    began = time.perf_counter()
    stop_at = began + seconds

    async def loop(k: int, conn: Conn) -> None:
        nonlocal sent
        i = k
        while time.perf_counter() < stop_at:
            if rate is not None:
                due = began + sent / rate
                if due > time.perf_counter():
                    await asyncio.sleep(due - time.perf_counter())
            sent += 1
            status, answer = await conn.call(
                "POST", f"/v1/workers/w{i % workers}/heartbeat", _heartbeat(i, sent)
            )
            assert status == 200, answer
            i += len(conns)

    await asyncio.gather(*(loop(k, c) for k, c in enumerate(conns)))
    for conn in conns:
        conn.close()
    return sent / (time.perf_counter() - began)


def bench_heartbeats(seconds: float) -> None:
    workers = 1000
    print(f"\nheartbeats: {workers} workers x 8 GPUs (sqlite store)")
    server = Server("--store", "sqlite", "--heartbeat-timeout-s", "600")
    try:
        asyncio.run(register_workers(server, workers))
        most = asyncio.run(heartbeats(server, workers, seconds, None))
        print(f"  sustained, as fast as 16 connections go: {most:.0f} heartbeats/s")
        cpu_before, wall_before = server.cpu_s(), time.perf_counter()
        achieved = asyncio.run(heartbeats(server, workers, max(seconds, 10.0), workers / 5))
        cpu = (server.cpu_s() - cpu_before) / (time.perf_counter() - wall_before)
        print(
            f"  every worker every 5 s ({achieved:.0f} heartbeats/s): controller CPU "
            f"{cpu:.2f} of one core ({cpu * 1e3 / achieved:.2f} ms CPU per heartbeat)"
        )
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--only", choices=["trips", "heartbeats"], default=None)
    parser.add_argument("--gpus", type=int, default=64, help="GPUs of the simulated worker")
    parser.add_argument(
        "--store",
        metavar="URL",
        default=None,
        help="also measure round trips with the PostgreSQL store on this database "
        "(postgresql://...)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="measure round trips at this fixed offered rate per second instead",
    )
    parser.add_argument(
        "--baseline",
        metavar="SRC",
        type=Path,
        default=None,
        help="also run this src directory (other code) and print the ratios",
    )
    args = parser.parse_args()
    if args.store is not None and not args.store.startswith(("postgresql://", "postgres://")):
        parser.error("--store: a postgresql:// URL")
    if args.rate is not None:
        if args.rate <= 0:
            parser.error("--rate: a rate above 0")
        bench_rate(args.seconds, args.gpus, args.rate, args.baseline)
        return
    if args.only in (None, "trips"):
        bench_round_trips(args.seconds, args.gpus, args.store)
        if args.baseline is not None:
            bench_against(args.seconds, args.gpus, args.baseline)
    if args.only in (None, "heartbeats"):
        bench_heartbeats(args.seconds)


if __name__ == "__main__":
    main()
