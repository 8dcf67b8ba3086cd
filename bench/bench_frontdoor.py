"""The cluster front door's extra hop and its cold burst:
``python bench/bench_frontdoor.py [--against [REV] | --tls] [--seconds 3] [--runs 3]
[--burst 200] [--load-s 0.2]``.

A controller (memory store) and two hosts on this machine, each an agent with its own
worker name, simulated GPU and runtime directory and a gateway on its own loopback
address: box-2 (``1x4G:sm_86``) with gw-2 on 127.0.0.2, box-3 (``1x24G:sm_86``) with
gw-3 on 127.0.0.3. Both gateways declare model ``chat`` (tests/integration/model_server.py,
``vram = "8G"``: it fits only box-3), warmed by one request at gw-2.

1. **The extra hop.** With 1 and 16 concurrent callers (each one keep-alive HTTP/1.1
   connection sending ``POST /v1/completions`` one after the other), in turn within
   each run: (a) direct to gw-3, the gateway beside the replica; (b) via gw-2, the
   front door that forwards to gw-3. Every answer of (b) must carry ``x-served-by:
   gw-3/chat``. Prints the medians over ``--runs`` of p50, p90, p99 and requests/s of each,
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

With ``--tls`` the extra hop is measured with every part over TLS against the same
without, in one run: two clusters of this tree run side by side, one plain, one whose
controller listens over mutual TLS (``--tls-cert``, ``--tls-key``, ``--tls-client-ca``;
its agents and gateways show their host's certificate: ``GPU_ARBITER_CA``,
``GPU_ARBITER_CLIENT_CERT``, ``GPU_ARBITER_CLIENT_KEY``) and whose gateways listen over
HTTPS (``tls_cert``, ``tls_key``, ``tls_client_ca`` in ``[gateway]``) and relay to each
other over mutual TLS; the CA and certificates are made as ``gpu-arbiter tls`` makes
them. The callers talk HTTPS to both gateways, verifying the cluster's CA, with no
certificate of their own (an SDK's way). Each of the ``--runs`` rounds interleaves one
caller's requests to both paths of both clusters (every path after every path alike:
:func:`balanced`), then measures each cluster in turn with 16 callers (TLS first in even
rounds, plain first in odd ones), both paths. During each turn via gw-2, the
connections open to gw-3 (``ss``) are looked at a quarter into the turn and at its end:
every one of the first must still be open at the end (the front door's kept-alive
connections reused, not one per request), else the bench stops. Prints both clusters'
medians as above, then TLS's cost per hop: in each round, what the front door adds
with TLS less what it adds without (p50, p90, p99), the medians of those, the ratio of
the added p50s, and the goal: at most +0.3 ms at p50 with one caller. No cold burst.

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
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from gpu_arbiter.certs import create_ca, create_cert
from gpu_arbiter.tls import CA_ENV, CLIENT_CERT_ENV, CLIENT_KEY_ENV

ROOT = Path(__file__).resolve().parents[1]
MODEL_SERVER = ROOT / "tests" / "integration" / "model_server.py"
CALLERS = (1, 16)
GOAL_ADDED_P50_MS = 0.5
GOAL_BURST_RATIO = 1.2
GOAL_TLS_P50_MS = 0.3
TLS_ENV = (CA_ENV, CLIENT_CERT_ENV, CLIENT_KEY_ENV)
BEFORE = "94a2739"  # the last commit before the gateway's packages and request path

Figures = tuple[float, float, float, float]  # p50 ms, p90 ms, p99 ms, requests/s
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
    async def open(
        cls, address: tuple[str, int], model: str, tls: ssl.SSLContext | None = None
    ) -> Conn:
        """A connection to ``address``; over TLS with ``tls`` (the gateway's certificate
        verified for its address)."""
        return cls(*await asyncio.open_connection(*address, ssl=tls), model)

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
    address: tuple[str, int],
    callers: int,
    seconds: float,
    served_by: str,
    tls: ssl.SSLContext | None = None,
    kept: Kept | None = None,
) -> Figures:
    """(p50 ms, p90 ms, p99 ms, requests/s) of ``callers`` connections to ``address``
    (over TLS with ``tls``) for ``seconds``; every answer a 200 served by ``served_by``.
    With ``kept``, the connections it looks at are looked at a quarter into the time (those
    the pool found idle too long are new by then) and at its end."""
    conns = [await Conn.open(address, "chat", tls) for _ in range(callers)]
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

    async def look() -> None:
        if kept is not None:
            await asyncio.sleep(seconds / 4)
            kept.first = await asyncio.to_thread(kept.open_now)

    began = time.perf_counter()
    try:
        await asyncio.gather(look(), *(loop(conn) for conn in conns))
        elapsed = time.perf_counter() - began
        if kept is not None:
            kept.last = await asyncio.to_thread(kept.open_now)
    finally:
        for conn in conns:
            conn.close()
    return figures(latencies, elapsed)


def figures(latencies: list[float], elapsed: float) -> Figures:
    """p50, p90 and p99 in ms of ``latencies`` (s), and their count per ``elapsed`` s."""
    latencies = sorted(latencies)
    p90, p99 = (latencies[min(len(latencies) - 1, int(len(latencies) * q))] for q in (0.9, 0.99))
    return statistics.median(latencies) * 1e3, p90 * 1e3, p99 * 1e3, len(latencies) / elapsed


async def interleaved(
    clusters: dict[str, dict[str, tuple[str, int]]],
    contexts: dict[str, ssl.SSLContext | None],
    seconds: float,
    kept: dict[str, Kept],
    cpu: dict[str, list[float]],
) -> dict[str, tuple[Figures, Figures]]:
    """One caller's hop in each cluster, its requests interleaved for ``seconds``: one
    keep-alive connection per cluster and path (direct to gw-3, via gw-2), a request on
    each in turn, in the order of :func:`balanced`, so that whatever else runs on this
    machine meanwhile falls on all of them alike, and so does the request before each: a
    request after one to the same processes finds them awake and their caches warm, one
    after the other cluster's finds them cold (on the 2-core VM a path's p50 moves by up
    to a millisecond with the path before it). Per cluster: (direct, via), their
    requests/s as one caller's (1 / the mean latency). ``kept``: per cluster, gw-3's
    connections looked at a quarter in and at the end. Appended to ``cpu``, per cluster:
    the front door's (gw-2's) CPU time per request relayed, in µs (its threads' time
    on a CPU, ``/proc/PID/task/*/schedstat``: what other processes take does not count,
    unlike in a latency)."""
    doors = {name: listener_pid(gateways["gw-2"]) for name, gateways in clusters.items()}
    paths = [(name, path) for name in clusters for path in ("gw-3", "gw-2")]
    order = [paths[n] for n in balanced(len(paths))]
    conns = {
        (name, path): await Conn.open(clusters[name][path], "chat", contexts[name])
        for name, path in paths
    }
    latencies: dict[tuple[str, str], list[float]] = {key: [] for key in paths}
    try:
        for conn in conns.values():  # warm each connection
            assert await conn.call() == 200
        began = time.perf_counter()
        quarter, end = began + seconds / 4, began + seconds
        used = {name: cpu_ns(pid) for name, pid in doors.items()}
        while (now := time.perf_counter()) < end:
            if quarter and now >= quarter:
                for looked in kept.values():
                    looked.first = looked.open_now()
                quarter = 0.0
            for key in order:
                conn = conns[key]
                start = time.perf_counter()
                status = await conn.call()
                latencies[key].append(time.perf_counter() - start)
                if status != 200 or conn.served_by != "gw-3/chat":
                    raise SystemExit(f"{key}: {status}, served by {conn.served_by!r}")
        for name, pid in doors.items():
            relayed = len(latencies[(name, "gw-2")])
            cpu.setdefault(name, []).append((cpu_ns(pid) - used[name]) / relayed / 1e3)
        for looked in kept.values():
            looked.last = looked.open_now()
    finally:
        for conn in conns.values():
            conn.close()
    one: dict[tuple[str, str], Figures] = {
        key: figures(each, sum(each)) for key, each in latencies.items()
    }
    return {name: (one[(name, "gw-3")], one[(name, "gw-2")]) for name in clusters}


def balanced(n: int) -> list[int]:
    """``0 .. n-1`` in an order, taken as a cycle, in which each one follows each one
    (itself included) exactly once: ``n * n`` steps, ``0 0 1 0 2 .. 1 1 2 ..`` (a de
    Bruijn sequence of order 2: each one, then it with each larger one). A round robin
    reversed every other turn does not: each follows only its neighbours in the round, and
    only the first and the last follow themselves."""
    order = []
    for first in range(n):
        order.append(first)
        for then in range(first + 1, n):
            order += [first, then]
    return order


class Kept:
    """The connections open to a gateway (``ss``: those whose far end is its address and
    port, this machine's every process; while the bench calls only the front door, the
    front door's), looked at twice: which of the first look's lasted to the second (a
    connection per request, or one closed after each few, would not)."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.first: set[str] = set()
        self.last: set[str] = set()

    def open_now(self) -> set[str]:
        done = subprocess.run(
            ["ss", "-tnH", "state", "established", "dst", f"{self.address[0]}:{self.address[1]}"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return {line.split()[2] for line in done.stdout.splitlines() if line.strip()}

    def __str__(self) -> str:
        lasted = len(self.first & self.last)
        return (
            f"{len(self.first)} open a quarter in, {len(self.last)} at the end, "
            f"{lasted} of the first throughout"
        )

    @property
    def all_lasted(self) -> bool:
        return bool(self.first) and self.first <= self.last


def listener_pid(address: tuple[str, int]) -> int:
    """The process that listens on ``address`` (``ss``)."""
    done = subprocess.run(
        ["ss", "-tlnpH", "src", f"{address[0]}:{address[1]}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = re.search(r"pid=(\d+)", done.stdout)
    if found is None:
        raise SystemExit(f"no process listens on {address}")
    return int(found.group(1))


def cpu_ns(pid: int) -> int:
    """The nanoseconds process ``pid``'s threads have run on a CPU."""
    return sum(
        int(stat.read_text().split()[0]) for stat in Path(f"/proc/{pid}/task").glob("*/schedstat")
    )


