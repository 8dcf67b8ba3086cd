"""The scheduling cycle: grants, gates, placement, nominations, reasons, timers, workers."""

from __future__ import annotations

import pytest

from gpu_arbiter.core import (
    Conflict,
    Constraints,
    GpuProbe,
    LeaseState,
    NotFound,
    Policy,
    Scheduler,
    Unschedulable,
    Worker,
    WorkerStatus,
)
from tests.core.support import gid, gpu, grant_now, granted_ids, req, revoked_ids, scheduler

G0 = gid("w1:0")
G1 = gid("w1:1")


# ---------------------------------------------------------------- grants and the load gate


def test_a_fitting_request_is_granted_loading_then_active() -> None:
    sched = scheduler(gpu(0))
    submitted = sched.submit(req("a", "6G", ttl_s=30), 5.0)
    assert submitted.seq >= 1
    assert submitted.submitted_at == 5.0
    decisions = sched.decide(5.0)
    (lease,) = decisions.grants
    assert lease.id == "a"
    assert lease.gpus == (G0,)
    assert lease.state is LeaseState.LOADING
    assert lease.expires_at == 35.0
    assert "a" not in sched.queue
    assert sched.figures(G0).committed_mb == 6144
    assert sched.ready("a", 6.0).state is LeaseState.ACTIVE
    released = sched.release("a", 7.0)
    assert released.state is LeaseState.RELEASED
    assert sched.figures(G0).committed_mb == 0
    with pytest.raises(NotFound):
        sched.release("a", 8.0)


def test_load_gate_serializes_loads_on_a_gpu() -> None:
    sched = scheduler(gpu(0))
    sched.submit(req("a", 4000), 0.0)
    sched.submit(req("b", 4000), 0.0)
    assert granted_ids(sched.decide(0.0)) == ["a"]
    assert sched.explain("b", 0.0).code == "load_in_progress"
    assert sched.decide(1.0).grants == ()
    sched.ready("a", 2.0)
    assert granted_ids(sched.decide(2.0)) == ["b"]


def test_max_concurrent_loads_allows_that_many() -> None:
    sched = scheduler(gpu(0), policy=Policy(max_concurrent_loads=2))
    for name in "abc":
        sched.submit(req(name, 4000), 0.0)
    assert granted_ids(sched.decide(0.0)) == ["a", "b"]
    assert sched.figures(G0).loading == 2
    sched.ready("b", 1.0)
    assert granted_ids(sched.decide(1.0)) == ["c"]


def test_a_load_that_times_out_counts_as_done() -> None:
    sched = scheduler(gpu(0))
    sched.submit(req("a", 4000, load_timeout_s=60), 0.0)
    sched.submit(req("b", 4000), 0.0)
    assert granted_ids(sched.decide(0.0)) == ["a"]
    assert sched.next_deadline() == 60.0
    decisions = sched.decide(60.0)
    assert [lease.id for lease in decisions.loaded] == ["a"]
    assert granted_ids(decisions) == ["b"]
    assert sched.lease("a").state is LeaseState.ACTIVE


def test_a_revoked_lease_that_is_still_loading_keeps_the_gate_closed() -> None:
    sched = scheduler(gpu(0))
    sched.submit(req("a", 4000), 0.0)
    sched.decide(0.0)
    sched.revoke("a", "admin", 1.0)
    sched.submit(req("b", 4000), 1.0)
    assert sched.decide(1.0).grants == ()
    sched.release("a", 2.0)
    assert granted_ids(sched.decide(2.0)) == ["b"]


# ---------------------------------------------------------------- placement


def _two_gpus(placement: str) -> Scheduler:
    sched = scheduler(gpu(0), gpu(1), policy=Policy(placement=placement))  # type: ignore[arg-type]
    grant_now(sched, req("filler", 14000, constraints=Constraints.build()), 0.0)
    assert sched.lease("filler").gpus == (G0,)
    return sched


def test_binpack_fills_the_fullest_gpu_that_fits() -> None:
    sched = _two_gpus("binpack")
    sched.submit(req("small", 4000), 1.0)
    (lease,) = sched.decide(1.0).grants
    assert lease.gpus == (G0,)


