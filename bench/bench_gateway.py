"""The model gateway's added latency and throughput, against the model server called
directly: ``python bench/bench_gateway.py [--seconds 5] [--runs 3] [--server stub|llama]``.

``--server llama`` puts llama.cpp's real server (``--llama-server``, default
``$GPU_ARBITER_LLAMA_SERVER`` or ``../shared/bin/llama-server``) on a tiny GGUF model
(``--model``, default ``../shared/models/tiny-chat.gguf``) behind the gateway and beside
it, answering ``POST /v1/completions`` with one token, and also times cold starts: a
request to a cold model through the gateway (lease, start, ready, answer) against
starting the same server by hand, polling ``/health`` every 10 ms, then the request.

A controller (memory store, one simulated 24 GiB GPU), a gateway process with one
model (tests/integration/model_server.py, warm before measuring: the first request
starts it) and a second copy of that server for the direct calls. Each caller is one
keep-alive HTTP/1.1 connection (a minimal client on asyncio streams) sending
``POST /v1/completions`` one after the other; with 1 and 50 concurrent callers it
prints the median and p99 latency and requests/s, direct and through the gateway,
and what the gateway adds (the goal: at most 1 ms at p50, 5 ms at p99, at least
1,500 requests/s): medians over ``--runs`` runs, direct and gateway measured in turn
in each. Everything shares this machine's cores: the figures include the contention
of client, gateway and server for them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MODEL_SERVER = ROOT / "tests" / "integration" / "model_server.py"
SHARED = ROOT.parent / "shared"
BODY = json.dumps({"model": "chat", "prompt": "hi", "tokens": 1, "max_tokens": 1}).encode()
COLD_MODELS = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.head = (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
        ).encode() + BODY

    async def call(self) -> int:
        """One request; a connection the server closed (llama.cpp's server ends a
        keep-alive connection after some requests) is opened again, uncounted."""
        self.writer.write(self.head)
        first = await self.reader.readline()
        if not first:
            port = self.writer.get_extra_info("peername")[1]
            self.writer.close()
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
            return await self.call()
        status = int(first.split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return status


async def measure(port: int, callers: int, seconds: float) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, requests/s) of ``callers`` connections for ``seconds``."""
    conns = [Conn(*await asyncio.open_connection("127.0.0.1", port)) for _ in range(callers)]
    for conn in conns:  # warm each connection
        assert await conn.call() == 200
    latencies: list[float] = []
    end = time.perf_counter() + seconds

    async def loop(conn: Conn) -> None:
        while time.perf_counter() < end:
            began = time.perf_counter()
            status = await conn.call()
            latencies.append(time.perf_counter() - began)
            assert status == 200, status

    began = time.perf_counter()
    await asyncio.gather(*(loop(conn) for conn in conns))
    elapsed = time.perf_counter() - began
    for conn in conns:
        conn.writer.close()
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return statistics.median(latencies) * 1e3, p99 * 1e3, len(latencies) / elapsed


def start(command: list[str], log: Path, src: Path = SRC) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    for name in ("GPU_ARBITER_URL", "GPU_ARBITER_TOKEN", "GPU_ARBITER_CONFIG"):
        env.pop(name, None)
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=out, env=env)