class Processes:
    """Every process of one cluster, each run from the tree at ``src``; stopped last
    first."""

    def __init__(self, work: Path, src: Path) -> None:
        self.work, self.src = work, src
        self.started: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        command: list[str],
        log: Path,
        runtime: Path | None = None,
        tls: dict[str, str] | None = None,
    ) -> Any:
        """Starts ``command``; ``tls``: the ``GPU_ARBITER_CA`` and client certificate
        variables its client of the controller uses."""
        env = {**os.environ, "PYTHONPATH": str(self.src)}
        for name in ("GPU_ARBITER_URL", "GPU_ARBITER_TOKEN", "GPU_ARBITER_CONFIG", *TLS_ENV):
            env.pop(name, None)
        env.update(tls or {})
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


def sees_each_other(
    gateways: dict[str, tuple[str, int]], model: str, tls: ssl.SSLContext | None = None
) -> bool:
    scheme = "http" if tls is None else "https"
    for address in gateways.values():
        url = f"{scheme}://{address[0]}:{address[1]}/v1/models"
        try:
            entries = httpx.get(url, verify=tls or True).json()["data"]
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
    parser.add_argument(
        "--tls",
        action="store_true",
        help="the hop with every part over TLS against without, rounds in turn (no cold burst)",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-arbiter-bench-frontdoor-"))
    if args.tls:
        if args.against is not None:
            parser.error("--tls and --against: one at a time")
        report_tls(*tls_against_plain(work, args))
    elif args.against is None:
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
    work: Path, src: Path, args: argparse.Namespace, pki: Path | None = None
) -> Iterator[tuple[dict[str, tuple[str, int]], Path]]:
    """The controller and both hosts of the tree at ``src`` (every part over TLS with
    ``pki``: :func:`make_pki`), stopped on the way out."""
    work.mkdir(parents=True, exist_ok=True)
    procs = Processes(work, src)
    try:
        yield start_cluster(procs, work, args, pki)
    finally:
        procs.stop()


