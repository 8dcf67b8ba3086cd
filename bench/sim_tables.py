"""Prints the simulator's comparison tables (markdown) for bench/README.md.

    PYTHONPATH=src python bench/sim_tables.py                     # the three shapes
    PYTHONPATH=src python bench/sim_tables.py --chat-preemptible  # chat holders opt in

Each shape is ``gpu-arbiter simulate --generate KIND --seed 1 --hours 4 --cluster CLUSTER``.
``--chat-preemptible`` rewrites the trace's interactive requests to ``preemptible: true``
(what ``sed 's/"preemptible": false/"preemptible": true/'`` does to a saved trace).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from gpu_arbiter.sim import compare, generate, parse_cluster, summarize
from gpu_arbiter.sim.report import dominators, goal_lines, targets

SHAPES = (("mixed", "single"), ("mixed", "medium"), ("mixed", "large"))


def _wait(s: dict[str, Any], cls: str, *keys: str) -> str:
    w = s["wait"].get(cls)
    return "-" if w is None else " / ".join(f"{w[k]:.0f}" for k in keys)


def _table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| policy | interactive wait s p50 / p95 / p99 | normal p50 / p99 | batch p99 / max "
        "| busy mem | mem util (no idle) | GPU-h/h | preempted (wasted GPU-s) | over-commit "
        "| concurrent loads | unfinished |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['policy']} | {_wait(s, 'interactive', 'p50_s', 'p95_s', 'p99_s')} "
            f"| {_wait(s, 'normal', 'p50_s', 'p99_s')} | {_wait(s, 'batch', 'p99_s', 'max_s')} "
            f"| {s['busy_mem_util']:.1%} | {s['mem_util']:.1%} ({s['mem_util_no_idle']:.1%}) "
            f"| {s['work_per_hour']:.2f} "
            f"| {s['preemptions']} ({s['wasted_run_s']:.0f}) | {s['overcommits']} "
            f"| {s['concurrent_loads']} | {s['unfinished']} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chat-preemptible", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hours", type=float, default=4.0)
    args = parser.parse_args()
    for kind, spec in SHAPES:
        cluster = parse_cluster(spec)
        trace = generate(kind, args.seed, cluster, args.hours)
        if args.chat_preemptible:
            trace = [
                dataclasses.replace(r, preemptible=True) if r.priority >= 800 else r for r in trace
            ]
        started = time.perf_counter()
        summaries = [summarize(rec) for rec in compare(trace, cluster)]
        took = time.perf_counter() - started
        print(
            f"\n#### `--generate {kind} --cluster {spec}` ({cluster.spec}): "
            f"{len(trace)} requests, simulated in {took:.0f} s\n"
        )
        print("\n".join(_table(summaries)))
        print()
        print("\n".join(goal_lines(targets(summaries))))
        named = dominators(summaries)
        print(f"- dominated by a safe baseline: {', '.join(named) if named else 'no'}")


if __name__ == "__main__":
    main()
