"""The stages: the first that says no names the outcome, in the documented order, and
placement and "why is it pending" ask the same ones."""

from __future__ import annotations

import inspect
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_arbiter.core import (
    Constraints,
    GpuProbe,
    Policy,
    Unschedulable,
    WorkerStatus,
    filters,
)
from gpu_arbiter.core.stages import FEASIBLE, FIT, STAGES, Outcome, fits, outcome

from .support import GiB, gid, gpu, req, scheduler

A = gid("w1:0")


def test_the_stages_are_feasibility_then_fit() -> None:
    assert STAGES == FEASIBLE + FIT
    assert [s.__name__ for s in STAGES] == [
        "matches",
        "worker_online",
        "probe_fresh",
        "fit",  # memory, then the holds ahead, then the load gate (stages.fit_code)
    ]


def test_the_first_stage_that_says_no_names_the_outcome() -> None:
    sched = scheduler(gpu(total_mb=24 * GiB))
    sched.drain("w1", 0.0)
    sched.set_probe(A, None)
    too_big = req("x", 30 * GiB)
    assert outcome(sched, too_big, A, {}) == "too_small"  # matches first: nothing will help
    on_other_worker = req("y", GiB, constraints=Constraints(worker="w2"))
    assert outcome(sched, on_other_worker, A, {}) == "worker_mismatch"
    assert outcome(sched, req("z", GiB), A, {}) == "worker_draining"  # before the stale probe
    sched.cancel_drain("w1")
    assert outcome(sched, req("z", GiB), A, {}) == "probe_stale"


def test_memory_then_the_holds_ahead_then_the_load_gate() -> None:
    sched = scheduler(gpu(total_mb=24 * GiB))
    sched.set_probe(A, GpuProbe(used_mb=4 * GiB))
    sched.submit(req("loading", 2 * GiB), 0.0)
    sched.decide(0.0)  # granted, loading: the gate is closed
    assert outcome(sched, req("a", 21 * GiB), A, {}) == "insufficient_vram"
    assert outcome(sched, req("b", 8 * GiB), A, {A: 13 * GiB}) == "nominated_for"
    assert outcome(sched, req("c", 8 * GiB), A, {}) == "load_in_progress"
    sched.ready("loading", 0.0)
    assert outcome(sched, req("c", 8 * GiB), A, {}) is None
    assert fits(sched, req("c", 8 * GiB), A, {})
    assert not fits(sched, req("c", 8 * GiB), gid("w1:7"), {})  # no such GPU


def test_why_it_is_pending_is_what_the_stages_said() -> None:
    sched = scheduler(gpu(total_mb=24 * GiB), gpu(index=1, total_mb=8 * GiB))
    sched.submit(req("holder", 20 * GiB), 0.0)
    sched.decide(0.0)
    sched.ready("holder", 0.0)
    sched.submit(req("waits", 12 * GiB), 0.0)
    sched.decide(0.0)
    reason = sched.explain("waits", 0.0)
    assert reason.code == "insufficient_vram"
    assert {str(v.gpu): v.code for v in reason.gpus} == {
        "w1:0": outcome(sched, req("w", 12 * GiB), A, {}),
        "w1:1": outcome(sched, req("w", 12 * GiB), gid("w1:1"), {}),
    }
    assert {v.code for v in reason.gpus} == {"insufficient_vram", "too_small"}


def test_every_code_a_stage_can_return_is_a_typed_outcome_saying_what_helps() -> None:
    returned = set(re.findall(r'return "(\w+)"', inspect.getsource(filters)))
    returned |= {f"worker_{s}" for s in WorkerStatus if s is not WorkerStatus.ONLINE}
    assert returned <= {o.value for o in Outcome}
    assert Outcome("worker_offline").helped_by == "an event"
    assert Outcome.LOAD_IN_PROGRESS.helped_by == "room"
    assert Outcome.LABEL_MISMATCH.helped_by == "nothing"
    sched = scheduler(gpu())
    code = outcome(sched, req("x", 30 * GiB), A, {})
    assert code is Outcome.TOO_SMALL and f"{code}" == "too_small"


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([8, 16, 24]), min_size=1, max_size=12),
    held=st.lists(st.tuples(st.integers(0, 11), st.integers(1, 8), st.booleans()), max_size=10),
    want=st.integers(1, 24),
    placement=st.sampled_from(["binpack", "spread"]),
)
def test_a_request_for_one_gpu_gets_the_best_gpu_every_stage_lets_through(
    sizes: list[int], held: list[tuple[int, int, bool]], want: int, placement: str
) -> None:
    """Placement is the stages' verdicts ranked: of the GPUs every stage lets the request
    through on, the least room left (binpack) or the most (spread), then the lowest id;
    GPUs of equal room (an idle cluster) are many and must not change the pick."""
    policy = Policy(placement=placement)  # type: ignore[arg-type]
    sched = scheduler(*(gpu(i, s * GiB) for i, s in enumerate(sizes)), policy=policy)
    for k, (index, gib, loaded) in enumerate(held):
        on = Constraints(gpu_ids=(f"w1:{index % len(sizes)}",))
        try:
            sched.submit(req(f"h{k}", gib * GiB, constraints=on), 0.0)
        except Unschedulable:  # larger than that GPU can ever hold
            continue
        if sched.decide(0.0).grants and loaded:
            sched.ready(f"h{k}", 0.0)
    for request in list(sched.queue.ordered(policy, 0.0)):  # those that did not fit
        sched.cancel(request.id)
    request = req("new", want * GiB)
    through = [g for g in sched.gpu_ids() if fits(sched, request, g, {})]
    sign = -1 if placement == "spread" else 1
    expected = min(through, key=lambda g: (sign * sched.ledger.free_mb(g), g), default=None)
    try:
        sched.submit(request, 0.0)
    except Unschedulable:  # no GPU could ever hold it
        assert through == []
        return
    grants = sched.decide(0.0).grants
    assert [lease.gpus for lease in grants] == ([] if expected is None else [(expected,)])
