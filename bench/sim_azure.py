"""The Azure LLM inference trace (2023, one hour) on three clusters at three load levels.

    PYTHONPATH=src python bench/sim_azure.py [--data ../shared/data/azure-llm-2023]
        [--loads 0.01,0.03,0.1] [--seeds 1] [--clusters 1x24G,2x24G,4x80G]
        [--policy KEY=VALUE,...] [--tiers [--sleep-after 60 --sleep-resident 0.15
        --sleep-s 2 --wake-s 1]] [--audit]

Per cluster and load it prints, per policy, the figures the goals are judged on
(interactive and normal p99 wait, longest batch wait, busy memory, memory
utilization with and without idle-warm memory, over-commits, concurrent loads,
invariant violations), its offered load (``sim.report.offered_load``), then the goals
against the best safe baseline of each figure (none above 1x capacity: every policy's
queue grows there), and the safe baselines that dominate ours (as good on interactive p50 and
p99, normal p99, longest batch wait and work per hour, better on one), if any.
With several seeds (each thins the trace and draws the batch jobs anew) the
figures are means over the seeds. ``--policy`` sets ours' Policy fields
(``idle_reclaim_s=120,starvation_s=600``) to measure other settings.
``--tiers`` compares ours' tiers instead: ours (keep-warm), ours-sleep (keep-warm
and the sleep tier of the ``--sleep-*`` and ``--wake-s`` options) and ours-stop
(no keep-warm), with their cold loads, sleeps, wakes and idle models reclaimed.
``--audit`` adds, per case, where ours' batch requests spent their waits
(``sim.audit``): with memory free, or free and warm that they may reclaim now, or only
warm memory that I5 protects from them for now, on some GPU, or none without preempting
busy work; with the core's reason for each.

The mapping of the trace (``gpu_arbiter.sim.azure``), per cluster class:

- 24 GiB GPUs: ``conv`` -> ``chat-14b`` (16 GiB, interactive, 12 s load), ``code`` ->
  ``code-14b`` (16 GiB, normal, 12 s load), batch jobs of 20 GiB (30 s load) every 20
  minutes on average, running 10-40 minutes;
- 80 GiB GPUs: ``conv`` -> ``chat-70b`` (70 GiB, interactive, 40 s load), ``code`` ->
  ``code-34b`` (36 GiB, normal, 20 s load), batch jobs of 76 GiB (60 s load) every 10
  minutes on average, running 10-40 minutes;
- both: 4000 prefill and 40 decode tokens/s per request, 16 requests per replica at
  once, requests closer than 30 s join one busy period.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gpu_arbiter.core import Policy
from gpu_arbiter.sim import (
    ALL,
    TIERS,
    Simulation,
    SleepTier,
    make_policy,
    parse_cluster,
    summarize,
)
from gpu_arbiter.sim.audit import Audit, totals
from gpu_arbiter.sim.azure import AzureMapping, BatchJobs, Service, convert, read_azure
from gpu_arbiter.sim.report import dominators, goal_lines, offered_load, targets

_G = 1024
ROOT = Path(__file__).resolve().parents[1]


def mapping_for(spec: str, load: float, seed: int) -> AzureMapping:
    """The mapping of the module docstring for the cluster's class of GPU."""
    if parse_cluster(spec).largest_gpu_mb >= 64 * _G:
        services = {
            "conv": Service("chat-70b", 70 * _G, 800, 40.0),
            "code": Service("code-34b", 36 * _G, 500, 20.0),
        }
        batch = BatchJobs(every_s=600.0, vram_mb=76 * _G, load_s=60.0)
    else:
        services = {
            "conv": Service("chat-14b", 16 * _G, 800, 12.0),
            "code": Service("code-14b", 16 * _G, 500, 12.0),
        }
        batch = BatchJobs(every_s=1200.0, vram_mb=20 * _G, load_s=30.0)
    return AzureMapping(services=services, load=load, seed=seed, batch=batch)


_KEYS = (
    ("interactive", "p99_s"),
    ("normal", "p99_s"),
    ("batch", "max_s"),
)
_FIGURES = (
    "work_per_hour",
    "busy_mem_util",
    "mem_util",
    "mem_util_no_idle",
    "overcommits",
    "concurrent_loads",
    "violations",
    "unfinished",
    "preemptions",
    "loads",
    "warm_starts",
    "sleeps",
    "wakes",
    "wakes_abandoned",
    "evictions",
)


