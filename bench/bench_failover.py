"""Failover time of controllers sharing one PostgreSQL database.

Two ``gpu-arbiter serve --store postgresql://...`` processes; a client that knows
both URLs. Each round stops the leader and measures, from that moment, how long
until the client's next lease request is granted by the other one:

- ``kill -9``: the standby waits for the dead leader's term to lapse
  (``--leader-ttl-s``, default 3 s) plus at most one poll (0.5 s);
- ``SIGTERM``: the leader ends its term as it stops; the standby takes over at its
  next poll.

The stopped controller is restarted before the next round (it comes back as a
standby). Prints the median and worst of each kind.

Run: ``python bench/bench_failover.py [--rounds 10] [--dsn postgresql://...]``; without
``--dsn`` a throwaway cluster is started with the test suite's helper (needs
Debian's ``postgresql``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
LISTENING = re.compile(rb"Uvicorn running on http://127\.0\.0\.1:(\d+)")


class Controller:
    def __init__(self, folder: Path, dsn: str, ttl_s: float) -> None:
        self.folder, self.dsn, self.ttl_s = folder, dsn, ttl_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = self.folder / "server.log"
        offset = log.stat().st_size if log.exists() else 0
        command = [sys.executable, "-m", "gpu_arbiter", "serve", "--port", "0", "--no-auth"]
        command += ["--state-dir", str(self.folder), "--store", self.dsn]
        command += ["--leader-ttl-s", str(self.ttl_s), "--simulate", "1x80G"]
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        with log.open("ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=out, env=env)
        deadline = time.monotonic() + 30
        while not (found := LISTENING.findall(log.read_bytes()[offset:])):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"controller did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(found[-1])}"

    def role(self) -> str | None:
        try:
            answer = httpx.get(self.url + "/v1/status", timeout=2)
        except httpx.HTTPError:
            return None
        return str(answer.json()["role"]) if answer.status_code == 200 else None

    def stop(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(timeout=30)


def _until(predicate: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.02)


def _granted_by_a_leader(urls: list[str]) -> bool:
    """One lease request, tried on each URL: True once a leader granted it (then released)."""
    for url in urls:
        with contextlib.suppress(httpx.HTTPError):
            answer = httpx.post(url + "/v1/leases", json={"vram_mb": 1}, timeout=2)
            if answer.status_code in (201, 202):
                httpx.delete(f"{url}/v1/leases/{answer.json()['id']}", timeout=2)
                return True
    return False


def failover_s(controllers: list[Controller], sig: int) -> float:
    leader = next(c for c in controllers if c.role() == "leader")
    others = [c for c in controllers if c is not leader]
    _until(lambda: all(c.role() == "standby" for c in others))
    started = time.monotonic()
    leader.stop(sig)
    urls = [c.url for c in others]
    while not _granted_by_a_leader(urls):
        time.sleep(0.01)
    took = time.monotonic() - started
    leader.start()  # back, as a standby
    return took


@contextlib.contextmanager
def database(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    sys.path.insert(0, str(ROOT))
    from tests.postgres import Cluster, _bin_dir, admin_sql, with_database

    bin_dir = _bin_dir()
    if bin_dir is None:
        raise SystemExit("PostgreSQL is not installed; pass --dsn postgresql://...")
    cluster = Cluster(bin_dir)
    try:
        base = cluster.start()
        name = f"bench_{uuid.uuid4().hex[:8]}"
        admin_sql(base, f'CREATE DATABASE "{name}"')
        yield with_database(base, name)
    finally:
        cluster.stop()


def report(kind: str, times: list[float]) -> None:
    print(
        f"{kind:<8} rounds {len(times):>3}  median {statistics.median(times):6.2f} s  "
        f"worst {max(times):6.2f} s  best {min(times):6.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--leader-ttl-s", type=float, default=3.0)
    parser.add_argument("--dsn", help="a PostgreSQL database to use (default: a throwaway one)")
    args = parser.parse_args()
    with database(args.dsn) as dsn, tempfile.TemporaryDirectory() as folder:
        controllers = [
            Controller(Path(folder) / name, dsn, args.leader_ttl_s) for name in ("a", "b")
        ]
        try:
            for controller in controllers:
                controller.start()
            _until(lambda: sorted(str(c.role()) for c in controllers) == ["leader", "standby"])
            print(f"two controllers, leader term {args.leader_ttl_s:g} s, poll 0.5 s")
            killed = [failover_s(controllers, signal.SIGKILL) for _ in range(args.rounds)]
            report("kill -9", killed)
            stopped = [failover_s(controllers, signal.SIGTERM) for _ in range(args.rounds)]
            report("SIGTERM", stopped)
        finally:
            for controller in controllers:
                if controller.proc is not None and controller.proc.poll() is None:
                    controller.stop(signal.SIGTERM)


if __name__ == "__main__":
    main()
