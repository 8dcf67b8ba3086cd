"""Every wait ends and every bound holds: revoked holders that renew, supervised leases
whose TTL lapses, clusters that shrink under pending requests and leases."""

from __future__ import annotations

import pytest

from gpu_arbiter.core import Conflict, Constraints, LeaseState, Policy, Scheduler, Worker
from tests.core.support import gid, gpu, grant_now, granted_ids, req, revoked_ids, scheduler

G0 = gid("w1:0")


def _preempted(policy: Policy) -> Scheduler:
    sched = scheduler(gpu(0), policy=policy)
    grant_now(sched, req("victim", 20000, priority="batch", ttl_s=30), 0.0)
    sched.submit(req("urgent", 16000, priority="interactive"), 1.0)
    assert revoked_ids(sched.decide(1.0)) == ["victim"]
    return sched


# ---------------------------------------------------------------- a revoked holder that renews


def test_a_revoked_lease_renews_only_within_its_grace_and_never_past_grace_plus_ttl() -> None:
    sched = _preempted(Policy(grace_s=10.0))
    assert sched.lease("victim").revoked_at == 1.0
    assert sched.renew("victim", 9.0).expires_at == 39.0  # within its grace: as usual
    renewed = sched.renew("victim", 10.0, 100.0)
    assert renewed.expires_at == 1.0 + 10.0 + 30.0  # not 10 + 100: grace + TTL at most
    with pytest.raises(Conflict, match="grace of 10 s is over") as refused:
        sched.renew("victim", 11.5)
    assert refused.value.details["reason"] == "revoked_past_grace"
    assert sched.decide(40.9).grants == ()
    decisions = sched.decide(41.0)
    assert [lease.id for lease in decisions.expired] == ["victim"]
    assert granted_ids(decisions) == ["urgent"]


def test_revocation_cuts_an_expiry_renewed_far_ahead_to_grace_plus_ttl() -> None:
    sched = scheduler(gpu(0), policy=Policy(grace_s=5.0))
    grant_now(sched, req("victim", 20000, priority="batch", ttl_s=30), 0.0)
    sched.renew("victim", 0.0, 86400.0)
    sched.submit(req("urgent", 16000, priority="interactive"), 1.0)
    assert revoked_ids(sched.decide(1.0)) == ["victim"]
    assert sched.lease("victim").expires_at == 36.0
    assert sched.next_deadline() == 36.0


def test_the_preemptors_reason_names_a_victim_that_ignores_its_revocation() -> None:
    sched = _preempted(Policy(grace_s=10.0))
    early = sched.explain("urgent", 5.0)
    assert early.code == "preempting" and early.blocked_by is None
    assert "lease victim was preempted 4.0s ago; 6.0s of its 10s grace left to stop" in (
        early.message
    )
    assert early.blocker is not None and early.blocker.kind == "revoking"
    assert (early.blocker.id, early.blocker.since, early.blocker.until) == ("victim", 1.0, 11.0)
    late = sched.explain("urgent", 25.0)
    assert late.code == "preempting"
    assert late.blocked_by == "victim"
    assert "lease victim has ignored its revocation for 24s (grace 10s)" in late.message
    assert sched.overdue_revocations(25.0) == [("victim", 24.0)]


# ---------------------------------------------------------------- a supervised lease's TTL


def test_a_supervised_lease_whose_ttl_lapses_is_revoked_and_keeps_its_memory() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 20000, ttl_s=30), 0.0)
    sched.set_supervised("a", True, 1.0)
    sched.submit(req("b", 16000), 2.0)
    decisions = sched.decide(30.0)
    assert decisions.expired == ()
    assert [(lease.id, lease.revoke_reason) for lease in decisions.revocations] == [
        ("a", "ttl_lapsed")
    ]
    assert sched.lease("a").state is LeaseState.REVOKING
    assert sched.figures(G0).committed_mb == 20000  # I4: until the agent confirms
    assert sched.decide(300.0).grants == ()
    sched.release("a", 301.0)  # the agent saw the process exit
    assert granted_ids(sched.decide(301.0)) == ["b"]


