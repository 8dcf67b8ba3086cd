"""How fast the simulator runs: wall time and steps per second per policy.

Each policy runs ``gpu-arbiter simulate --generate mixed --seed 1 --hours 4 --cluster large``'s
trace (the defaults) three times; the median is printed. The trace is generated once, outside
the timing; a run is one :class:`gpu_arbiter.sim.Simulation` (the world, the policy and its
invariant checks), timed in a fresh process for each code tree.

``--baseline SRC`` also times the ``src`` directory of other code
(``git worktree add /tmp/base COMMIT``, then ``--baseline /tmp/base/src``) in the same run,
each of its runs right after ours, checks that both made the same decisions (the run's
summary), and prints the ratio. Run: ``python bench/bench_sim.py [--baseline SRC]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE_SRC = Path(__file__).resolve().parent.parent / "src"
POLICIES = ("ours", "fifo", "priority", "slots", "lru", "prio-warm", "ollama")

# Run in a child process whose PYTHONPATH is the code tree under test: only the public API of
# ``gpu_arbiter.sim`` that both trees have.
_TIMER = """
import json, sys, time
from gpu_arbiter.sim import Simulation, generate, make_policy, parse_cluster, summarize
cluster_spec, seed, hours, names = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
cluster = parse_cluster(cluster_spec)
trace = generate("mixed", seed, cluster, hours)
out = {}
for name in names:
    started = time.perf_counter()
    rec = Simulation(trace, cluster, make_policy(name, cluster)).run()
    wall_s = time.perf_counter() - started
    out[name] = {"wall_s": wall_s, "steps": rec.steps, "summary": summarize(rec)}
print(json.dumps(out))
"""


def _time(src: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """One run of every policy with the code under ``src``, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    command = [sys.executable, "-c", _TIMER, args.cluster, str(args.seed), str(args.hours)]
    done = subprocess.run(
        [*command, *args.policy], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, dict[str, Any]] = json.loads(done.stdout)
    return result


def _median(runs: list[dict[str, dict[str, Any]]], name: str) -> float:
    return statistics.median(run[name]["wall_s"] for run in runs)


def _report(
    args: argparse.Namespace,
    ours: list[dict[str, dict[str, Any]]],
    base: list[dict[str, dict[str, Any]]],
) -> None:
    header = "| policy | steps | wall s | steps/s |"
    if base:
        header += " before s | before steps/s | speed-up | same decisions |"
    print(
        f"--generate mixed --seed {args.seed} --hours {args.hours:g} --cluster {args.cluster}: "
        f"median of {args.runs} runs\n"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    totals = [0.0, 0.0]
    for name in args.policy:
        steps = ours[0][name]["steps"]
        wall = _median(ours, name)
        totals[0] += wall
        line = f"| {name} | {steps} | {wall:.2f} | {steps / wall:,.0f} |"
        if base:
            before = _median(base, name)
            totals[1] += before
            same = all(b[name]["summary"] == ours[0][name]["summary"] for b in base)
            line += (
                f" {before:.2f} | {base[0][name]['steps'] / before:,.0f} "
                f"| {before / wall:.1f}x | {'yes' if same else 'NO'} |"
            )
        print(line)
    line = f"| all | | {totals[0]:.2f} | |"
    if base:
        line += f" {totals[1]:.2f} | | {totals[1] / totals[0]:.1f}x | |"
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="the src directory of other code")
    parser.add_argument("--cluster", default="large")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hours", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--policy", nargs="+", default=list(POLICIES), choices=POLICIES)
    args = parser.parse_args()
    if args.baseline is not None and not (args.baseline / "gpu_arbiter").is_dir():
        parser.error(f"--baseline: {args.baseline} holds no gpu_arbiter package")
    ours: list[dict[str, dict[str, Any]]] = []
    base: list[dict[str, dict[str, Any]]] = []
    for _ in range(args.runs):  # interleaved: a load on the machine weighs on both alike
        ours.append(_time(HERE_SRC, args))
        if args.baseline is not None:
            base.append(_time(args.baseline, args))
    _report(args, ours, base)


if __name__ == "__main__":
    main()
