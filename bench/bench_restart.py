"""How long a controller takes to come back with many leases in its store.

A real ``gpu-arbiter serve --simulate`` process on a SQLite state directory; ``N``
leases are asked for through the HTTP API (granted at once, with a TTL of an hour);
then, round after round, the process is killed with ``kill -9`` and started again,
and the time from the start of the process to its first ``200`` from ``/readyz`` (it
accepts changes: the store loaded, every lease restored to the core, each one's TTL
re-armed from the restart) is measured. The same for an empty store in the same run,
so that the figure that matters is the ratio: what the leases cost beyond a start.

``--baseline SRC`` also starts the ``src`` directory of other code (``git worktree add
/tmp/base COMMIT``, then ``--baseline /tmp/base/src``), each restart right after ours (a
load on the machine weighs on both alike), and prints ours against it; each code restarts
on a state directory it filled itself, the same way (older code may not read a newer
document format).

Run: ``python bench/bench_restart.py [--leases 10000] [--rounds 5] [--baseline SRC]``.
Prints the median, best and worst of each, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
LISTENING = re.compile(rb"Uvicorn running on http://127\.0\.0\.1:(\d+)")
SIMULATED = "8x80G:sm_90"


class Controller:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.log = state_dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, src: Path = SRC) -> float:
        """Starts the process of the code in ``src``; seconds until it accepts changes."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(src)}
        env.pop("GPU_ARBITER_CONFIG", None)
        command = [sys.executable, "-m", "gpu_arbiter", "serve", "--port", "0"]
        command += ["--state-dir", str(self.state_dir), "--simulate", SIMULATED]
        offset = self.log.stat().st_size if self.log.exists() else 0
        started = time.perf_counter()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=log, env=env)
        while not (found := LISTENING.findall(self.log.read_bytes()[offset:])):
            if self.proc.poll() is not None:
                raise SystemExit(f"the controller exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.005)
        self.url = f"http://127.0.0.1:{found[-1].decode()}"
        while not self._ready():
            time.sleep(0.005)
        return time.perf_counter() - started

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def token(self) -> str:
        return (self.state_dir / "admin.token").read_text().strip()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


async def fill(url: str, token: str, count: int, clients: int = 32) -> None:
    """``count`` leases of 8 MiB, an hour's TTL, asked for by ``clients`` at once, each
    marked ready once granted (a load in progress holds its GPU's load gate)."""
    headers = {"Authorization": f"Bearer {token}"}
    left = iter(range(count))
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:

        async def one_client() -> None:
            for number in left:
                body = {"holder": f"bench {number}", "vram_mb": 8, "ttl_s": 3600}
                lease = (await client.post("/v1/leases", json=body)).json()
                while lease.get("state") == "pending":  # behind another's load (the gate)
                    params = {"wait": 30, "state": "pending"}
                    lease = (await client.get(f"/v1/leases/{lease['id']}", params=params)).json()
                if lease.get("state") != "loading":
                    raise SystemExit(f"lease {number}: {lease}")
                (await client.post(f"/v1/leases/{lease['id']}/ready")).raise_for_status()

        await asyncio.gather(*(one_client() for _ in range(clients)))


def rounds(state_dir: Path, leases: int, count: int, sources: list[Path]) -> list[list[float]]:
    """``count`` restarts of each code of ``sources``, in turn, each on a state directory
    of ``leases`` that code wrote itself (older code may not read a newer format); one
    controller runs at a time. Each one's times, in the order of ``sources``."""
    controllers = [Controller(state_dir / f"code-{i}") for i in range(len(sources))]
    for controller, src in zip(controllers, sources, strict=True):
        controller.start(src)
        if leases:
            asyncio.run(fill(controller.url, controller.token(), leases))
        controller.kill9()
    times: list[list[float]] = [[] for _ in sources]
    for _ in range(count):
        for src, controller, taken in zip(sources, controllers, times, strict=True):
            taken.append(controller.start(src))
            check_restored(controller, leases, src)
            controller.kill9()
    return times


def check_restored(controller: Controller, leases: int, src: Path) -> None:
    restored = httpx.get(
        controller.url + "/v1/status", headers={"Authorization": f"Bearer {controller.token()}"}
    ).json()
    held = restored.get("leases_by_state", {})
    if sum(held.values()) != leases:
        raise SystemExit(f"a restart of {src} holds {held}, not {leases} leases")


def line(name: str, times: list[float]) -> str:
    return (
        f"{name:>14}: median {statistics.median(times) * 1000:7.0f} ms, best "
        f"{min(times) * 1000:6.0f}, worst {max(times) * 1000:6.0f} ({len(times)} restarts)"
    )


def report(leases: int, empty: list[float], full: list[float]) -> None:
    print(line("empty store", empty))
    print(line(f"{leases} leases", full))
    ratio = statistics.median(full) / statistics.median(empty)
    print(f"{'ratio':>14}: {ratio:.2f}x the empty store's start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--baseline",
        metavar="SRC",
        type=Path,
        default=None,
        help="also restart this src directory (other code) and print the ratios",
    )
    args = parser.parse_args()
    if args.baseline is not None and not (args.baseline / "gpu_arbiter").is_dir():
        parser.error(f"--baseline: {args.baseline} holds no gpu_arbiter package")
    sources = [SRC] if args.baseline is None else [SRC, args.baseline]
    with tempfile.TemporaryDirectory() as scratch:
        empty = rounds(Path(scratch) / "empty", 0, args.rounds, sources)
        full = rounds(Path(scratch) / "full", args.leases, args.rounds, sources)
    report(args.leases, empty[0], full[0])
    if args.baseline is not None:
        print(f"\nagainst {args.baseline} (base), same run")
        report(args.leases, empty[1], full[1])
        print(
            f"{'ours/base':>14}: empty store "
            f"{statistics.median(empty[0]) / statistics.median(empty[1]):.2f}x, "
            f"{args.leases} leases {statistics.median(full[0]) / statistics.median(full[1]):.2f}x"
        )


if __name__ == "__main__":
    main()