def test_spread_uses_the_emptiest_gpu() -> None:
    sched = _two_gpus("spread")
    sched.submit(req("small", 4000), 1.0)
    (lease,) = sched.decide(1.0).grants
    assert lease.gpus == (G1,)


def test_binpack_keeps_a_large_hole_for_a_large_request() -> None:
    sched = _two_gpus("binpack")
    grant_now(sched, req("small", 4000), 1.0)
    grant_now(sched, req("large", 24000), 2.0)
    assert sched.lease("large").gpus == (G1,)


def test_several_gpus_on_one_worker() -> None:
    sched = scheduler(gpu(0), gpu(1), gpu(0, worker="w2"))
    sched.submit(req("pair", 10000, gpus=2), 0.0)
    (lease,) = sched.decide(0.0).grants
    assert lease.gpus == (G0, G1)
    assert sched.figures(G0).committed_mb == sched.figures(G1).committed_mb == 10000
    sched.ready("pair", 0.0)
    grant_now(sched, req("fill", 14576, constraints=Constraints.build(worker="w1")), 1.0)
    # two GPUs with room exist (w1:1 and w2:0) but not on one worker
    sched.submit(req("pair2", 10000, gpus=2), 2.0)
    assert sched.decide(2.0).grants == ()
    reason = sched.explain("pair2", 2.0)
    assert reason.code == "insufficient_vram"
    assert "too_few_gpus_on_worker" in reason.message


def test_constraints_pick_the_gpu() -> None:
    sched = scheduler(
        gpu(0, arch="sm_86", model="RTX 4090"),
        gpu(1, arch="sm_90", model="H100 80GB", total_mb=80 * 1024),
    )
    sched.submit(req("h", 4000, constraints=Constraints.build(min_compute_capability="9.0")), 0.0)
    sched.submit(req("r", 4000, constraints=Constraints.build(gpu_model="*4090")), 0.0)
    grants = {lease.id: lease.gpus for lease in sched.decide(0.0).grants}
    assert grants == {"h": (G1,), "r": (G0,)}


# ---------------------------------------------------------------- nominations (I6)


def test_a_large_request_is_not_starved_by_small_ones() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("running", 10000), 0.0)
    sched.submit(req("large", 20000), 1.0)
    now = 1.0
    for i in range(20):
        now += 1.0
        sched.submit(req(f"small{i}", 2000), now)
        assert sched.decide(now).grants == ()
    reason = sched.explain("small0", now)
    assert reason.code == "nominated_for"
    assert reason.blocked_by == "large"
    assert "held for request large" in reason.message
    assert sched.explain("large", now).code == "insufficient_vram"
    sched.release("running", now)
    assert granted_ids(sched.decide(now)) == ["large"]


def test_requests_behind_a_nomination_use_the_memory_beyond_it() -> None:
    sched = scheduler(gpu(0, 24576), policy=Policy(max_concurrent_loads=4))
    grant_now(sched, req("running", 10000), 0.0)
    sched.submit(req("large", 20000), 1.0)  # free is 14576: 20000 does not fit
    sched.submit(req("small", 2000), 2.0)
    assert sched.decide(2.0).grants == ()
    sched.release("running", 3.0)
    # now 24576 free: large takes 20000, the 4576 beyond it fit the small one
    assert granted_ids(sched.decide(3.0)) == ["large", "small"]


def test_nominations_hold_other_gpus_only_where_nominated() -> None:
    sched = scheduler(gpu(0), gpu(1))
    grant_now(sched, req("a", 16000), 0.0)
    grant_now(sched, req("b", 18000), 0.0)
    sched.submit(req("large", 20000), 1.0)
    sched.submit(req("small", 2000), 2.0)
    # large holds the GPU with the most room (w1:0); the small one fits beside b
    (lease,) = sched.decide(2.0).grants
    assert lease.id == "small"
    assert lease.gpus == (sched.lease("b").gpus[0],)
    assert sched.explain("large", 2.0).nominated == sched.lease("a").gpus