def _mean(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary whose figures are the means of the seeds' figures."""
    first = summaries[0]
    out: dict[str, Any] = {"policy": first["policy"], "wait": {}}
    for cls, key in (*_KEYS, ("interactive", "p50_s"), ("normal", "p50_s")):
        values = [s["wait"][cls][key] for s in summaries if cls in s["wait"]]
        if values:
            out["wait"].setdefault(cls, {})[key] = statistics.fmean(values)
    for name in _FIGURES:
        out[name] = statistics.fmean(s[name] for s in summaries)
    return out


def offered(services: dict[str, Any], spec: str, load: float, seeds: int) -> float:
    """The offered load (``sim.report.offered_load``) on ``spec`` at ``load``, averaged
    over the seeds."""
    total_mb = parse_cluster(spec).total_mb
    return statistics.fmean(
        offered_load(convert(services, mapping_for(spec, load, seed)), total_mb)
        for seed in range(1, seeds + 1)
    )


def _runs(
    services: dict[str, Any],
    spec: str,
    load: float,
    seeds: int,
    names: list[str],
    policy: Policy | None,
    tier: SleepTier | None = None,
) -> list[dict[str, Any]]:
    """The named policies' summaries on ``spec`` at ``load``, averaged over the seeds."""
    cluster = parse_cluster(spec)
    per_seed = []
    for seed in range(1, seeds + 1):
        trace = convert(services, mapping_for(spec, load, seed))
        row = []
        for name in names:
            allocator = make_policy(name, cluster, policy, tier)
            row.append(summarize(Simulation(trace, cluster, allocator).run()))
        per_seed.append(row)
    return [_mean(list(runs)) for runs in zip(*per_seed, strict=True)]


def _wait(s: dict[str, Any], cls: str, key: str) -> str:
    value = s["wait"].get(cls, {}).get(key)
    return "-" if value is None else f"{value:.0f}"


def table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| policy | interactive p99 s | normal p99 s | longest batch s | busy mem "
        "| mem util | mem util no idle | loads | over-commit | concurrent loads | violations "
        "| unfinished |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        checked = f"{s['violations']:g}" if s["policy"] == "ours" else "-"
        lines.append(
            f"| {s['policy']} | {_wait(s, 'interactive', 'p99_s')} "
            f"| {_wait(s, 'normal', 'p99_s')} | {_wait(s, 'batch', 'max_s')} "
            f"| {s['busy_mem_util']:.1%} | {s['mem_util']:.1%} | {s['mem_util_no_idle']:.1%} "
            f"| {s['loads']:.0f} | {s['overcommits']:g} | {s['concurrent_loads']:g} "
            f"| {checked} | {s['unfinished']:g} |"
        )
    return lines


def dominated_line(summaries: list[dict[str, Any]]) -> str:
    """The safe baselines that dominate ours, with the figures they are judged on."""
    names = dominators(summaries)
    if not names:
        return "- dominated by a safe baseline: no"
    by_name = {s["policy"]: s for s in summaries}
    shown = "; ".join(_frontier(by_name[n]) for n in ["ours", *names])
    return f"- dominated by a safe baseline: **{', '.join(names)}** ({shown})"


def _frontier(s: dict[str, Any]) -> str:
    return (
        f"{s['policy']} interactive p50/p99 {_wait(s, 'interactive', 'p50_s')}/"
        f"{_wait(s, 'interactive', 'p99_s')} s, normal p99 {_wait(s, 'normal', 'p99_s')} s, "
        f"batch max {_wait(s, 'batch', 'max_s')} s, {s['work_per_hour']:.3f} GPU-h/h"
    )


def tier_table(summaries: list[dict[str, Any]]) -> list[str]:
    """What each tier buys: waits (median and p99), busy and held memory, and how models
    started (cold loads, warm, woken) and left (put to sleep, reclaimed)."""
    lines = [
        "| policy | interactive p50 / p99 s | normal p50 / p99 s | longest batch s | busy mem "
        "| mem util | cold loads | warm starts | sleeps | wakes (given up) | reclaimed "
        "| violations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['policy']} | {_wait(s, 'interactive', 'p50_s')} / "
            f"{_wait(s, 'interactive', 'p99_s')} | {_wait(s, 'normal', 'p50_s')} / "
            f"{_wait(s, 'normal', 'p99_s')} | {_wait(s, 'batch', 'max_s')} "
            f"| {s['busy_mem_util']:.1%} | {s['mem_util']:.1%} | {s['loads']:.0f} "
            f"| {s['warm_starts']:.0f} | {s['sleeps']:.0f} "
            f"| {s['wakes']:.0f} ({s['wakes_abandoned']:g}) "
            f"| {s['evictions']:.0f} | {s['violations'] + s['overcommits']:g} |"
        )
    return lines


def audit_lines(
    services: dict[str, Any], spec: str, load: float, seeds: int, policy: Policy | None
) -> list[str]:
    """Where ours' batch requests waited (``sim.audit``), seconds summed over the seeds."""
    cluster = parse_cluster(spec)
    seconds: dict[tuple[str, str, str], float] = {}
    for seed in range(1, seeds + 1):
        audit = Audit(cluster, policy, classes=("batch",))
        rec = Simulation(convert(services, mapping_for(spec, load, seed)), cluster, audit).run()
        for key, value in totals(audit.finish(rec.last_completion)).items():
            seconds[key] = seconds.get(key, 0.0) + value
    whole = sum(seconds.values()) or 1.0
    lines = ["| batch waited | core's reason | seconds | share |", "|---|---|---|---|"]
    for (_, kind, reason), value in sorted(seconds.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {reason} | {value:.0f} | {value / whole:.1%} |")
    return lines


def _policy(text: str) -> Policy | None:
    if not text:
        return None
    settings: dict[str, Any] = {}
    for pair in text.split(","):
        key, _, value = pair.partition("=")
        settings[key.strip()] = float(value)
    return Policy(**settings)


GRID = {
    "idle_reclaim_s": (30.0, 60.0, 120.0, 300.0, math.inf),
    "starvation_s": (120.0, 300.0, 600.0, 1200.0, math.inf),
    "preempt_patience_s": (0.0, 10.0, 30.0, 120.0),
}


def sweep(services: dict[str, Any], configs: list[tuple[str, float]], seeds: int) -> None:
    """Ours under every setting of GRID: goals met (of all judged) and the worst ratio of
    each goal to its bound over all clusters and loads (<= 1 met for waits, >= 1 for busy
    memory)."""
    baselines = [n for n in ALL if n != "ours"]
    pools = {c: _runs(services, *c, seeds, baselines, None) for c in configs}
    loads = {c: offered(services, *c, seeds) for c in configs}
    print("| " + " | ".join(GRID) + " | goals met | worst ratio / bound per goal |")
    print("|---" * (len(GRID) + 2) + "|")
    for values in itertools.product(*GRID.values()):
        policy = Policy(**dict(zip(GRID, values, strict=True)))
        met = judged = 0
        worst: dict[str, float] = {}
        for config in configs:
            ours = _runs(services, *config, seeds, ["ours"], policy)
            for name, goal in targets(ours + pools[config], loads[config]).items():
                if name == "not_judged":
                    continue
                judged += 1
                met += bool(goal["met"])
                if name == "safety" or goal["ratio"] is None:
                    continue
                scaled = goal["ratio"] / goal["bound"]
                higher = name == "busy_mem"
                previous = worst.get(name, scaled)
                worst[name] = min(previous, scaled) if higher else max(previous, scaled)
        shown = ", ".join(f"{k} {v:.2f}" for k, v in worst.items())
        print(f"| {' | '.join(f'{v:g}' for v in values)} | {met}/{judged} | {shown} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=str(ROOT.parent / "shared/data/azure-llm-2023"))
    parser.add_argument("--loads", default="0.01,0.03,0.1")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--clusters", default="1x24G,2x24G,4x80G")
    parser.add_argument("--policy", default="", help="ours' Policy fields, KEY=VALUE,...")
    parser.add_argument("--sweep", action="store_true", help="ours under every GRID setting")
    parser.add_argument("--tiers", action="store_true", help="ours, ours-sleep, ours-stop")
    parser.add_argument("--audit", action="store_true", help="where ours' batch waits went")
    parser.add_argument("--sleep-after", type=float, default=60.0)
    parser.add_argument("--sleep-resident", type=float, default=0.15)
    parser.add_argument("--sleep-s", type=float, default=2.0)
    parser.add_argument("--wake-s", type=float, default=1.0)
    args = parser.parse_args()
    tier = SleepTier(args.sleep_after, args.sleep_resident, args.sleep_s, args.wake_s)
    services = read_azure(args.data)
    started = time.perf_counter()
    configs = [
        (spec, float(load)) for spec in args.clusters.split(",") for load in args.loads.split(",")
    ]
    if args.sweep:
        sweep(services, configs, args.seeds)
    for spec, load in [] if args.sweep else configs:
        sizes = [
            len(convert(services, mapping_for(spec, load, s))) for s in range(1, args.seeds + 1)
        ]
        names = list(TIERS if args.tiers else ALL)
        summaries = _runs(services, spec, load, args.seeds, names, _policy(args.policy), tier)
        asked = offered(services, spec, load, args.seeds)
        print(
            f"\n#### {spec}, load {load:g} ({args.seeds} seed(s), "
            f"{statistics.fmean(sizes):.0f} requests on average, offered load "
            f"{asked:.2f}x capacity)\n"
        )
        if args.tiers:
            print("\n".join(tier_table(summaries)))
            continue
        print("\n".join(table(summaries)))
        print()
        print("\n".join(goal_lines(targets(summaries, asked))))
        print(dominated_line(summaries))
        if args.audit:
            print()
            print("\n".join(audit_lines(services, spec, load, args.seeds, _policy(args.policy))))
    print(f"\n({time.perf_counter() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