def make_pki(pki: Path) -> Path:
    """The cluster's CA and certificates, as ``gpu-arbiter tls ca`` and ``tls cert`` make
    them: the controller's (ctl, 127.0.0.1), each gateway's (gw-2, gw-3, on its own
    address: also its host's client certificate) and the bench's (a client's)."""
    create_ca(pki)
    create_cert(pki, "ctl", ips=("127.0.0.1",))
    for number in (2, 3):
        create_cert(pki, f"gw-{number}", ips=(f"127.0.0.{number}",))
    create_cert(pki, "bench", dns=("bench",))
    return pki


def client_env(pki: Path, name: str) -> dict[str, str]:
    """The variables a part of host ``name`` reaches the controller with over mutual TLS."""
    files = ("ca.pem", f"{name}.pem", f"{name}-key.pem")
    return {variable: str(pki / file) for variable, file in zip(TLS_ENV, files, strict=True)}


def trusting(pki: Path, name: str | None = None) -> ssl.SSLContext:
    """A client's context that verifies against the cluster's CA; with ``name``, showing
    its certificate."""
    context = ssl.create_default_context(cafile=pki / "ca.pem")
    if name is not None:
        context.load_cert_chain(pki / f"{name}.pem", pki / f"{name}-key.pem")
    return context