def test_higher_priority_goes_first_and_equal_priority_in_submission_order() -> None:
    sched = scheduler(gpu(0, 8000), policy=Policy(max_concurrent_loads=8))
    sched.submit(req("batch", 4000, priority="batch"), 0.0)
    sched.submit(req("n1", 4000), 1.0)
    sched.submit(req("n2", 4000), 2.0)
    sched.submit(req("crit", 4000, priority="critical"), 3.0)
    assert granted_ids(sched.decide(3.0)) == ["crit", "n1"]
    positions = [(pos, r.id) for pos, r, _ in sched.pending(3.0)]
    assert positions == [(1, "n2"), (2, "batch")]


def test_all_grants_possible_at_once_are_made_in_one_cycle() -> None:
    sched = scheduler(gpu(0), gpu(1), policy=Policy(max_concurrent_loads=8))
    grant_now(sched, req("big0", 24000), 0.0)
    grant_now(sched, req("big1", 24000), 0.0)
    for i in range(10):
        sched.submit(req(f"r{i}", 4000), 1.0)
    assert sched.decide(1.0).grants == ()
    sched.release("big0", 2.0)
    sched.release("big1", 2.0)
    assert granted_ids(sched.decide(2.0)) == [f"r{i}" for i in range(10)]
    assert len(sched.queue) == 0


# ------------------------------------------------------- preemption, held for the preemptor


def test_memory_freed_by_preemption_is_held_for_the_preemptor() -> None:
    sched = scheduler(gpu(0), policy=Policy(max_concurrent_loads=8))
    grant_now(sched, req("victim", 20000, priority="batch"), 0.0)
    sched.submit(req("preemptor", 16000, priority="normal"), 1.0)
    assert revoked_ids(sched.decide(1.0)) == ["victim"]
    now = 1.0
    for i in range(5):  # a stream of lower-priority work while the victim stops
        now += 1.0
        sched.submit(req(f"low{i}", 4000, priority="background"), now)
        decisions = sched.decide(now)
        assert decisions.revocations == ()
        assert decisions.grants == ()  # 4576 MiB are free, but held for the preemptor
    assert sched.explain("low0", now).code == "nominated_for"
    assert sched.explain("preemptor", now).code == "preempting"
    sched.release("victim", now)
    decisions = sched.decide(now)
    assert granted_ids(decisions)[0] == "preemptor"
    assert decisions.revocations == ()
    assert sched.counters["preemptions"] == 1


def test_with_a_probe_the_preemptor_waits_for_the_memory_to_show_free() -> None:
    sched = scheduler(gpu(0), policy=Policy(max_concurrent_loads=8))
    grant_now(sched, req("victim", 20000, priority="batch"), 0.0)
    sched.set_probe(G0, GpuProbe(used_mb=20000))
    sched.submit(req("preemptor", 16000), 1.0)
    assert revoked_ids(sched.decide(1.0)) == ["victim"]
    sched.release("victim", 2.0)
    sched.submit(req("low", 4000, priority="batch"), 2.0)
    decisions = sched.decide(2.0)
    assert decisions.grants == ()
    assert decisions.revocations == ()
    assert sched.explain("preemptor", 2.0).code == "preempting"
    sched.set_probe(G0, GpuProbe(used_mb=0))
    assert granted_ids(sched.decide(3.0)) == ["preemptor", "low"]


def test_revoked_memory_is_not_counted_twice_for_two_preemptors() -> None:
    sched = scheduler(gpu(0), policy=Policy(max_concurrent_loads=8))
    grant_now(sched, req("victim", 12000, priority="batch"), 0.0)
    grant_now(sched, req("other", 12000, priority="batch"), 0.0)
    sched.submit(req("p1", 12000), 1.0)
    assert len(revoked_ids(sched.decide(1.0))) == 1
    sched.submit(req("p2", 12000), 2.0)
    assert len(revoked_ids(sched.decide(2.0))) == 1  # p1's victim is not reused for p2
    assert all(lease.state is LeaseState.REVOKING for lease in sched.leases.values())


# ---------------------------------------------------------------- rejection and reasons