def test_a_lease_no_longer_supervised_expires_once_its_ttl_has_lapsed() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 20000, ttl_s=30), 0.0)
    sched.set_supervised("a", True, 1.0)
    assert revoked_ids(sched.decide(30.0)) == ["a"]
    sched.set_supervised("a", False, 40.0)  # its agent no longer knows the process
    assert [lease.id for lease in sched.decide(40.0).expired] == ["a"]


def test_an_unsupervised_lease_still_expires_at_its_ttl() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 20000, ttl_s=30), 0.0)
    assert [lease.id for lease in sched.decide(30.0).expired] == ["a"]
    assert sched.figures(G0).committed_mb == 0


# ---------------------------------------------------------------- the cluster shrinks


def test_pending_requests_for_a_removed_worker_are_rejected() -> None:
    sched = scheduler(gpu(0), gpu(0, worker="w2"))
    grant_now(sched, req("big", 24000, constraints=Constraints.build(worker="w2")), 0.0)
    sched.submit(req("for-w2", 8000, constraints=Constraints.build(worker="w2")), 1.0)
    sched.submit(req("anywhere", 8000), 1.0)
    sched.release("big", 2.0)
    sched.remove_worker("w2")
    decisions = sched.decide(2.0)
    assert [(r.id, why.code) for r, why in decisions.rejected] == [("for-w2", "no_matching_gpu")]
    assert "worker=w2" in decisions.rejected[0][1].message
    assert granted_ids(decisions) == ["anywhere"]
    assert sched.counters["rejected"] == 1


def test_a_gpu_registered_again_smaller_rejects_what_it_can_no_longer_hold() -> None:
    sched = scheduler(gpu(0, total_mb=24576))
    grant_now(sched, req("a", 20000), 0.0)
    sched.submit(req("too-big-now", 16000), 1.0)
    sched.submit(req("still-fits", 4000), 1.0)
    sched.decide(1.0)
    sched.put_worker(Worker("w1"), [gpu(0, total_mb=8192)])
    decisions = sched.decide(2.0)
    assert [(r.id, why.code) for r, why in decisions.rejected] == [("too-big-now", "too_large")]
    assert "still-fits" in sched.queue


def test_changed_labels_reject_what_no_longer_matches() -> None:
    sched = scheduler(gpu(0), labels={"w1": {"zone": "a"}})
    grant_now(sched, req("a", 24000), 0.0)
    sched.submit(req("zone-a", 1000, constraints=Constraints.build(labels={"zone": "a"})), 1.0)
    sched.decide(1.0)
    sched.put_worker(Worker("w1", labels={"zone": "b"}), [gpu(0)])
    assert [r.id for r, _ in sched.decide(2.0).rejected] == ["zone-a"]


def test_with_no_worker_left_pending_requests_wait_for_one() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 24000), 0.0)
    sched.submit(req("b", 8000), 1.0)
    sched.release("a", 2.0)
    sched.remove_worker("w1")
    assert sched.decide(2.0).rejected == ()
    assert sched.explain("b", 2.0).code == "no_workers"


def test_unchanged_registration_rechecks_nothing() -> None:
    sched = scheduler(gpu(0))
    grant_now(sched, req("a", 24000), 0.0)
    sched.submit(req("b", 8000), 1.0)
    sched.decide(1.0)
    sched.put_worker(Worker("w1"), [gpu(0)])
    assert not sched.reshaped  # the heartbeat-rate path stays cheap


# ---------------------------------------------------------------- a GPU shrunk under its leases


def test_a_gpu_shrunk_under_its_leases_is_over_committed_never_negative() -> None:
    sched = scheduler(gpu(0, total_mb=24576))
    grant_now(sched, req("a", 20480), 0.0)
    sched.put_worker(Worker("w1"), [gpu(0, total_mb=8192)])
    figures = sched.figures(G0)
    assert figures.free_mb == 0
    assert figures.overcommitted_mb == 20480 - 8192
    sched.submit(req("small", 1000), 1.0)
    assert sched.decide(1.0).grants == ()  # no grant until it is back under capacity
    reason = sched.explain("small", 1.0)
    assert reason.code == "insufficient_vram"
    assert all(v.free_mb >= 0 for v in reason.gpus)
    sched.release("a", 2.0)
    assert granted_ids(sched.decide(2.0)) == ["small"]
    assert sched.figures(G0).overcommitted_mb == 0
