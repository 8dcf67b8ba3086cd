"""The frontier check: which safe baselines do strictly better than ours."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_arbiter.sim import TraceRequest, compare, generate, parse_cluster, summarize
from gpu_arbiter.sim.report import dominators, goal_lines, offered_load, safe, targets


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


def _every(every_s: float, count: int = 12) -> list[TraceRequest]:
    """``count`` fine-tunes of 20 GiB running 600 s, one every ``every_s``."""
    return [
        TraceRequest(arrival_s=i * every_s, model=f"ft-{i}", vram_mb=20 * 1024, run_s=600.0,
                     load_s=10.0, priority=100, holder="batch")
        for i in range(count)
    ]  # fmt: skip


def test_offered_load_is_busy_memory_seconds_over_what_the_cluster_holds() -> None:
    one = parse_cluster("1x24G").total_mb
    # 12 x 20 GiB x 600 s, from 0 until the last could end (11 x 60 + 600 s), on 24 GiB
    assert offered_load(_every(60.0), one) == pytest.approx(12 * 20 * 600 / (1260 * 24))
    assert offered_load(_every(60.0), 2 * one) == pytest.approx(12 * 20 * 600 / (1260 * 48))
    assert offered_load([], one) == 0.0


def test_an_overloaded_seeded_run_judges_no_goal_but_safety() -> None:
    """One GPU asked for 4.8x what it holds: every policy's waits grow (the last fine-tune
    waits over an hour under each), and no goal is judged."""
    cluster = parse_cluster("1x24G")
    trace = _every(60.0)
    summaries = [summarize(rec) for rec in compare(trace, cluster, ["ours", "fifo", "priority"])]
    for summary in summaries:
        assert summary["wait"]["batch"]["max_s"] > 3600
    asked = offered_load(trace, cluster.total_mb)
    assert asked == pytest.approx(4.76, abs=0.01)
    judged = targets(summaries, asked)
    assert judged["not_judged"] == {"offered_load": 4.762, "why": "offered load 4.8x capacity"}
    assert set(judged) == {"not_judged", "safety"}
    assert judged["safety"]["met"] is True
    assert goal_lines(judged)[0] == (
        "- goals **not judged**: offered load 4.8x capacity (every policy's queue grows)"
    )

    spaced = _every(900.0)  # one at a time: the same requests, within capacity
    summaries = [summarize(rec) for rec in compare(spaced, cluster, ["ours", "fifo"])]
    assert offered_load(spaced, cluster.total_mb) < 1
    judged = targets(summaries, offered_load(spaced, cluster.total_mb))
    assert "not_judged" not in judged and judged["batch_max"]["met"] is True