def test_impossible_requests_are_rejected_at_once_with_a_reason() -> None:
    sched = scheduler(gpu(0, arch="sm_86"), gpu(1, arch="sm_86"))
    with pytest.raises(Unschedulable) as too_large:
        sched.submit(req("big", 30000), 0.0)
    assert too_large.value.reason.code == "too_large"
    assert "largest capacity 24.0 GiB" in too_large.value.reason.message
    with pytest.raises(Unschedulable) as no_match:
        sched.submit(req("arch", 1000, constraints=Constraints.build(gpu_arch=["sm_90"])), 0.0)
    assert no_match.value.reason.code == "no_matching_gpu"
    assert "arch=sm_90" in no_match.value.reason.message
    assert "2 arch_mismatch" in no_match.value.reason.message
    with pytest.raises(Unschedulable) as too_few:
        sched.submit(req("many", 1000, gpus=3), 0.0)
    assert too_few.value.reason.code == "too_few_gpus"
    assert len(sched.queue) == 0
    assert sched.counters["rejected"] == 3


def test_requests_wait_while_no_worker_is_registered() -> None:
    sched = Scheduler()
    sched.submit(req("early", 4000), 0.0)
    assert sched.decide(0.0).grants == ()
    assert sched.explain("early", 0.0).code == "no_workers"
    sched.put_worker(Worker("w1"), [gpu(0)])
    assert granted_ids(sched.decide(1.0)) == ["early"]


def test_insufficient_vram_reason_carries_the_figures() -> None:
    sched = scheduler(gpu(0, 24576), gpu(0, 16384, worker="w2"))
    grant_now(sched, req("a", 20000), 0.0)
    grant_now(sched, req("b", 14000), 0.0)
    sched.set_probe(G0, GpuProbe(used_mb=21000))
    sched.submit(req("wait", 8000), 1.0)
    sched.decide(1.0)
    reason = sched.explain("wait", 1.0)
    assert reason.code == "insufficient_vram"
    (verdict,) = reason.gpus  # both GPUs too full: the one nearest to taking it, and a count
    assert (str(verdict.gpu), verdict.count) == ("w1:0", 2)
    assert verdict.need_mb == 8000
    assert verdict.committed_mb == 20000
    assert verdict.observed_mb == 21000
    assert verdict.free_mb == 24576 - 21000  # more than w2:0's 16384 - 14000
    summary = "0/2 GPUs fit: 2 insufficient_vram (need 7.8 GiB, most free 3.5 GiB)"
    assert reason.message.startswith(f"{summary}; waiting for busy lease ")
    assert "not preemptible by normal (I5)" in reason.message  # equal priority, busy
    assert reason.as_dict()["code"] == "insufficient_vram"


def test_reason_is_paused_while_paused_and_nothing_is_granted() -> None:
    sched = scheduler(gpu(0))
    sched.pause()
    sched.submit(req("a", 1000), 0.0)
    assert sched.decide(0.0).grants == ()
    reason = sched.explain("a", 0.0)
    assert reason.code == "paused"
    assert "paused" in reason.message
    sched.resume()
    assert granted_ids(sched.decide(1.0)) == ["a"]


def test_pause_still_runs_timers() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 1000, ttl_s=10), 0.0)
    sched.submit(req("w", 1000, max_wait_s=5), 0.0)  # load gate is open, it would fit
    sched.pause()
    decisions = sched.decide(10.0)
    assert [lease.id for lease in decisions.expired] == ["a"]
    assert [r.id for r in decisions.timed_out] == ["w"]


def test_reason_for_a_draining_worker() -> None:
    sched = scheduler(gpu(0))
    sched.drain("w1", 0.0)
    sched.submit(req("a", 1000), 0.0)
    assert sched.decide(0.0).grants == ()
    reason = sched.explain("a", 0.0)
    assert reason.code == "workers_draining"
    assert "worker_drained" in reason.message or "worker_draining" in reason.message


def test_reason_when_the_probe_is_stale() -> None:
    sched = scheduler(gpu(0))
    sched.set_probe(G0, None)
    sched.submit(req("a", 1000), 0.0)
    assert sched.decide(0.0).grants == ()
    assert sched.explain("a", 0.0).code == "workers_draining"
    assert sched.explain("a", 0.0).gpus[0].code == "probe_stale"
    sched.set_probe(G0, GpuProbe(used_mb=0))
    assert granted_ids(sched.decide(1.0)) == ["a"]


