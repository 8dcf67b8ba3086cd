"""The frontier check: which safe baselines do strictly better than ours."""

from __future__ import annotations

from typing import Any

from gpu_arbiter.sim import compare, generate, parse_cluster, summarize
from gpu_arbiter.sim.report import dominators, safe


def _summary(
    policy: str,
    interactive: tuple[float, float] = (3.0, 14.0),
    normal_p99: float = 20.0,
    batch_max: float = 300.0,
    work: float = 2.0,
    concurrent_loads: int = 0,
) -> dict[str, Any]:
    return {
        "policy": policy,
        "wait": {
            "interactive": {"p50_s": interactive[0], "p99_s": interactive[1]},
            "normal": {"p99_s": normal_p99},
            "batch": {"max_s": batch_max},
        },
        "work_per_hour": work,
        "overcommits": 0,
        "concurrent_loads": concurrent_loads,
    }


def test_a_baseline_as_good_everywhere_and_better_on_one_dominates() -> None:
    ours = _summary("ours", batch_max=164.0)
    better = _summary("prio-warm", batch_max=44.0, work=2.26)
    assert dominators([ours, better]) == ["prio-warm"]


def test_a_trade_off_is_no_domination() -> None:
    ours = _summary("ours", interactive=(3.0, 14.0), batch_max=164.0)
    slower_chat = _summary("priority", interactive=(12.0, 14.0), batch_max=44.0, work=2.3)
    same = _summary("lru")
    assert dominators([ours, slower_chat, same]) == []


def test_unsafe_baselines_and_ours_variants_are_no_yardstick() -> None:
    ours = _summary("ours", normal_p99=50.0)
    crashing = _summary("fifo", normal_p99=10.0, concurrent_loads=3)
    variant = _summary("ours-stop", normal_p99=10.0)
    assert dominators([ours, crashing, variant]) == []
    assert dominators([crashing]) == []


def test_a_simulated_comparison_names_only_safe_baselines() -> None:
    cluster = parse_cluster("medium")
    trace = generate("mixed", 11, cluster, 0.5)
    summaries = [summarize(rec) for rec in compare(trace, cluster)]
    named = dominators(summaries)
    by_name = {s["policy"]: s for s in summaries}
    assert "ours" not in named
    assert all(safe(by_name[name]) for name in named)