def wait_log(log: Path, pattern: str, proc: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.findall(pattern, log.read_text(errors="replace"))
        if found:
            return str(found[-1])
        if proc.poll() is not None:
            raise SystemExit(log.read_text())
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {pattern} in {log}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=3, help="medians over this many runs")
    parser.add_argument("--server", choices=("stub", "llama"), default="stub")
    default_llama = os.environ.get("GPU_ARBITER_LLAMA_SERVER") or SHARED / "bin/llama-server"
    parser.add_argument("--llama-server", type=Path, default=Path(default_llama))
    parser.add_argument("--model", type=Path, default=SHARED / "models/tiny-chat.gguf")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-arbiter-bench-gw-"))
    py = sys.executable
    server = start(
        [py, "-m", "gpu_arbiter", "serve", "--port", "0", "--state-dir", str(work / "s"),
         "--store", "memory", "--no-auth", "--simulate", "1x24G"],
        work / "server.log",
    )  # fmt: skip
    url = "http://127.0.0.1:" + wait_log(
        work / "server.log", r"Uvicorn running on http://127\.0\.0\.1:(\d+)", server
    )
    command = server_command(args, "{port}")
    models = f'[models.chat]\ncommand = {json.dumps(command)}\nvram = "4G"\nmax_parallel = 64\n'
    if args.server == "llama":
        for n in range(COLD_MODELS):
            models += f'[models.cold{n}]\ncommand = {json.dumps(command)}\nvram = "1G"\n'
    (work / "models.toml").write_text(models)
    gateway = start(
        [py, "-m", "gpu_arbiter", "gateway", "--config", str(work / "models.toml"), "--port",
         "0", "--controller", url, "--worker", "local", "--log-level", "warning",
         "--state-dir", str(work / "state")],
        work / "gateway.log",
    )  # fmt: skip
    gateway_port = int(wait_log(work / "gateway.log", r"gateway on http://[\d.]+:(\d+)", gateway))
    direct_port = free_port()
    direct = start(server_command(args, str(direct_port)), work / "direct.log")
    try:
        time.sleep(1.5)  # the direct server listens
        callers = (1, 50) if args.server == "stub" else (1, 4)  # llama.cpp: 4 slots
        asyncio.run(report(gateway_port, direct_port, args.seconds, args.runs, callers))
        if args.server == "llama":
            cold_starts(args, gateway_port, work)
    finally:
        for proc in (gateway, direct, server):
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def server_command(args: argparse.Namespace, port: str) -> list[str]:
    if args.server == "stub":
        return [
            sys.executable,
            str(MODEL_SERVER),
            "--port",
            port,
            "--name",
            "chat",
            "--load-s",
            "0",
        ]
    return [str(args.llama_server), "-m", str(args.model), "-c", "512", "--port", port, "-t", "1"]


def cold_starts(args: argparse.Namespace, gateway_port: int, work: Path) -> None:
    """Seconds from nothing running to the first answer: by hand, and through the gateway
    (each cold model once: a lease, the server started, ready, the request relayed)."""
    import httpx

    by_hand, through = [], []
    for n in range(COLD_MODELS):
        port = free_port()
        began = time.perf_counter()
        proc = start(server_command(args, str(port)), work / f"hand{n}.log")
        url = f"http://127.0.0.1:{port}"
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.01)
        body = {"model": "chat", "prompt": "hi", "max_tokens": 1}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        by_hand.append(time.perf_counter() - began)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        began = time.perf_counter()
        body["model"] = f"cold{n}"
        answer = httpx.post(f"http://127.0.0.1:{gateway_port}/v1/completions", json=body,
                            timeout=120)  # fmt: skip
        assert answer.status_code == 200, answer.text
        through.append(time.perf_counter() - began)
    hand, gate = statistics.median(by_hand), statistics.median(through)
    print(f"cold start (median of {COLD_MODELS}): by hand {hand * 1e3:.0f} ms, through the "
          f"gateway {gate * 1e3:.0f} ms, added {(gate - hand) * 1e3:.0f} ms")  # fmt: skip


async def report(
    gateway_port: int, direct_port: int, seconds: float, runs: int, callers_list: tuple[int, ...]
) -> None:
    """Direct and gateway measured in turn, ``runs`` times: the medians of each figure
    and of what the gateway adds in each run (the machine's load changes from run to
    run; within one run both paths see about the same)."""
    await measure(gateway_port, 1, 0.5)  # the first request loads the model: warm it
    print(f"{'callers':>7} {'path':>8} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}   ({runs} runs)")
    for callers in callers_list:
        direct, gateway, added = [], [], []
        for _ in range(runs):
            d = await measure(direct_port, callers, seconds)
            g = await measure(gateway_port, callers, seconds)
            direct.append(d)
            gateway.append(g)
            added.append((g[0] - d[0], g[1] - d[1], g[2] / d[2]))
        d50, d99, drps = _medians(direct)
        g50, g99, grps = _medians(gateway)
        a50, a99, ratio = _medians(added)
        print(f"{callers:>7} {'direct':>8} {d50:8.2f} {d99:8.2f} {drps:8.0f}")
        print(f"{callers:>7} {'gateway':>8} {g50:8.2f} {g99:8.2f} {grps:8.0f}")
        print(f"{callers:>7} {'added':>8} {a50:8.2f} {a99:8.2f} {ratio:7.2f}x")


def _medians(rows: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    p50, p99, rps = (statistics.median(column) for column in zip(*rows, strict=True))
    return p50, p99, rps


if __name__ == "__main__":
    main()
