"""The cluster front door's extra hop and its cold burst:
``python bench/bench_frontdoor.py [--against [REV]] [--seconds 3] [--runs 3] [--burst 200]
[--load-s 0.2]``.

A controller (memory store) and two hosts on this machine, each an agent with its own
worker name, simulated GPU and runtime directory and a gateway on its own loopback
address: box-2 (``1x4G:sm_86``) with gw-2 on 127.0.0.2, box-3 (``1x24G:sm_86``) with
gw-3 on 127.0.0.3. Both gateways declare model ``chat`` (tests/integration/model_server.py,
``vram = "8G"``: it fits only box-3), warmed by one request at gw-2.

1. **The extra hop.** With 1 and 16 concurrent callers (each one keep-alive HTTP/1.1
   connection sending ``POST /v1/completions`` one after the other), in turn within
   each run: (a) direct to gw-3, the gateway beside the replica; (b) via gw-2, the
   front door that forwards to gw-3. Every answer of (b) must carry ``x-served-by:
   gw-3/chat``. Prints the medians over ``--runs`` of p50, p99 and requests/s of each,
   and of what the front door adds in each run; the goal: at most 0.5 ms added at p50
   with one caller.
2. **The cold burst.** Both gateways also declare fresh models (``cold-N``, 1 GiB,
   which fit either host). A single caller's first answer from a cold model (at gw-2:
   the cluster's load, the server's start and ready check, the answer), then, on
   another fresh model, ``--burst`` callers at once split across both front doors:
   the time to the first answer and to all answers, the ratio of the first answer to
   the single cold start (goal: at most 1.2x), and how many servers the burst started
   (counted by the model server's ``--record`` files: it must be 1). Repeated
   ``--runs`` times with new models; the medians are printed.

With ``--against REV`` (``--against`` alone: ``94a2739``, the last commit before the
gateway was split into packages and its request path rewritten) the extra hop is
measured on this tree and on REV in one run: REV is checked out as a ``git worktree``
in a temporary folder (removed after), and each of the ``--runs`` runs starts each
tree's controller, agents and gateways in turn (``PYTHONPATH=<tree>/src``; the order
alternates run by run, so that the machine's drift falls on both), measures both paths
with 1 and 16 callers, and stops them. The callers, the model server and this harness
are this tree's for both (the flags, config keys, ``x-served-by`` and the hosts of
``GET /v1/models`` the harness uses are the same at 94a2739). Prints the medians per
tree, the ratio this tree / REV of what the front door adds (p50 and p99), and whether
this tree meets the goal. The cold burst then runs on this tree only, in a cluster of
its own.

Every process is stopped at the end of each cluster's turn (SIGTERM, then a wait;
SIGKILL after 30 s), also on errors. Everything shares this machine's cores: the
figures include the contention of the callers, both gateways, the agents, the
controller and the model servers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL_SERVER = ROOT / "tests" / "integration" / "model_server.py"
CALLERS = (1, 16)
GOAL_ADDED_P50_MS = 0.5
GOAL_BURST_RATIO = 1.2
BEFORE = "94a2739"  # the last commit before the gateway's packages and request path

Figures = tuple[float, float, float]  # p50 ms, p99 ms, requests/s
Run = dict[int, tuple[Figures, Figures]]  # callers: (direct, via the front door)


class Conn:
    """One keep-alive HTTP/1.1 connection sending ``POST /v1/completions``."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, model: str
    ) -> None:
        self.reader, self.writer = reader, writer
        host, port = writer.get_extra_info("peername")[:2]
        body = json.dumps({"model": model, "prompt": "hi", "tokens": 1, "max_tokens": 1})
        self.head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
        self.served_by = ""
        self.body = b""

    @classmethod
    async def open(cls, address: tuple[str, int], model: str) -> Conn:
        return cls(*await asyncio.open_connection(*address), model)

    async def call(self) -> int:
        self.writer.write(self.head)
        first = await self.reader.readline()
        if not first:
            raise ConnectionError("the gateway closed the connection")
        status = int(first.split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            name = name.lower()
            if name == "content-length":
                length = int(value)
            elif name == "x-served-by":
                self.served_by = value.strip()
        self.body = await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


async def measure(
    address: tuple[str, int], callers: int, seconds: float, served_by: str
) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, requests/s) of ``callers`` connections to ``address`` for
    ``seconds``; every answer a 200 served by ``served_by``."""
    conns = [await Conn.open(address, "chat") for _ in range(callers)]
    for conn in conns:  # warm each connection
        assert await conn.call() == 200
    latencies: list[float] = []
    end = time.perf_counter() + seconds

    async def loop(conn: Conn) -> None:
        while time.perf_counter() < end:
            began = time.perf_counter()
            status = await conn.call()
            latencies.append(time.perf_counter() - began)
            if status != 200 or conn.served_by != served_by:
                raise SystemExit(f"{address}: {status}, served by {conn.served_by!r}")

    began = time.perf_counter()
    try:
        await asyncio.gather(*(loop(conn) for conn in conns))
    finally:
        for conn in conns:
            conn.close()
    elapsed = time.perf_counter() - began
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return statistics.median(latencies) * 1e3, p99 * 1e3, len(latencies) / elapsed


class Processes:
    """Every process of one cluster, each run from the tree at ``src``; stopped last
    first."""

    def __init__(self, work: Path, src: Path) -> None:
        self.work, self.src = work, src
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, command: list[str], log: Path, runtime: Path | None = None) -> Any:
        env = {**os.environ, "PYTHONPATH": str(self.src)}
        for name in ("GPU_ARBITER_URL", "GPU_ARBITER_TOKEN", "GPU_ARBITER_CONFIG"):
            env.pop(name, None)
        if runtime is not None:
            runtime.mkdir(parents=True, exist_ok=True)
            env["GPU_ARBITER_RUNTIME_DIR"] = str(runtime)
        with log.open("wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=out, env=env)
        self.started.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


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


def wait_until(check: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def model_table(name: str, record: Path, vram: str, mb: int, load_s: float) -> str:
    command = [sys.executable, str(MODEL_SERVER), "--port", "{port}", "--name", name]
    command += ["--mb", str(mb), "--load-s", str(load_s), "--record", str(record)]
    return (
        f"[models.{name}]\ncommand = {json.dumps(command)}\nvram = {json.dumps(vram)}\n"
        'max_parallel = 64\nkeep_alive = "10m"\nqueue_timeout = "120s"\n'
    )


def records(directory: Path, name: str) -> int:
    """How many processes of model ``name`` started (each writes its own record)."""
    return len(list(directory.glob(f"{name}-*.json")))


def sees_each_other(gateways: dict[str, tuple[str, int]], model: str) -> bool:
    for address in gateways.values():
        try:
            entries = httpx.get(f"http://{address[0]}:{address[1]}/v1/models").json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        entry = next((e for e in entries if e["id"] == model), None)
        seen = {h["gateway"] for h in (entry or {}).get("hosts", []) if h.get("routable")}
        if seen != set(gateways):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--against",
        nargs="?",
        const=BEFORE,
        help=f"also measure the hop at this commit, in turn (alone: {BEFORE})",
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="each path's turn")
    parser.add_argument("--runs", type=int, default=3, help="medians over this many runs")
    parser.add_argument("--burst", type=int, default=200, help="callers of the cold burst")
    parser.add_argument("--load-s", type=float, default=0.2, help="a cold server's load")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-arbiter-bench-frontdoor-"))
    if args.against is None:
        with cluster(work, ROOT / "src", args) as (gateways, record):
            asyncio.run(warm(gateways))
            report({"this": [asyncio.run(hop(gateways, args.seconds)) for _ in range(args.runs)]})
            asyncio.run(cold(gateways, record, args))
    else:
        rev = _short(args.against)
        with worktree(rev) as other:
            found = against(work, {"this": ROOT, rev: other}, args)
        report(found)
        with cluster(work / "cold", ROOT / "src", args) as (gateways, record):
            asyncio.run(cold(gateways, record, args))
    print(f"(logs in {work})")


def against(work: Path, trees: dict[str, Path], args: argparse.Namespace) -> dict[str, list[Run]]:
    """The hop of each tree, ``--runs`` times, each run starting each tree's cluster in
    turn (the first tree first in even runs, last in odd ones)."""
    found: dict[str, list[Run]] = {name: [] for name in trees}
    for n in range(args.runs):
        order = list(trees.items()) if n % 2 == 0 else list(trees.items())[::-1]
        for name, tree in order:
            with cluster(work / f"run-{n + 1}-{name}", tree / "src", args) as (gateways, _):
                asyncio.run(warm(gateways))
                found[name].append(asyncio.run(hop(gateways, args.seconds)))
        print(f"run {n + 1}/{args.runs} done", file=sys.stderr)
    return found


def _short(rev: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """``rev`` checked out in a temporary folder, removed after."""
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), rev],
            check=True,
            capture_output=True,
        )
        try:
            yield other
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)],
                check=False,
                capture_output=True,
            )


@contextlib.contextmanager
def cluster(
    work: Path, src: Path, args: argparse.Namespace
) -> Iterator[tuple[dict[str, tuple[str, int]], Path]]:
    """The controller and both hosts of the tree at ``src``, stopped on the way out."""
    work.mkdir(parents=True, exist_ok=True)
    procs = Processes(work, src)
    try:
        yield start_cluster(procs, work, args)
    finally:
        procs.stop()


def start_controller(procs: Processes, work: Path) -> tuple[str, str, httpx.Client]:
    """A controller on a memory store: its URL, its admin token, an admin client."""
    server = procs.start(
        [sys.executable, "-m", "gpu_arbiter", "serve", "--port", "0", "--state-dir",
         str(work / "s"), "--store", "memory"],
        work / "server.log",
    )  # fmt: skip
    url = "http://127.0.0.1:" + wait_log(
        work / "server.log", r"Uvicorn running on http://127\.0\.0\.1:(\d+)", server
    )
    token = (work / "s" / "admin.token").read_text().strip()
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    return url, token, admin


def start_cluster(
    procs: Processes, work: Path, args: argparse.Namespace
) -> tuple[dict[str, tuple[str, int]], Path]:
    py = sys.executable
    url, token, admin = start_controller(procs, work)
    record = work / "record"
    record.mkdir()
    models = model_table("chat", record, "8G", 6000, 0.0)
    for n in range(args.runs):
        for kind in ("single", "burst"):
            models += model_table(f"cold-{kind}-{n}", record, "1G", 500, args.load_s)
    gateways: dict[str, tuple[str, int]] = {}
    for number, spec in ((2, "1x4G:sm_86"), (3, "1x24G:sm_86")):
        runtime, worker, address = work / f"host-{number}", f"box-{number}", f"127.0.0.{number}"
        procs.start(
            [py, "-m", "gpu_arbiter", "agent", "--controller", url, "--token", token, "--name",
             worker, "--simulate", spec, "--heartbeat-s", "0.5", "--grace-s", "0.5"],
            work / f"agent-{number}.log", runtime,
        )  # fmt: skip
        wait_until(lambda w=worker: _state(admin, w) == "online", f"{worker} online")
        head = f'[gateway]\nhost = "{address}"\nname = "gw-{number}"\n\n'
        (runtime / "models.toml").write_text(head + models)
        log = work / f"gateway-{number}.log"
        gateway = procs.start(
            [py, "-m", "gpu_arbiter", "gateway", "--config", str(runtime / "models.toml"),
             "--port", "0", "--controller", url, "--token", token, "--log-level", "warning",
             "--state-dir", str(runtime / "state")],
            log, runtime,
        )  # fmt: skip
        port = wait_log(log, rf"gateway on http://{re.escape(address)}:(\d+)", gateway)
        gateways[f"gw-{number}"] = (address, int(port))
    admin.close()
    wait_until(lambda: sees_each_other(gateways, "chat"), "each gateway to see the other")
    return gateways, record


def _state(admin: httpx.Client, worker: str) -> str | None:
    answer = admin.get(f"/v1/workers/{worker}")
    return str(answer.json()["state"]) if answer.status_code == 200 else None


async def warm(gateways: dict[str, tuple[str, int]]) -> None:
    """One request at gw-2: the cluster's load of ``chat`` on gw-3's host."""
    conn = await Conn.open(gateways["gw-2"], "chat")
    if await conn.call() != 200:
        raise SystemExit(f"chat did not load: {conn.body.decode(errors='replace')}")
    conn.close()
    print(f"chat warm, served by {conn.served_by}", file=sys.stderr)


async def hop(gateways: dict[str, tuple[str, int]], seconds: float) -> Run:
    """One run: with each number of callers, direct to gw-3, then via gw-2."""
    found: Run = {}
    for callers in CALLERS:
        direct = await measure(gateways["gw-3"], callers, seconds, "gw-3/chat")
        via = await measure(gateways["gw-2"], callers, seconds, "gw-3/chat")
        found[callers] = (direct, via)
    return found


def added(direct: Figures, via: Figures) -> Figures:
    """What the front door adds: p50 and p99 in ms, and the ratio of requests/s."""
    return via[0] - direct[0], via[1] - direct[1], via[2] / direct[2]


def report(found: dict[str, list[Run]]) -> None:
    """Per tree, the medians over its runs of each path's figures and of what the front
    door adds in each run; with two trees, the ratio of the added p50 and p99."""
    runs = len(next(iter(found.values())))
    print(f"{'tree':>8} {'callers':>7} {'path':>12} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}"
          f"   (medians of {runs} runs)")  # fmt: skip
    adds: dict[str, dict[int, Figures]] = {}
    for name, rows in found.items():
        adds[name] = {}
        for callers in CALLERS:
            pairs = [run[callers] for run in rows]
            d50, d99, drps = _medians([d for d, _ in pairs])
            v50, v99, vrps = _medians([v for _, v in pairs])
            a50, a99, ratio = adds[name][callers] = _medians([added(d, v) for d, v in pairs])
            print(f"{name:>8} {callers:>7} {'direct gw-3':>12} {d50:8.2f} {d99:8.2f} {drps:8.0f}")
            print(f"{name:>8} {callers:>7} {'via gw-2':>12} {v50:8.2f} {v99:8.2f} {vrps:8.0f}")
            print(f"{name:>8} {callers:>7} {'added':>12} {a50:8.2f} {a99:8.2f} {ratio:7.2f}x")
    for name, rows in found.items():
        each = ", ".join(f"{added(*run[1])[0]:.2f}" for run in rows)
        print(f"{name:>8} added p50 with one caller, run by run: {each} ms")
    names = list(found)
    if len(names) == 2:
        this, other = names
        for callers in CALLERS:
            (m50, m99, _), (t50, t99, _) = adds[this][callers], adds[other][callers]
            print(
                f"added, {callers} caller(s), {this} / {other}: p50 {m50:.2f} / {t50:.2f} ms"
                f" = {_ratio(m50, t50)}, p99 {m99:.2f} / {t99:.2f} ms = {_ratio(m99, t99)}"
            )
    a50 = adds[names[0]][1][0]
    verdict = "met" if a50 <= GOAL_ADDED_P50_MS else "NOT met"
    print(
        f"goal ({names[0]}): at most {GOAL_ADDED_P50_MS} ms added at p50 with one caller: "
        f"{a50:.2f} ms, {verdict}"
    )


def _ratio(mine: float, theirs: float) -> str:
    """``mine / theirs`` as a ratio, or why not (an added time may be 0 or less)."""
    return f"{mine / theirs:.2f}x" if theirs > 0 else "n/a (the other's is not above 0)"


async def cold(gateways: dict[str, tuple[str, int]], record: Path, args: Any) -> None:
    doors = [gateways["gw-2"], gateways["gw-3"]]
    singles, firsts, alls, ratios, started = [], [], [], [], []
    for n in range(args.runs):
        conn = await Conn.open(doors[0], f"cold-single-{n}")
        began = time.perf_counter()
        status = await conn.call()
        single = time.perf_counter() - began
        single_by = conn.served_by
        conn.close()
        assert status == 200, f"cold-single-{n}: {status}"
        model = f"cold-burst-{n}"
        conns = [await Conn.open(doors[i % 2], model) for i in range(args.burst)]
        began = time.perf_counter()
        done = await asyncio.gather(*(_timed(conn, began) for conn in conns))
        for conn in conns:
            conn.close()
        statuses = {status for status, _ in done}
        assert statuses == {200}, f"{model}: statuses {statuses}"
        served = {conn.served_by for conn in conns}
        assert len(served) == 1, f"{model}: served by {served}"
        first, last = min(t for _, t in done), max(t for _, t in done)
        count = records(record, model)
        print(
            f"run {n + 1}: single cold start {single * 1e3:.0f} ms ({single_by}); "
            f"{args.burst} callers: first answer {first * 1e3:.0f} ms, "
            f"all {last * 1e3:.0f} ms, {first / single:.2f}x, {count} server(s) started, "
            f"served by {served.pop()}"
        )
        singles.append(single)
        firsts.append(first)
        alls.append(last)
        ratios.append(first / single)
        started.append(count)
    ratio = statistics.median(ratios)
    print(
        f"cold (median of {args.runs}): single {statistics.median(singles) * 1e3:.0f} ms; "
        f"{args.burst} callers: first answer {statistics.median(firsts) * 1e3:.0f} ms, all "
        f"{statistics.median(alls) * 1e3:.0f} ms; ratio {ratio:.2f}x "
        f"(goal at most {GOAL_BURST_RATIO}x: {'met' if ratio <= GOAL_BURST_RATIO else 'NOT met'}); "
        f"servers started per burst: {started} "
        f"({'met' if set(started) == {1} else 'NOT met'}: must be 1)"
    )


async def _timed(conn: Conn, began: float) -> tuple[int, float]:
    status = await conn.call()
    return status, time.perf_counter() - began


def _medians(rows: list[Figures]) -> Figures:
    p50, p99, rps = (statistics.median(column) for column in zip(*rows, strict=True))
    return p50, p99, rps


if __name__ == "__main__":
    main()