def test_reason_is_queued_when_a_gpu_fits_before_the_next_cycle() -> None:
    sched = scheduler(gpu(0))
    sched.submit(req("a", 1000), 0.0)
    reason = sched.explain("a", 0.0)
    assert reason.code == "queued"


def test_explain_of_an_unknown_request() -> None:
    with pytest.raises(NotFound):
        scheduler(gpu(0)).explain("nope", 0.0)


# ---------------------------------------------------------------- TTL and waiting time


def test_a_lease_expires_when_its_ttl_lapses() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 8000, ttl_s=30), 0.0)
    assert sched.next_deadline() == 30.0
    assert sched.decide(29.9).expired == ()
    sched.renew("a", 20.0)
    assert sched.next_deadline() == 50.0
    assert sched.decide(30.0).expired == ()
    decisions = sched.decide(50.0)
    assert [(lease.id, lease.state) for lease in decisions.expired] == [("a", LeaseState.EXPIRED)]
    assert sched.figures(G0).committed_mb == 0
    assert sched.counters["expired"] == 1
    assert sched.next_deadline() is None


def test_a_revoking_lease_expires_too() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 8000, ttl_s=30), 0.0)
    sched.revoke("a", "admin", 1.0)
    assert [lease.id for lease in sched.decide(30.0).expired] == ["a"]


def test_a_request_times_out_after_max_wait_s() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("big", 24000), 0.0)
    sched.submit(req("w", 4000, max_wait_s=5), 1.0)
    assert sched.decide(1.0).grants == ()
    assert sched.next_deadline() == 6.0
    decisions = sched.decide(6.0)
    assert [r.id for r in decisions.timed_out] == ["w"]
    assert "w" not in sched.queue
    sched.release("big", 7.0)
    assert sched.decide(7.0).grants == ()
    assert sched.next_deadline() is None


def test_a_request_that_fits_when_its_wait_ends_is_granted() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("big", 24000), 0.0)
    sched.submit(req("w", 4000, max_wait_s=5), 1.0)
    sched.release("big", 6.0)
    decisions = sched.decide(6.0)
    assert granted_ids(decisions) == ["w"]
    assert decisions.timed_out == ()


def test_cancel_removes_a_pending_request() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("big", 24000), 0.0)
    sched.submit(req("w", 4000), 1.0)
    assert sched.cancel("w").id == "w"
    sched.release("big", 2.0)
    assert sched.decide(2.0).grants == ()
    with pytest.raises(NotFound):
        sched.cancel("w")


def test_duplicate_ids_conflict() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 1000), 0.0)
    with pytest.raises(Conflict):
        sched.submit(req("a", 1000), 1.0)
    sched.submit(req("b", 1000), 1.0)
    with pytest.raises(Conflict):
        sched.submit(req("b", 1000), 1.0)


# ---------------------------------------------------------------- workers (I7)


def test_graceful_drain_gives_nothing_new_and_ends_drained() -> None:
    sched = scheduler(gpu(0), gpu(0, worker="w2"))
    grant_now(sched, req("a", 20000, constraints=Constraints.build(worker="w1")), 0.0)
    assert sched.drain("w1", 1.0) == []
    assert sched.workers["w1"].status is WorkerStatus.DRAINING
    sched.submit(req("b", 1000), 1.0)
    (lease,) = sched.decide(1.0).grants
    assert lease.worker == "w2"
    sched.submit(req("pinned", 1000, constraints=Constraints.build(worker="w1")), 1.0)
    assert sched.decide(1.0).grants == ()
    assert sched.explain("pinned", 1.0).code == "workers_draining"
    assert sched.lease("a").state is LeaseState.ACTIVE  # graceful: the lease goes on
    sched.release("a", 2.0)
    decisions = sched.decide(2.0)
    assert decisions.workers == (("w1", WorkerStatus.DRAINING, WorkerStatus.DRAINED),)
    assert decisions.grants == ()
    assert sched.decide(3.0).workers == ()  # exactly one transition
    assert sched.cancel_drain("w1") is WorkerStatus.DRAINED
    assert granted_ids(sched.decide(4.0)) == ["pinned"]


