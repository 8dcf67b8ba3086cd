"""The audit of ours' waits: a request never waits while memory it may use sits on another
GPU, except behind a load gate, a hold ahead of it (I6) or a victim that is stopping; the
warm memory of a higher priority holds a batch request back exactly as long as I5 says."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_arbiter.core import GpuId, Policy
from gpu_arbiter.sim import Simulation, TraceRequest, parse_cluster, parse_trace
from gpu_arbiter.sim.audit import Audit, Spell, totals

from .strategies import REQUESTS

# Two 24 GiB GPUs. r0, a long batch run, takes w1:0; r1, the normal code model, loads on
# w1:1, runs 5..15 and stays warm. r2, a second batch run, arrives at 20: 4 GiB are free
# on w1:0, and 8 GiB free plus the 16 GiB warm code model on w1:1.
TRACE = [
    '{"arrival_s": 0, "model": "tune-a", "vram_mb": "20G", "priority": "batch",'
    ' "load_s": 10, "run_s": 1000}',
    '{"arrival_s": 1, "model": "code", "vram_mb": "16G", "priority": "normal",'
    ' "load_s": 4, "run_s": 10}',
    '{"arrival_s": 20, "model": "tune-b", "vram_mb": "20G", "priority": "batch",'
    ' "load_s": 10, "run_s": 100}',
]


def _audit(
    trace: list[TraceRequest], spec: str, policy: Policy | None = None, **options: float
) -> tuple[Audit, list[Spell], Simulation]:
    cluster = parse_cluster(spec)
    audit = Audit(cluster, policy)
    sim = Simulation(trace, cluster, audit, **options)  # type: ignore[arg-type]
    rec = sim.run()
    return audit, audit.finish(rec.last_completion), sim


def test_a_warm_higher_priority_model_holds_batch_back_for_idle_reclaim_s() -> None:
    """r2 waits while the idle code model on w1:1 is protected from batch (I5): from 20
    until it has been idle 60 s (75), then for its holder to stop (2 s); it is granted
    there at once, not when the busy run on w1:0 ends (1010)."""
    _, spells, sim = _audit(parse_trace(TRACE), "2x24G", stop_s=2.0)
    waits = {w.attempt_id: (w.queue_s, w.wait_s) for w in sim.rec.waits}
    assert waits["r2"] == (57.0, 67.0)
    mine = [
        (s.start, s.end, s.kind, s.reason, s.gpus, s.verdicts, s.stopping)
        for s in spells
        if s.request_id == "r2"
    ]
    w1 = GpuId("w1", 1)
    protected = "insufficient_vram/idle_reclaim_s"
    assert mine == [
        (20.0, 75.0, "idle_later", protected, (w1,), ("insufficient_vram",), False),
        (75.0, 77.0, "busy", "preempting/revoking", (), (), True),
    ]
    assert totals(spells) == {
        ("batch", "idle_later", "insufficient_vram/idle_reclaim_s"): 55.0,
        ("batch", "busy", "preempting/revoking"): 2.0,
    }
    assert sim.rec.violations == []


def test_the_audit_follows_the_policy_settings() -> None:
    """With starvation_s 30, r2 takes the warm model once it has waited 30 s (at 50); with
    idle_reclaim_s and starvation_s at infinity it waits until the model's keep-alive ends
    and its holder unloads it (15 + 300 s), and the audit says so all along."""
    _, spells, sim = _audit(parse_trace(TRACE), "2x24G", Policy(starvation_s=30.0), stop_s=2.0)
    assert {w.attempt_id: w.queue_s for w in sim.rec.waits}["r2"] == 32.0
    assert [(s.start, s.end, s.reason) for s in spells if s.kind == "idle_later"] == [
        (20.0, 50.0, "insufficient_vram/starvation_s")
    ]
    never = Policy(idle_reclaim_s=float("inf"), starvation_s=float("inf"))
    _, spells, sim = _audit(parse_trace(TRACE), "2x24G", never, stop_s=2.0)
    assert {w.attempt_id: w.queue_s for w in sim.rec.waits}["r2"] == 295.0
    assert totals(spells)[("batch", "idle_later", "insufficient_vram/not_preemptible")] == 295.0


# A normal 2-GPU run preempts the two batch runs of w1 at 30; at 31, while they stop, an
# interactive model takes 10 GiB of the memory that preemption frees (I6: a request of
# higher base priority may): w1:0 will have 14 GiB, not 20, once the batch runs stop.
PREEMPTOR_TRACE = [
    '{"arrival_s": 0, "model": "tune-a", "vram_mb": "12G", "priority": "batch",'
    ' "load_s": 5, "run_s": 1000}',
    '{"arrival_s": 1, "model": "tune-b", "vram_mb": "12G", "priority": "batch",'
    ' "load_s": 5, "run_s": 1000}',
    '{"arrival_s": 30, "model": "pair", "vram_mb": "20G", "gpus": 2, "priority": "normal",'
    ' "load_s": 5, "run_s": 100}',
    '{"arrival_s": 31, "model": "chat", "vram_mb": "10G", "priority": "interactive",'
    ' "load_s": 2, "run_s": 60}',
]


def test_a_preemptor_whose_freed_memory_a_higher_priority_took_says_what_it_waits_for() -> None:
    """r2 waits for its victims only until r3 (interactive) takes part of their memory; from
    then on, and once they stopped, for r3's lease, which it may not preempt (I5), until r3
    ends at 93: never for its own victims, nor for nothing named."""
    _, spells, sim = _audit(parse_trace(PREEMPTOR_TRACE), "2x24G", stop_s=2.0, keep_alive_s=0.0)
    assert sim.rec.violations == []
    assert {w.attempt_id: w.queue_s for w in sim.rec.waits}["r2"] == 63.0
    assert [(s.start, s.end, s.reason, s.stopping) for s in spells if s.request_id == "r2"] == [
        (30.0, 31.0, "preempting/revoking", True),
        (31.0, 32.0, "insufficient_vram/not_preemptible", True),  # its victims stopping still
        (32.0, 93.0, "insufficient_vram/not_preemptible", False),
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(REQUESTS, min_size=1, max_size=25),
    st.sampled_from(["2x24G", "2w:2x24G", "3x24G"]),
)
def test_nothing_waits_while_usable_memory_sits_on_another_gpu(
    trace: list[TraceRequest], spec: str
) -> None:
    """Over random traces on several GPUs, every time a request waited while free memory,
    or free memory and warm models it may reclaim now, would have held it somewhere, a load
    gate, a request that may hold memory against it or a victim stopping held it back: a
    request alone in the queue never waits beside memory it may use."""
    trace = sorted(trace, key=lambda r: r.arrival_s)
    _, spells, sim = _audit(trace, spec, keep_alive_s=60.0, stop_s=1.0)
    assert sim.rec.violations == []
    for spell in spells:
        if spell.kind in ("free", "idle_now"):
            # a load gate (I3), a request that may hold memory against it (I6), or memory on
            # its way back from a victim that stops (the core waits for it, revokes no more)
            assert spell.gated or spell.behind or spell.stopping, spell