def start_controller(
    procs: Processes, work: Path, pki: Path | None = None
) -> tuple[str, str, httpx.Client]:
    """A controller on a memory store (over mutual TLS with ``pki``): its URL, its admin
    token, an admin client."""
    command = [sys.executable, "-m", "gpu_arbiter", "serve", "--port", "0", "--state-dir",
               str(work / "s"), "--store", "memory"]  # fmt: skip
    scheme, verify = "http", None
    if pki is not None:
        command += ["--tls-cert", str(pki / "ctl.pem"), "--tls-key", str(pki / "ctl-key.pem"),
                    "--tls-client-ca", str(pki / "ca.pem")]  # fmt: skip
        scheme, verify = "https", trusting(pki, "bench")
    server = procs.start(command, work / "server.log")
    url = f"{scheme}://127.0.0.1:" + wait_log(
        work / "server.log", rf"Uvicorn running on {scheme}://127\.0\.0\.1:(\d+)", server
    )
    token = (work / "s" / "admin.token").read_text().strip()
    admin = httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30,
        verify=verify or True,
    )  # fmt: skip
    return url, token, admin


def start_cluster(
    procs: Processes, work: Path, args: argparse.Namespace, pki: Path | None = None
) -> tuple[dict[str, tuple[str, int]], Path]:
    py = sys.executable
    url, token, admin = start_controller(procs, work, pki)
    record = work / "record"
    record.mkdir()
    models = model_table("chat", record, "8G", 6000, 0.0)
    for n in range(args.runs):
        for kind in ("single", "burst"):
            models += model_table(f"cold-{kind}-{n}", record, "1G", 500, args.load_s)
    gateways: dict[str, tuple[str, int]] = {}
    scheme = "http" if pki is None else "https"
    for number, spec in ((2, "1x4G:sm_86"), (3, "1x24G:sm_86")):
        runtime, worker, address = work / f"host-{number}", f"box-{number}", f"127.0.0.{number}"
        name = f"gw-{number}"
        tls = None if pki is None else client_env(pki, name)  # the host's certificate
        procs.start(
            [py, "-m", "gpu_arbiter", "agent", "--controller", url, "--token", token, "--name",
             worker, "--simulate", spec, "--heartbeat-s", "0.5", "--grace-s", "0.5"],
            work / f"agent-{number}.log", runtime, tls,
        )  # fmt: skip
        wait_until(lambda w=worker: _state(admin, w) == "online", f"{worker} online")
        head = f'[gateway]\nhost = "{address}"\nname = "{name}"\n'
        if pki is not None:  # its listener, and its relays to the other (mutual TLS)
            head += (
                f'tls_cert = "{pki / f"{name}.pem"}"\ntls_key = "{pki / f"{name}-key.pem"}"\n'
                f'tls_client_ca = "{pki / "ca.pem"}"\n'
            )
        (runtime / "models.toml").write_text(head + "\n" + models)
        log = work / f"gateway-{number}.log"
        gateway = procs.start(
            [py, "-m", "gpu_arbiter", "gateway", "--config", str(runtime / "models.toml"),
             "--port", "0", "--controller", url, "--token", token, "--log-level", "warning",
             "--state-dir", str(runtime / "state")],
            log, runtime, tls,
        )  # fmt: skip
        port = wait_log(log, rf"gateway on {scheme}://{re.escape(address)}:(\d+)", gateway)
        gateways[name] = (address, int(port))
    admin.close()
    verify = None if pki is None else trusting(pki)
    wait_until(lambda: sees_each_other(gateways, "chat", verify), "each gateway to see the other")
    return gateways, record


