"""Seeded runs are identical; different seeds differ."""

from __future__ import annotations

from gpu_arbiter.sim import POLICIES, compare, dump_trace, generate, parse_cluster, summarize


def test_generated_traces_are_a_function_of_their_seed() -> None:
    cluster = parse_cluster("medium")
    first = generate("mixed", 3, cluster, hours=0.5)
    assert dump_trace(first) == dump_trace(generate("mixed", 3, cluster, hours=0.5))
    assert dump_trace(first) != dump_trace(generate("mixed", 4, cluster, hours=0.5))
    assert {r.holder for r in first} == {"chat", "agents", "imagegen", "finetune", "reindex"}


def test_seeded_runs_are_identical() -> None:
    cluster = parse_cluster("2w:2x24G")
    trace = generate("mixed", 11, cluster, hours=0.3)
    runs = [compare(trace, cluster, list(POLICIES)) for _ in range(2)]
    for a, b in zip(*runs, strict=True):
        assert summarize(a) == summarize(b)
        assert a.waits == b.waits
        assert a.timeline == b.timeline


def test_kinds_combine() -> None:
    cluster = parse_cluster("single")
    trace = generate("chat+batch", 1, cluster, hours=2)
    assert {r.holder for r in trace} <= {"chat", "finetune", "reindex"}
    assert {r.priority for r in trace} == {800, 100}
