"""The sweep (:mod:`gpu_arbiter.sim.sweep`): ours over 320 generated traces, every case at
0 violations (I1, I3-I6, I10 exactly), 0 over-commits, 0 concurrent loads, nothing left."""

from __future__ import annotations

from collections import Counter

import pytest

from gpu_arbiter.sim import generate, parse_cluster
from gpu_arbiter.sim.sweep import CLUSTERS, KINDS, LONG_CLUSTERS, POLICIES, Case, cases, failures

CASES = list(cases())


def test_the_sweep_covers_every_kind_cluster_and_tier() -> None:
    assert len(CASES) >= 300
    assert set(KINDS) <= {c.kind for c in CASES}
    kinds = {part for c in CASES for part in c.kind.split("+")}
    assert {"mixed", "chat", "agents", "imagegen", "batch"} <= kinds
    assert {c.cluster for c in CASES} == set(CLUSTERS)
    assert {c.policy for c in CASES} == set(POLICIES) == {"ours", "ours-sleep"}
    sizes = {parse_cluster(c.cluster).largest_gpu_mb for c in CASES}
    assert min(sizes) == 24 * 1024 and max(sizes) == 80 * 1024
    assert max(parse_cluster(c.cluster).most_gpus_per_worker for c in CASES) == 8


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.policy}-{c.cluster}-{c.kind}-{c.seed}")
def test_a_sweep_case_keeps_every_invariant(case: Case) -> None:
    rec = case.run()
    assert failures(rec) == [], case.command
    assert rec.completed + len(rec.rejected) > 0


def test_the_sweep_exercises_multi_gpu_requests_preemption_reclaim_and_sleep() -> None:
    """The cases are not idle: they ask for multi-GPU fine-tunes on every cluster whose
    workers have several GPUs, preempt, reclaim warm models, sleep and wake."""
    multi: Counter[str] = Counter()
    for case in CASES:
        trace = generate(case.kind, case.seed, parse_cluster(case.cluster), hours=case.hours)
        multi[case.cluster] += sum(1 for item in trace if item.gpus > 1)
    assert all(multi[c] > 0 for c in LONG_CLUSTERS), multi
    mixed = [c for c in CASES if c.kind == "batch+chat" and c.seed == 1]
    recs = [(c.policy, c.run()) for c in mixed]
    assert sum(rec.preemptions for _, rec in recs) > 0
    assert sum(rec.evictions for _, rec in recs) > 0
    assert sum(rec.sleeps for p, rec in recs if p == "ours-sleep") > 0
    assert sum(rec.wakes for p, rec in recs if p == "ours-sleep") > 0
