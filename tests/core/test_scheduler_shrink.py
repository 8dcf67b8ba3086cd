"""A lease that shrinks, and a request for exactly these GPUs: the sleep tier's core.

A shrink lowers what a lease commits at once (I1), but the memory it gives back is
granted again only once the probe shows it free (I2, I4); a lease never grows.
"""

from __future__ import annotations

import pytest

from gpu_arbiter.core import (
    Conflict,
    Constraints,
    GpuProbe,
    InvalidInput,
    LeaseState,
    NotFound,
    Unschedulable,
)
from tests.core.support import GiB, gid, gpu, grant_now, granted_ids, req, revoked_ids, scheduler

G0 = gid("w1:0")
G1 = gid("w1:1")


def test_a_shrink_lowers_what_the_lease_commits_at_once() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 20 * GiB))
    shrunk = sched.shrink("a", 2 * GiB, 1.0)
    assert shrunk.vram_mb == 2 * GiB
    assert shrunk.granted_mb == 20 * GiB
    assert shrunk.state is LeaseState.ACTIVE
    assert shrunk.token == sched.lease("a").token
    assert sched.lease("a").vram_mb == 2 * GiB
    assert sched.figures(G0).committed_mb == 2 * GiB
    # without a probe (GPUs declared by hand) the committed memory is all the arbiter knows
    sched.submit(req("b", 20 * GiB), 1.0)
    assert granted_ids(sched.decide(1.0)) == ["b"]
    assert sched.release("a", 2.0).vram_mb == 2 * GiB
    assert sched.figures(G0).committed_mb == 20 * GiB


def test_memory_a_shrink_frees_waits_for_the_probe_to_show_it_free() -> None:
    """Whole-GPU probe: ``max(committed, observed_used)`` keeps what the process still uses."""
    sched = scheduler(gpu(0))
    sched.set_probe(G0, GpuProbe(used_mb=0))
    grant_now(sched, req("a", 20 * GiB))
    sched.set_probe(G0, GpuProbe(used_mb=20 * GiB))
    sched.shrink("a", 2 * GiB, 1.0)
    sched.submit(req("b", 16 * GiB), 1.0)
    assert sched.decide(1.0).grants == ()
    reason = sched.explain("b", 1.0)
    assert reason.code == "insufficient_vram"
    assert reason.gpus[0].committed_mb == 2 * GiB
    assert reason.gpus[0].observed_mb == 20 * GiB
    sched.set_probe(G0, GpuProbe(used_mb=19 * GiB))  # the process is still giving it back
    assert sched.decide(2.0).grants == ()
    sched.set_probe(G0, GpuProbe(used_mb=2 * GiB))
    assert granted_ids(sched.decide(3.0)) == ["b"]


def test_per_lease_usage_keeps_what_the_shrunk_process_still_uses() -> None:
    """Per-lease probe: ``max(reserved, used)`` for the shrunk lease, exactly."""
    sched = scheduler(gpu(0))
    sched.set_probe(G0, GpuProbe(used_mb=0, lease_used_mb={}))
    grant_now(sched, req("a", 20 * GiB))
    sched.set_probe(G0, GpuProbe(used_mb=20 * GiB, lease_used_mb={"a": 20 * GiB}))
    sched.shrink("a", 2 * GiB, 1.0)
    assert sched.figures(G0).free_mb == 24 * GiB - 20 * GiB
    sched.submit(req("b", 16 * GiB), 1.0)
    assert sched.decide(1.0).grants == ()
    sched.set_probe(G0, GpuProbe(used_mb=6 * GiB, lease_used_mb={"a": 6 * GiB}))
    assert sched.figures(G0).free_mb == 18 * GiB
    assert granted_ids(sched.decide(2.0)) == ["b"]


def test_a_shrunk_lease_still_counts_its_new_size_when_its_process_uses_less() -> None:
    sched = scheduler(gpu(0))
    sched.set_probe(G0, GpuProbe(used_mb=0, lease_used_mb={}))
    grant_now(sched, req("a", 20 * GiB))
    sched.shrink("a", 4 * GiB, 1.0)
    sched.set_probe(G0, GpuProbe(used_mb=1 * GiB, lease_used_mb={"a": 1 * GiB}))
    assert sched.figures(G0).free_mb == 20 * GiB
    sched.submit(req("b", 20 * GiB + 1), 1.0)
    assert sched.decide(1.0).grants == ()


def test_a_shrink_on_several_gpus_shrinks_each() -> None:
    sched = scheduler(gpu(0), gpu(1))
    grant_now(sched, req("a", 10 * GiB, gpus=2))
    sched.shrink("a", 3 * GiB, 1.0)
    assert sched.figures(G0).committed_mb == sched.figures(G1).committed_mb == 3 * GiB


def test_an_equal_shrink_changes_nothing() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 8 * GiB))
    before = sched.lease("a")
    assert sched.shrink("a", 8 * GiB, 1.0) is before
    assert sched.counters["shrunk"] == 0


