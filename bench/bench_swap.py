"""A swap between two models that cannot share one GPU, through the gateway, against
doing it by hand: ``python bench/bench_swap.py [--swaps 20] [--cold 10]``.

``serve --local --models``: the controller (memory store), this machine's agent on one
simulated 2 GiB GPU (fake probe) and the gateway in one process, with three models of
1,500 MiB each, so that no two fit at once: ``a`` (llama.cpp's server on
``tiny-chat.gguf``), ``b`` (on ``tiny-big.gguf``), ``cold`` (``tiny-chat.gguf``,
stopped 0.2 s after each answer). Each request is one ``POST /v1/chat/completions``
(one token, not streamed, on a new connection), timed at the client from its first
byte to the end of the answer. ``--src DIR`` runs another tree's code (the code before
a change, say) against the same by-hand figures. ``--trace`` runs it with debug logs timed to the
millisecond and prints the median of each phase of the swaps, from those logs.
Nothing else may run a ``serve --local`` here meanwhile (the local agent's socket is
one per machine).

- **swap**: ``a``, ``b``, ``a``, ``b``... each request sent once the other model's lease
  is idle (a cache, reclaimed at once by a request of the same priority: I5), so each
  one is the revocation of the idle lease, the stop of its server, the confirmation,
  the grant, the start of the other server, its ready check and the answer.
  **By hand** beside it, in turn: SIGTERM to the running ``llama-server`` and wait for
  its exit, start the other, poll ``/health`` every ``--poll-ms`` (5) until 200, the
  same request. No connection is kept open to a server by hand: llama.cpp's server
  exits about 110 ms after SIGTERM while one is (2 ms without).
- **cold**: a request for ``cold`` with nothing running (the lease, the start, ready,
  the answer), against starting the server by hand, polling ``/health``, the request.

It prints the median and p90 of each, the difference and the ratio of the medians.
The goal (issue 27): a swap at most 50 ms above the by-hand figure, a cold start at
most 30 ms. Everything shares this machine's cores with whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gateway import SRC, free_port, start, wait_log

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
VRAM = "1500M"
FILES = {"a": "tiny-chat.gguf", "b": "tiny-big.gguf", "cold": "tiny-chat.gguf"}
CLOSE = {"connection": "close"}  # no connection kept open to a server being stopped
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--swaps", type=int, default=20, help="swaps each way, in all")
    parser.add_argument("--cold", type=int, default=10, help="cold starts each way")
    parser.add_argument("--poll-ms", type=float, default=5.0, help="by hand: /health cadence")
    default_llama = os.environ.get("GPU_ARBITER_LLAMA_SERVER") or SHARED / "bin/llama-server"
    parser.add_argument("--llama-server", type=Path, default=Path(default_llama))
    parser.add_argument("--models", type=Path, default=SHARED / "models")
    parser.add_argument("--trace", action="store_true", help="debug logs, timed (JSON)")
    parser.add_argument("--src", type=Path, default=SRC, help="the code to run (its src/)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-arbiter-bench-swap-"))
    commands = {name: command(args, file, "{port}") for name, file in FILES.items()}
    models = f"[gateway]\nport = {free_port()}\n"
    for name, line in commands.items():
        keep = "0.2s" if name == "cold" else "10m"
        models += (
            f"[models.{name}]\ncommand = {json.dumps(line)}\nvram = {json.dumps(VRAM)}\n"
            f'keep_alive = "{keep}"\nqueue_timeout = "120s"\n'
        )
    (work / "models.toml").write_text(models)
    server = start(
        [sys.executable, "-m", "gpu_arbiter", "serve", "--local", "--models",
         str(work / "models.toml"), "--port", "0", "--state-dir", str(work / "s"),
         "--store", "memory", "--no-auth", "--simulate", "1x2G", *logs(args)],
        work / "server.log", args.src,
    )  # fmt: skip
    try:
        log = work / "server.log"
        url = "http://127.0.0.1:" + wait_log(
            log, r"GPU_ARBITER_URL=http://127\.0\.0\.1:(\d+)", server
        )
        port = int(wait_log(log, r"gateway on http://[\d.]+:(\d+)", server))
        with httpx.Client(timeout=120) as client:
            bench = Bench(client, url, f"http://127.0.0.1:{port}")
            bench.args, bench.work = args, work
            cold = bench.cold_starts(args.cold)
            swaps = bench.swaps(args.swaps)
        report("cold start", cold)
        report("swap", swaps)
        if args.trace:
            phases(work / "server.log")
        print(f"logs in {work}")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


def logs(args: argparse.Namespace) -> list[str]:
    """``--trace``: every line, timed to the millisecond (JSON), to see where a swap goes."""
    if args.trace:
        return ["--log-level", "debug", "--log-format", "json"]
    return ["--log-level", "warning"]


def command(args: argparse.Namespace, model: str, port: str) -> list[str]:
    path = str(args.models / model)
    return [str(args.llama_server), "-m", path, "-c", "512", "--port", port, "-t", "1"]


Samples = tuple[list[float], list[float]]  # (by hand, through the gateway), seconds


@dataclass
class Hand:
    """A server started by hand, and its address."""

    proc: subprocess.Popen[bytes]
    url: str


class Bench:
    def __init__(self, client: httpx.Client, controller: str, gateway: str) -> None:
        self.client = client
        self.controller = controller
        self.gateway = gateway
        self.args = argparse.Namespace()
        self.work = Path()

    def ask(self, base: str, model: str) -> float:
        """Seconds from sending one chat completion to the end of its answer."""
        began = time.perf_counter()
        answer = self.client.post(
            f"{base}/v1/chat/completions", json={"model": model, **BODY}, headers=CLOSE
        )
        took = time.perf_counter() - began
        assert answer.status_code == 200, answer.text
        return took

    def leases(self, model: str) -> list[dict[str, object]]:
        leases = self.client.get(f"{self.controller}/v1/leases").json()
        return [
            lease
            for lease in leases
            if str(lease["holder"]).startswith(f"gateway {model} ") and lease["ended_at"] is None
        ]

    def wait(self, done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}")
            time.sleep(0.02)

    def idle(self, model: str) -> bool:
        return all(bool(lease["idle"]) for lease in self.leases(model))

    def cold_starts(self, count: int) -> Samples:
        by_hand, through = [], []
        for _ in range(count):
            began = time.perf_counter()
            hand = self.start_by_hand("cold")
            self.ask(hand.url, "cold")
            by_hand.append(time.perf_counter() - began)
            stop(hand.proc)
            through.append(self.ask(self.gateway, "cold"))
            self.wait(lambda: not self.leases("cold"), "cold's lease released")
        return by_hand, through

    def swaps(self, count: int) -> Samples:
        by_hand, through = [], []
        self.ask(self.gateway, "a")  # a cold start: not counted
        running = self.start_by_hand("a")
        self.ask(running.url, "a")
        for number in range(count):
            name, other = ("b", "a") if number % 2 == 0 else ("a", "b")
            self.wait(partial(self.idle, other), f"{other}'s lease idle")
            through.append(self.ask(self.gateway, name))
            began = time.perf_counter()
            stop(running.proc)
            running = self.start_by_hand(name)
            self.ask(running.url, name)
            by_hand.append(time.perf_counter() - began)
        stop(running.proc)
        return by_hand, through

    def start_by_hand(self, name: str) -> Hand:
        """A server of ``name`` started and ready (``/health`` 200)."""
        port = free_port()
        proc = start(command(self.args, FILES[name], str(port)), self.work / f"hand-{name}.log")
        hand = Hand(proc, f"http://127.0.0.1:{port}")
        pause_s = self.args.poll_ms / 1e3
        while True:
            try:
                if self.client.get(f"{hand.url}/health", headers=CLOSE).status_code == 200:
                    return hand
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited: see {self.work / f'hand-{name}.log'}")
            time.sleep(pause_s)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def report(what: str, samples: Samples) -> None:
    by_hand, through = samples
    hand50, gate50 = statistics.median(by_hand), statistics.median(through)
    print(
        f"{what} ({len(through)} each): by hand p50 {hand50 * 1e3:.0f} ms p90 "
        f"{p90(by_hand) * 1e3:.0f} ms; through the gateway p50 {gate50 * 1e3:.0f} ms p90 "
        f"{p90(through) * 1e3:.0f} ms; added {(gate50 - hand50) * 1e3:.0f} ms "
        f"({gate50 / hand50:.2f}x)"
    )


PHASES = (  # (name, the log line that ends it), in the order of a swap
    ("revoked -> released (the stop, confirmed)", re.compile(r"ended lease .*: released")),
    ("released -> granted", re.compile(r"granted lease")),
    ("granted -> started", re.compile(r"replica \d+: started pid")),
    ("started -> ready", re.compile(r"replica \d+: ready in")),
)


def phases(log: Path) -> None:
    """``--trace``: the median time of each phase of the swaps, from the debug log's
    millisecond times (each swap begins with a revocation)."""
    times: dict[str, list[float]] = {name: [] for name, _ in PHASES}
    began: float | None = None
    at = 0
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        when = datetime.fromisoformat(row["ts"].replace("Z", "+00:00")).timestamp()
        if "revoked lease" in row["message"]:
            began, at = when, 0
        elif began is not None and PHASES[at][1].search(row["message"]):
            times[PHASES[at][0]].append(when - began)
            began, at = when, at + 1
            if at == len(PHASES):
                began = None
    for name, found in times.items():
        if found:
            print(f"  {name}: median {statistics.median(found) * 1e3:.0f} ms ({len(found)})")


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]


if __name__ == "__main__":
    main()