def _state(admin: httpx.Client, worker: str) -> str | None:
    answer = admin.get(f"/v1/workers/{worker}")
    return str(answer.json()["state"]) if answer.status_code == 200 else None


async def warm(gateways: dict[str, tuple[str, int]], tls: ssl.SSLContext | None = None) -> None:
    """One request at gw-2: the cluster's load of ``chat`` on gw-3's host."""
    conn = await Conn.open(gateways["gw-2"], "chat", tls)
    if await conn.call() != 200:
        raise SystemExit(f"chat did not load: {conn.body.decode(errors='replace')}")
    conn.close()
    print(f"chat warm, served by {conn.served_by}", file=sys.stderr)


async def hop(
    gateways: dict[str, tuple[str, int]],
    seconds: float,
    tls: ssl.SSLContext | None = None,
    kept: dict[int, Kept] | None = None,
    numbers: tuple[int, ...] = CALLERS,
) -> Run:
    """One run: with each number of callers (of ``numbers``), direct to gw-3, then via
    gw-2 (over TLS with ``tls``); with ``kept``, the front door's connections to gw-3
    during each via (by the number of callers)."""
    found: Run = {}
    for callers in numbers:
        direct = await measure(gateways["gw-3"], callers, seconds, "gw-3/chat", tls)
        looked = None
        if kept is not None:
            looked = kept[callers] = Kept(gateways["gw-3"])
        via = await measure(gateways["gw-2"], callers, seconds, "gw-3/chat", tls, looked)
        found[callers] = (direct, via)
    return found


def added(direct: Figures, via: Figures) -> Figures:
    """What the front door adds: p50, p90 and p99 in ms, and the ratio of requests/s."""
    return via[0] - direct[0], via[1] - direct[1], via[2] - direct[2], via[3] / direct[3]


def report(found: dict[str, list[Run]], label: str = "tree") -> dict[str, dict[int, Figures]]:
    """Per tree (``label``: what each of ``found`` is), the medians over its runs of each
    path's figures and of what the front door adds in each run; with two trees, the
    ratio of the added p50 and p99. Returns those medians of what it adds."""
    runs = len(next(iter(found.values())))
    print(f"{label:>8} {'callers':>7} {'path':>12} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}"
          f" {'req/s':>8}   (medians of {runs} runs)")  # fmt: skip
    adds: dict[str, dict[int, Figures]] = {}
    for name, rows in found.items():
        adds[name] = {}
        for callers in CALLERS:
            pairs = [run[callers] for run in rows]
            d50, d90, d99, drps = _medians([d for d, _ in pairs])
            v50, v90, v99, vrps = _medians([v for _, v in pairs])
            a50, a90, a99, ratio = adds[name][callers] = _medians([added(*p) for p in pairs])
            print(f"{name:>8} {callers:>7} {'direct gw-3':>12} {d50:8.2f} {d90:8.2f} {d99:8.2f}"
                  f" {drps:8.0f}")  # fmt: skip
            print(f"{name:>8} {callers:>7} {'via gw-2':>12} {v50:8.2f} {v90:8.2f} {v99:8.2f}"
                  f" {vrps:8.0f}")  # fmt: skip
            print(f"{name:>8} {callers:>7} {'added':>12} {a50:8.2f} {a90:8.2f} {a99:8.2f}"
                  f" {ratio:7.2f}x")  # fmt: skip
    for name, rows in found.items():
        each = ", ".join(f"{added(*run[1])[0]:.2f}" for run in rows)
        print(f"{name:>8} added p50 with one caller, run by run: {each} ms")
    names = list(found)
    if len(names) == 2:
        this, other = names
        for callers in CALLERS:
            (m50, _, m99, _), (t50, _, t99, _) = adds[this][callers], adds[other][callers]
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
    return adds