def test_a_lease_never_grows() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 8 * GiB))
    sched.shrink("a", 4 * GiB, 1.0)
    with pytest.raises(Conflict, match="grows only through a new grant") as caught:
        sched.shrink("a", 4 * GiB + 1, 2.0)
    assert caught.value.details["field"] == "vram_mb"
    assert sched.lease("a").vram_mb == 4 * GiB
    assert sched.figures(G0).committed_mb == 4 * GiB


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2G"])
def test_a_shrink_to_a_bad_size_names_the_field_and_changes_nothing(bad: object) -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 8 * GiB))
    with pytest.raises(InvalidInput) as caught:
        sched.shrink("a", bad, 1.0)  # type: ignore[arg-type]
    assert caught.value.field == "vram_mb"
    assert sched.figures(G0).committed_mb == 8 * GiB


def test_only_a_held_lease_shrinks() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 20 * GiB))
    sched.submit(req("b", 20 * GiB), 0.0)
    with pytest.raises(Conflict, match="pending"):
        sched.shrink("b", 1 * GiB, 1.0)
    sched.release("a", 1.0)
    with pytest.raises(NotFound):
        sched.shrink("a", 1 * GiB, 1.0)
    with pytest.raises(NotFound):
        sched.shrink("nobody", 1 * GiB, 1.0)


def test_a_loading_and_a_revoking_lease_shrink_too() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 20 * GiB, priority="batch"), ready=False)
    assert sched.shrink("a", 12 * GiB, 0.0).loading
    sched.ready("a", 0.0)
    sched.submit(req("p", 16 * GiB, priority="interactive"), 1.0)
    assert revoked_ids(sched.decide(1.0)) == ["a"]
    assert sched.shrink("a", 8 * GiB, 2.0).state is LeaseState.REVOKING
    # the preemptor fits beside what is left of its victim: granted without waiting for it
    assert granted_ids(sched.decide(2.0)) == ["p"]


# ---------------------------------------------------------------- exactly these GPUs


def test_a_request_for_exact_gpus_lands_on_them() -> None:
    sched = scheduler(gpu(0, total_mb=8 * GiB), gpu(1), gpu(2))
    constraints = Constraints.build(gpu_ids=["w1:2"])
    sched.submit(req("a", 4 * GiB, constraints=constraints), 0.0)  # binpack would pick w1:0
    (lease,) = sched.decide(0.0).grants
    assert lease.gpus == (gid("w1:2"),)
    both = Constraints.build(gpu_ids=["w1:1", "w1:2"])
    sched.submit(req("b", 4 * GiB, constraints=both), 0.0)
    sched.ready("a", 0.0)
    (lease,) = sched.decide(0.0).grants
    assert lease.gpus == (G1, gid("w1:2"))


def test_a_request_for_exact_gpus_waits_for_them_and_says_why() -> None:
    sched = scheduler(gpu(0), gpu(1))
    grant_now(sched, req("a", 20 * GiB, constraints=Constraints.build(gpu_ids=["w1:0"])))
    sched.submit(req("wake", 20 * GiB, constraints=Constraints.build(gpu_ids=["w1:0"])), 1.0)
    assert sched.decide(1.0).grants == ()  # w1:1 is free, but it is not the one asked for
    reason = sched.explain("wake", 1.0)
    assert reason.code == "insufficient_vram"
    assert {v.gpu: v.code for v in reason.gpus} == {G0: "insufficient_vram", G1: "gpu_mismatch"}
    sched.release("a", 2.0)
    assert granted_ids(sched.decide(2.0)) == ["wake"]


@pytest.mark.parametrize("ids", [["w1:5"], ["w1:0", "w1:5"], ["w2:0"]])
def test_a_request_for_gpus_that_do_not_exist_is_rejected_at_once(ids: list[str]) -> None:
    sched = scheduler(gpu(0), gpu(1))
    request = req("r", 1 * GiB, constraints=Constraints.build(gpu_ids=ids))
    with pytest.raises(Unschedulable) as caught:
        sched.submit(request, 0.0)
    assert caught.value.reason.code == "no_matching_gpu"
    assert "constraints.gpu_ids" in caught.value.reason.message
    assert "w1:5" in caught.value.reason.message or "w2:0" in caught.value.reason.message
    assert "r" not in sched.queue


def test_a_request_for_exact_gpus_too_small_for_it_is_rejected() -> None:
    sched = scheduler(gpu(0, total_mb=8 * GiB), gpu(1))
    request = req("r", 10 * GiB, constraints=Constraints.build(gpu_ids=["w1:0"]))
    with pytest.raises(Unschedulable) as caught:
        sched.submit(request, 0.0)
    assert caught.value.reason.code == "too_large"


def test_a_waiting_request_for_gpus_whose_worker_went_away_is_rejected() -> None:
    sched = scheduler(gpu(0, worker="w1"), gpu(0, worker="w2"))
    grant_now(sched, req("a", 20 * GiB, constraints=Constraints.build(worker="w2")))
    sched.submit(req("r", 20 * GiB, constraints=Constraints.build(gpu_ids=["w2:0"])), 0.0)
    sched.release("a", 1.0)
    sched.remove_worker("w2")
    decisions = sched.decide(1.0)
    assert [(r.id, why.code) for r, why in decisions.rejected] == [("r", "no_matching_gpu")]