def test_cancel_drain_keeps_the_leases() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 8000), 0.0)
    sched.drain("w1", 1.0)
    assert sched.cancel_drain("w1") is WorkerStatus.DRAINING
    assert sched.lease("a").state is LeaseState.ACTIVE
    assert sched.workers["w1"].status is WorkerStatus.ONLINE
    with pytest.raises(Conflict):
        sched.cancel_drain("w1")


def test_force_drain_revokes_every_lease_and_keeps_the_memory_until_they_stop() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 8000), 0.0)
    grant_now(sched, req("b", 8000), 0.0)
    revoked = sched.drain("w1", 1.0, force=True)
    assert sorted((lease.id, lease.revoke_reason) for lease in revoked) == [
        ("a", "drain"),
        ("b", "drain"),
    ]
    assert sched.decide(1.0).workers == ()
    assert sched.figures(G0).committed_mb == 16000
    sched.release("a", 2.0)
    sched.release("b", 2.0)
    assert sched.decide(2.0).workers == (("w1", WorkerStatus.DRAINING, WorkerStatus.DRAINED),)


def test_drain_deadline_revokes_what_is_left() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 8000), 0.0)
    sched.drain("w1", 1.0, deadline_s=60)
    assert sched.next_deadline() == 61.0
    decisions = sched.decide(61.0)
    assert [(lease.id, lease.revoke_reason) for lease in decisions.revocations] == [
        ("a", "drain_deadline")
    ]


def test_offline_worker_gets_no_grants_and_keeps_its_leases() -> None:
    sched = scheduler(gpu(0), gpu(0, worker="w2"))
    grant_now(sched, req("a", 8000, constraints=Constraints.build(worker="w1")), 0.0)
    assert sched.set_offline("w1", 1.0) == []
    assert sched.lease("a").state is LeaseState.ACTIVE
    assert sched.figures(G0).committed_mb == 8000
    sched.submit(req("b", 1000), 1.0)
    (lease,) = sched.decide(1.0).grants
    assert lease.worker == "w2"
    sched.submit(req("c", 1000, constraints=Constraints.build(worker="w1")), 1.0)
    assert sched.decide(1.0).grants == ()
    assert sched.explain("c", 1.0).gpus[0].code == "worker_offline"
    with pytest.raises(Conflict):
        sched.drain("w1", 2.0)


def test_a_draining_worker_that_goes_offline_has_its_drain_finished() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 8000), 0.0)
    sched.drain("w1", 1.0)
    revoked = sched.set_offline("w1", 2.0)
    assert [(lease.id, lease.revoke_reason) for lease in revoked] == [("a", "drain")]
    assert sched.workers["w1"].status is WorkerStatus.OFFLINE
    sched.release("a", 3.0)
    assert sched.decide(3.0).workers == ()  # offline stays offline
    assert sched.workers["w1"].status is WorkerStatus.OFFLINE


def test_remove_worker_is_refused_while_it_holds_leases() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 8000), 0.0)
    with pytest.raises(Conflict):
        sched.remove_worker("w1")
    sched.release("a", 1.0)
    sched.remove_worker("w1")
    assert sched.gpu_ids() == []


# ---------------------------------------------------------------- fencing tokens


def test_fencing_tokens_strictly_increase() -> None:
    sched = scheduler(gpu(0), policy=Policy(max_concurrent_loads=8))
    tokens = []
    for i in range(20):
        sched.submit(req(f"r{i}", 1000), float(i))
        for lease in sched.decide(float(i)).grants:
            tokens.append(lease.token)
            sched.ready(lease.id, float(i))
        if i % 3 == 0:
            sched.release(f"r{i}", float(i))
    assert len(tokens) == 20
    assert tokens == sorted(set(tokens))


def test_fencing_tokens_continue_after_a_restore() -> None:
    first = scheduler(gpu(0))
    grant_now(first, req("a", 1000), 0.0)
    lease = first.lease("a")
    second = scheduler(gpu(0))
    second.restore_lease(lease)
    second.submit(req("b", 1000), 1.0)
    (granted,) = second.decide(1.0).grants
    assert granted.token > lease.token


