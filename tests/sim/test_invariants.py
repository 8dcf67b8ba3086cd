"""Ours is checked against I1, I3, I4, I5 and I6 on every simulated step."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_arbiter.core import GpuId
from gpu_arbiter.sim import Simulation, Step, TraceRequest, generate, parse_cluster
from gpu_arbiter.sim.ours import Ours

from .strategies import REQUESTS


def _run_ours(trace: list[TraceRequest], spec: str, **options: float) -> Simulation:
    cluster = parse_cluster(spec)
    sim = Simulation(trace, cluster, Ours(cluster), **options)
    sim.run()
    return sim


def test_generated_mixed_trace_keeps_every_invariant() -> None:
    cluster = parse_cluster("medium")
    trace = generate("mixed", 7, cluster, hours=0.5)
    sim = _run_ours(trace, "medium")
    rec = sim.rec
    assert rec.violations == []
    assert rec.overcommits == 0
    assert rec.concurrent_loads == 0
    assert rec.max_loads <= 1
    assert rec.preemptions > 0  # the trace does exercise preemption
    assert rec.evictions > 0  # ... and reclaiming idle leases
    assert rec.unfinished == 0
    assert rec.steps > 100


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(REQUESTS, min_size=1, max_size=25), st.sampled_from(["1x24G", "2w:2x24G"]))
def test_random_traces_keep_every_invariant(trace: list[TraceRequest], spec: str) -> None:
    trace = sorted(trace, key=lambda r: r.arrival_s)
    sim = _run_ours(trace, spec, keep_alive_s=60.0, stop_s=1.0)
    rec = sim.rec
    assert rec.violations == []
    assert rec.overcommits == 0
    assert rec.concurrent_loads == 0
    assert rec.unfinished == 0
    assert rec.completed + len(rec.rejected) == len(trace)


def test_the_checks_see_a_broken_book() -> None:
    """The checker is not vacuous: memory freed under a running process is an I4 violation,
    and a process that the core does not know holds memory is one too."""
    cluster = parse_cluster("1x24G")
    trace = generate("chat", 1, cluster, hours=0.2)
    ours = Ours(cluster)
    sim = Simulation(trace, cluster, ours)
    sim.run()
    gpu = GpuId("w1", 0)
    assert ours.check(0.0, Step(), {"ghost": (gpu,)}) == [
        "I4: lease ghost still runs but its memory was freed"
    ]