def tls_against_plain(
    work: Path, args: argparse.Namespace
) -> tuple[dict[str, list[Run]], dict[str, list[float]]]:
    """The hop in a cluster all over TLS and in one all plain, both running, ``--runs``
    rounds: in each, one caller's requests to both interleaved (:func:`interleaved`),
    then 16 callers' turns at each (TLS first in even rounds, plain first in odd ones);
    the front door's connections to gw-3 checked kept throughout each. Returns the
    runs, and each cluster's front door CPU µs per request relayed, round by round."""
    pki = make_pki(work / "pki")
    caller = trusting(pki)  # an SDK's: the cluster's CA, no certificate of its own
    found: dict[str, list[Run]] = {"tls": [], "plain": []}
    cpu: dict[str, list[float]] = {}
    contexts = {"tls": caller, "plain": None}
    with (
        cluster(work / "tls", ROOT / "src", args, pki) as (secure, _),
        cluster(work / "plain", ROOT / "src", args) as (plain, _),
    ):
        clusters = {"tls": secure, "plain": plain}
        for name, gateways in clusters.items():
            asyncio.run(warm(gateways, contexts[name]))
        for n in range(args.runs):
            kept = {name: Kept(gateways["gw-3"]) for name, gateways in clusters.items()}
            one = asyncio.run(interleaved(clusters, contexts, args.seconds, kept, cpu))
            for name, looked in kept.items():
                _check_kept(f"round {n + 1} {name}, 1 caller (interleaved)", looked)
            order = list(clusters) if n % 2 == 0 else list(clusters)[::-1]
            for name in order:
                several: dict[int, Kept] = {}
                run = asyncio.run(
                    hop(clusters[name], args.seconds, contexts[name], several, CALLERS[1:])
                )
                for callers, looked in several.items():
                    _check_kept(f"round {n + 1} {name}, {callers} callers", looked)
                found[name].append({1: one[name], **run})
            print(f"round {n + 1}/{args.runs} done", file=sys.stderr)
    return found, cpu


def _check_kept(turn: str, looked: Kept) -> None:
    print(f"{turn}: the connections open to gw-3: {looked}", file=sys.stderr)
    if not looked.all_lasted:
        raise SystemExit(f"{turn}: the connections to gw-3 were not kept")


def report_tls(found: dict[str, list[Run]], cpu: dict[str, list[float]]) -> None:
    """:func:`report` of both, then what TLS adds to the hop: round by round, the TLS
    cluster's added time less the plain one's (p50, p90, p99), their medians, and the
    goal at p50 with one caller; the front door's CPU per request relayed, with one
    caller."""
    adds = report(found, "cluster")
    tls_us, plain_us = (statistics.median(cpu[name]) for name in ("tls", "plain"))
    each = ", ".join(f"{t - p:+.0f}" for t, p in zip(cpu["tls"], cpu["plain"], strict=True))
    print(
        f"the front door's CPU per request relayed, 1 caller (median of the rounds): tls "
        f"{tls_us:.0f} µs, plain {plain_us:.0f} µs, {tls_us - plain_us:+.0f} µs; round by "
        f"round: {each} µs"
    )
    for callers in CALLERS:
        cost = [
            tuple(
                t - p
                for t, p in zip(added(*tls[callers])[:3], added(*plain[callers])[:3], strict=True)
            )
            for tls, plain in zip(found["tls"], found["plain"], strict=True)
        ]
        c50, c90, c99 = (statistics.median(column) for column in zip(*cost, strict=True))
        each = ", ".join(f"{c[0]:.2f}" for c in cost)
        (t50, _, _, _), (p50, _, _, _) = adds["tls"][callers], adds["plain"][callers]
        print(
            f"TLS's cost per hop, {callers} caller(s) (added with TLS less added without, "
            f"median of the rounds): p50 {c50:+.2f} ms, p90 {c90:+.2f} ms, p99 {c99:+.2f} ms; "
            f"added p50 tls / plain {_ratio(t50, p50)}; p50 round by round: {each} ms"
        )
        if callers == 1:
            verdict = "met" if c50 <= GOAL_TLS_P50_MS else "NOT met"
            tls_cost = f"{c50:+.2f} ms, {verdict}"
    print(
        f"goal: TLS adds at most +{GOAL_TLS_P50_MS} ms at p50 per hop with one caller: {tls_cost}"
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
    p50, p90, p99, rps = (statistics.median(column) for column in zip(*rows, strict=True))
    return p50, p90, p99, rps


if __name__ == "__main__":
    main()