def test_a_lease_already_being_revoked_is_not_revoked_again_by_a_drain() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 8000), 0.0)
    grant_now(sched, req("b", 8000), 0.0)
    sched.revoke("a", "admin", 1.0)
    sched.drain("w1", 1.0, deadline_s=10)
    decisions = sched.decide(11.0)
    assert [(lease.id, lease.revoke_reason) for lease in decisions.revocations] == [
        ("b", "drain_deadline")
    ]
    assert sched.lease("a").revoke_reason == "admin"
    assert sched.drain("w1", 12.0, force=True) == []
    assert sched.set_offline("w1", 13.0) == []


def test_an_aged_lower_priority_request_does_not_take_memory_freed_for_a_preemptor() -> None:
    policy = Policy(aging_interval_s=10, aging_step=50, max_concurrent_loads=4)
    sched = scheduler(gpu(0), policy=policy)
    grant_now(sched, req("victim", 20000, priority="background"), 0.0)
    sched.submit(req("old", 16000, priority="background"), 0.0)  # cannot preempt an equal
    assert sched.decide(0.0).revocations == ()
    sched.submit(req("preemptor", 16000, priority="normal"), 100.0)
    assert [r.id for _, r, _ in sched.pending(100.0)] == ["old", "preemptor"]  # old aged to 799
    assert revoked_ids(sched.decide(100.0)) == ["victim"]
    sched.release("victim", 101.0)
    decisions = sched.decide(101.0)
    assert revoked_ids(decisions) == []  # no second preemption
    assert granted_ids(decisions) == ["preemptor"]


def test_a_lease_is_not_granted_and_revoked_in_the_same_cycle() -> None:
    policy = Policy(aging_interval_s=10, aging_step=50, max_concurrent_loads=4)
    sched = scheduler(gpu(0), policy=policy)
    sched.pause()
    sched.submit(req("aged_batch", 16000, priority="batch"), 0.0)
    sched.submit(req("normal", 16000, priority="normal"), 100.0)
    sched.resume()
    decisions = sched.decide(100.0)  # aged_batch is ahead: 100 + 10 x 50 = 600 > 500
    assert not set(granted_ids(decisions)) & set(revoked_ids(decisions))


def test_a_preemption_whose_worker_is_removed_is_forgotten() -> None:
    sched = scheduler(gpu(0), gpu(0, worker="w2"))
    on_w2 = Constraints.build(worker="w2")
    grant_now(sched, req("victim", 20000, priority="batch", constraints=on_w2), 0.0)
    sched.submit(req("preemptor", 16000, priority="interactive", constraints=on_w2), 1.0)
    assert revoked_ids(sched.decide(1.0)) == ["victim"]
    sched.release("victim", 2.0)
    sched.set_offline("w2", 2.0)
    sched.remove_worker("w2")
    decisions = sched.decide(3.0)  # the nomination's GPU is gone: no crash, nothing granted
    assert granted_ids(decisions) == []
    # only w2 could ever take it: it ends as a new request for w2 would
    assert [(r.id, why.code) for r, why in decisions.rejected] == [("preemptor", "no_matching_gpu")]
    assert "preemptor" not in sched.queue


def test_memory_of_a_lease_that_expires_in_the_cycle_is_granted_only_once_the_probe_shows_it() -> (
    None
):
    """The plan ends the lease and places in the same walk: the memory it leaves counts as
    used for as long as the latest probe shows it (I2, I4), exactly as after a release."""
    sched = scheduler(gpu(0, 24 * 1024))
    grant_now(sched, req("old", 16 * 1024, ttl_s=20.0), 0.0)
    sched.set_probe(G0, GpuProbe(used_mb=16 * 1024))
    sched.submit(req("new", 16 * 1024), 1.0)
    assert sched.decide(1.0).grants == ()
    decided = sched.decide(30.0)
    assert [lease.id for lease in decided.expired] == ["old"]
    assert decided.grants == ()  # the probe still shows the old process's 16 GiB
    sched.set_probe(G0, GpuProbe(used_mb=0))
    assert granted_ids(sched.decide(31.0)) == ["new"]
