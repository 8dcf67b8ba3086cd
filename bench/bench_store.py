"""Commit latency of the SQLite store: what one change waits for at the store.

``N`` commits, one after another, each a batch like a lease's change (one lease record
upserted, among a few hundred live ones, and one event), through ``SqliteStore.commit``
in a fresh state directory; prints the median, p99, p99.9 and the longest commit, and
how many took over 1 ms and over 10 ms. The tail is what a group of changes waits for
together: one slow commit holds every change grouped into it. ``--baseline SRC`` runs
the same in a process of other code (``git worktree add /tmp/base COMMIT``, then
``--baseline /tmp/base/src``) right after ours, round after round.

Run: ``python bench/bench_store.py [--commits 20000] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def run_commits(commits: int, sync: str) -> dict[str, float]:
    """In this process: ``commits`` commits to a new store; their latencies."""
    from gpu_arbiter.core import GpuId, Lease, LeaseState, Request
    from gpu_arbiter.store import Batch, Event, LeaseRecord, SqliteStore

    store = SqliteStore(Path(tempfile.mkdtemp()) / "state.db", synchronous=sync)  # type: ignore[arg-type]
    took: list[float] = []
    try:
        for k in range(commits):
            request = Request.build(f"lease-{k % 500}", vram_mb=1024, ttl_s=60.0)
            lease = Lease(
                request, (GpuId("w", k % 8),), k + 1, LeaseState.LOADING, 0.0, 60.0, 300.0
            )
            record = LeaseRecord(request, lease.state, "admin", lease)
            batch = Batch(leases={request.id: record}, events=[Event(k + 1, 0.0, "lease.granted")])
            start = time.perf_counter()
            store.commit(batch)
            took.append(time.perf_counter() - start)
    finally:
        store.close()
    took.sort()
    return {
        "median_ms": statistics.median(took) * 1e3,
        "p99_ms": took[int(0.99 * len(took))] * 1e3,
        "p999_ms": took[int(0.999 * len(took))] * 1e3,
        "max_ms": took[-1] * 1e3,
        "over_1ms": sum(t > 0.001 for t in took),
        "over_10ms": sum(t > 0.010 for t in took),
    }


def in_process(src: Path, commits: int, sync: str) -> dict[str, float]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import bench_store; "
        "print(json.dumps(bench_store.run_commits(int(sys.argv[2]), sys.argv[3])))"
    )
    env = {**os.environ, "PYTHONPATH": str(src)}
    here = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", code, here, str(commits), sync],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, float] = json.loads(out.stdout)
    return result


def line(name: str, r: dict[str, float]) -> str:
    return (
        f"{name:>6} {r['median_ms']:>9.3f} {r['p99_ms']:>8.3f} {r['p999_ms']:>8.2f} "
        f"{r['max_ms']:>8.1f} {int(r['over_1ms']):>7} {int(r['over_10ms']):>8}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sync", choices=["NORMAL", "FULL"], default="NORMAL")
    parser.add_argument("--baseline", metavar="SRC", type=Path, default=None)
    args = parser.parse_args()
    if args.commits < 1000 or args.rounds < 1:
        parser.error("--commits: at least 1000; --rounds: at least 1")
    print(f"{args.commits} commits to SqliteStore (synchronous={args.sync}), one at a time")
    print(
        f"{'code':>6} {'median ms':>9} {'p99 ms':>8} {'p99.9 ms':>8} {'max ms':>8} "
        f"{'>1 ms':>7} {'>10 ms':>8}"
    )
    sides = {"ours": SRC, **({"base": args.baseline} if args.baseline else {})}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, src in sides.items():
            r = in_process(src, args.commits, args.sync)
            results[name].append(r)
            print(line(name, r))
    if args.baseline is not None:
        for key in ("median_ms", "p99_ms", "p999_ms", "max_ms"):
            ours = statistics.median(r[key] for r in results["ours"])
            base = statistics.median(r[key] for r in results["base"])
            print(
                f"  {key}: ours {ours:.3f} against base {base:.3f} ({ours / base:.2f}x), "
                "medians of the rounds"
            )


if __name__ == "__main__":
    main()
