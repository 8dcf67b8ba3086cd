"""The cycle and a 202's reason at scale, this tree against another commit, in one run.

A cluster of 1,000 GPUs (125 workers of 8 x 80 GiB), each GPU holding one lease of
76 GiB (4 GiB free), and 10,000 pending requests that fit nowhere (8, 16 and 24 GiB,
``normal`` and ``batch``: six classes). Per sample, timed on each tree:

- ``cycle``: a request that stays pending is submitted, then one cycle
  (``Scheduler.decide``) runs: what every event that frees nothing costs;
- ``grant``: one lease is released (another GPU each sample), and the cycle that grants
  requests from the head of the queue into its 80 GiB runs (they keep it);
- ``reason``: why the request just submitted, behind the 10,000, waits
  (``Scheduler.explain``: what a 202 and every ``GET /v1/queue`` row answer with).

Each tree runs in a process of its own (``PYTHONPATH=<tree>/src``), the two alternating
round by round so that the machine's noise falls on both; medians and p90 in µs, and the
ratio this tree / the other. The other tree is a ``git worktree`` of ``--against``
(default: the last commit before the core planned against a read-only view), made in a
temporary folder and removed after.

Run: python bench/bench_plan.py [--against REV] [--rounds 4] [--samples 150]
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

GiB = 1024
WORKERS, PER_WORKER, PENDING = 125, 8, 10_000
SHAPES = [(8, "normal"), (16, "normal"), (24, "normal"), (8, "batch"), (16, "batch"), (24, "batch")]


def measure(samples: int) -> dict[str, list[float]]:
    """Runs in the tree under test: its own gpu_arbiter on sys.path."""
    from gpu_arbiter.core import Gpu, Request, Scheduler, Worker

    sched = Scheduler()
    for w in range(WORKERS):
        name = f"w{w:03d}"
        gpus = [Gpu(index=i, total_mb=80 * GiB, worker=name) for i in range(PER_WORKER)]
        sched.put_worker(Worker(name), gpus)
    now = 0.0
    for w in range(WORKERS):
        for i in range(PER_WORKER):
            lid = f"fill-{w}-{i}"
            sched.submit(Request.build(lid, vram_mb=76 * GiB, ttl_s=None, preemptible=False), now)
            sched.decide(now)
            sched.ready(lid, now)
    for i in range(PENDING):
        size, priority = SHAPES[i % len(SHAPES)]
        request = Request.build(f"p{i}", vram_mb=size * GiB, priority=priority, ttl_s=None)
        sched.submit(request, now)
    sched.decide(now)
    out: dict[str, list[float]] = {"cycle": [], "grant": [], "reason": []}
    for n in range(samples):
        now += 1.0
        extra = Request.build(f"x{n}", vram_mb=32 * GiB, priority="batch", ttl_s=None)
        sched.submit(extra, now)
        start = time.perf_counter()
        sched.decide(now)
        out["cycle"].append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        reason = sched.explain(extra.id, now)
        out["reason"].append((time.perf_counter() - start) * 1e6)
        assert reason.code in ("insufficient_vram", "nominated_for", "load_in_progress"), reason
        sched.cancel(extra.id)
        sched.release(f"fill-{n % WORKERS}-{n // WORKERS % PER_WORKER}", now)  # a GPU each time
        start = time.perf_counter()
        granted = sched.decide(now).grants
        out["grant"].append((time.perf_counter() - start) * 1e6)
        assert granted, "the freed GPU takes requests from the head of the queue"
        for lease in granted:
            sched.ready(lease.id, now)
    return out


def run_tree(src: Path, samples: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}  # the same hashes both
    done = subprocess.run(
        [sys.executable, __file__, "--measure", str(samples)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(  # the last commit whose core committed and undid its plan's grants
        "--against", default="f071ae6", help="the commit to compare with (default: before)"
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--samples", type=int, default=150, help="per round and tree")
    parser.add_argument("--measure", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure)))
        return
    here = Path(__file__).resolve().parent.parent
    rev = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "--short", args.against],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other"
        subprocess.run(
            ["git", "-C", str(here), "worktree", "add", "--detach", str(other), rev],
            check=True,
            capture_output=True,
        )
        try:
            results: dict[str, dict[str, list[float]]] = {"this": {}, rev: {}}
            for round_ in range(args.rounds):
                for name, tree in (("this", here), (rev, other)):
                    found = run_tree(tree / "src", args.samples)
                    for key, values in found.items():
                        results[name].setdefault(key, []).extend(values)
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            subprocess.run(
                ["git", "-C", str(here), "worktree", "remove", "--force", str(other)],
                check=False,
                capture_output=True,
            )
    print(
        f"{WORKERS * PER_WORKER} GPUs, {PENDING} pending; {args.rounds} rounds x "
        f"{args.samples} samples per tree; µs"
    )
    head = f"  {'case':<8} {'this p50':>9} {'p90':>9} {f'{rev} p50':>14} {'p90':>9}"
    print(f"{head} {'this/' + rev:>14}")
    for key in ("cycle", "grant", "reason"):
        mine, theirs = results["this"][key], results[rev][key]
        ratio = statistics.median(mine) / statistics.median(theirs)
        print(
            f"  {key:<8} {statistics.median(mine):>9.1f} {p90(mine):>9.1f} "
            f"{statistics.median(theirs):>14.1f} {p90(theirs):>9.1f} {ratio:>13.2f}x"
        )


if __name__ == "__main__":
    main()
