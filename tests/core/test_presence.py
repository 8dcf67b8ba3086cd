"""I8's dual in the core, on a virtual clock: a pending request whose asker is gone ends
within its ``ttl_s``, and a grant nobody takes up is given back within its claim bound,
shorter than its TTL (see ``core.presence``)."""

from __future__ import annotations

import pytest

from gpu_arbiter.core import GpuProbe, LeaseState, Policy, Scheduler, Worker, evolve

from .support import GiB, gid, gpu, granted_ids, req


def service(total_mb: int = 24 * GiB, policy: Policy | None = None) -> Scheduler:
    """A scheduler whose askers must show up (the controller's), one GPU."""
    sched = Scheduler(policy or Policy(), presence=True)
    sched.put_worker(Worker("w1"), [gpu(0, total_mb)])
    return sched


def held(sched: Scheduler, request_id: str, now: float) -> None:
    """``request_id`` granted and taken up: its holder renewed it."""
    sched.submit(req(request_id, 20 * GiB), now)
    assert request_id in granted_ids(sched.decide(now))
    sched.renew(request_id, now)


def test_a_pending_request_unseen_for_its_ttl_is_abandoned_at_that_bound() -> None:
    sched = service()
    held(sched, "big", 0.0)
    sched.submit(req("waits", 20 * GiB, ttl_s=30.0), 1.0)
    assert sched.next_deadline() == 31.0
    assert not sched.decide(30.9).abandoned
    decisions = sched.decide(31.0)
    assert [r.id for r in decisions.abandoned] == ["waits"]
    assert "waits" not in sched.queue
    assert sched.counters["abandoned"] == 1


def test_a_long_poll_keeps_its_request_for_as_long_as_it_is_open_and_ttl_after() -> None:
    sched = service()
    held(sched, "big", 0.0)
    sched.submit(req("waits", 20 * GiB, ttl_s=30.0), 0.0)
    sched.watch("waits")
    assert not sched.decide(100.0).abandoned  # open all along: present
    sched.unwatch("waits", 100.0)
    assert sched.next_deadline() == 130.0
    sched.seen("waits", 120.0)  # a renew, another answer: seen again
    assert not sched.decide(130.0).abandoned
    assert [r.id for r in sched.decide(150.0).abandoned] == ["waits"]


def test_two_open_long_polls_keep_it_until_both_closed() -> None:
    sched = service()
    held(sched, "big", 0.0)
    sched.submit(req("waits", 20 * GiB, ttl_s=10.0), 0.0)
    sched.watch("waits")
    sched.watch("waits")
    sched.unwatch("waits", 5.0)
    assert not sched.decide(50.0).abandoned
    sched.unwatch("waits", 50.0)
    assert [r.id for r in sched.decide(60.0).abandoned] == ["waits"]


def test_a_request_without_ttl_or_without_presence_is_never_abandoned() -> None:
    sched = service()
    held(sched, "big", 0.0)
    sched.submit(req("no-ttl", 20 * GiB), 0.0)
    assert not sched.decide(10_000.0).abandoned
    in_process = Scheduler(Policy())
    in_process.put_worker(Worker("w1"), [gpu(0, 24 * GiB)])
    in_process.submit(req("big", 20 * GiB, ttl_s=None), 0.0)
    in_process.decide(0.0)
    in_process.submit(req("waits", 20 * GiB, ttl_s=30.0), 0.0)
    assert not in_process.decide(10_000.0).abandoned
    assert "waits" in in_process.queue


def test_a_grant_not_taken_up_is_given_back_within_a_third_of_its_ttl() -> None:
    """The issue's case: the asker is gone, the grant holds the memory and the load gate
    until someone notices; it is given back at min(claim_s, ttl_s / 3), and the next
    request is granted in the same cycle."""
    sched = service()
    sched.submit(req("orphan", 8 * GiB, ttl_s=15.0), 0.0)
    (lease,) = sched.decide(0.0).grants
    assert not lease.claimed and sched.leases["orphan"].loading
    sched.submit(req("next", 20 * GiB, ttl_s=15.0), 1.0)
    sched.watch("next")
    assert not sched.decide(1.0).grants  # the load gate, and the memory, are taken
    assert sched.next_deadline() == 5.0  # 15 / 3 < claim_s (10)
    decisions = sched.decide(5.0)
    assert [lease.id for lease in decisions.unclaimed] == ["orphan"]
    assert decisions.unclaimed[0].state is LeaseState.RELEASED
    assert granted_ids(decisions) == ["next"]
    assert sched.leases["next"].claimed  # its asker was watching: the grant is its answer


def test_the_claim_bound_is_claim_s_when_a_third_of_the_ttl_is_longer() -> None:
    sched = service(policy=Policy(claim_s=4.0))
    sched.submit(req("orphan", 8 * GiB, ttl_s=60.0), 0.0)
    sched.decide(0.0)
    assert sched.next_deadline() == 4.0
    assert [lease.id for lease in sched.decide(4.0).unclaimed] == ["orphan"]


@pytest.mark.parametrize("verb", ["renew", "ready", "idle", "shrink", "supervised", "read"])
def test_each_verb_of_its_holder_takes_a_grant_up(verb: str) -> None:
    sched = service()
    sched.submit(req("l1", 8 * GiB, ttl_s=30.0), 0.0)
    sched.decide(0.0)
    if verb == "renew":
        sched.renew("l1", 1.0)
    elif verb == "ready":
        sched.ready("l1", 1.0)
    elif verb == "idle":
        sched.set_idle("l1", True, 1.0)
    elif verb == "shrink":
        sched.shrink("l1", 4 * GiB, 1.0)
    elif verb == "supervised":  # an agent reports its process: it has a holder (I4)
        sched.set_supervised("l1", True, 1.0)
    else:
        sched.claim("l1")
    assert sched.leases["l1"].claimed
    decisions = sched.decide(10.0)
    assert not decisions.unclaimed
    assert "l1" in sched.leases


def test_a_refused_shrink_takes_nothing_up() -> None:
    sched = service()
    sched.submit(req("l1", 8 * GiB, ttl_s=30.0), 0.0)
    sched.decide(0.0)
    with pytest.raises(Exception, match="vram_mb"):
        sched.shrink("l1", 0, 1.0)
    assert not sched.leases["l1"].claimed


def test_a_revoked_grant_nobody_took_up_is_given_back_too() -> None:
    """Preempted before its holder took it up: there is no process to wait for (I4)."""
    sched = service()
    sched.submit(req("low", 8 * GiB, ttl_s=30.0, priority="batch"), 0.0)
    sched.decide(0.0)
    sched.revoke("low", "preempted", 1.0)
    decisions = sched.decide(10.0)
    assert [lease.id for lease in decisions.unclaimed] == ["low"]
    assert sched.ledger.committed_mb(gid("w1:0")) == 0


def test_a_restart_gives_every_pending_request_and_unclaimed_grant_a_whole_bound() -> None:
    """Restored at 1000 (long after they were last seen), nothing ends at once: each
    pending request has its ttl_s from the restart, each unclaimed grant its claim bound."""
    before = service()
    before.submit(req("orphan", 8 * GiB, ttl_s=30.0), 0.0)
    (lease,) = before.decide(0.0).grants
    waiting = before.submit(req("waits", 20 * GiB, ttl_s=30.0), 0.0)
    after = service()
    after.set_probe(gid("w1:0"), GpuProbe(used_mb=0))
    after.restore_lease(evolve(lease, expires_at=1030.0), 1000.0)  # as the controller does
    after.submit(waiting, 1000.0)
    at_restart = after.decide(1000.0)
    assert not (at_restart.unclaimed or at_restart.abandoned or at_restart.expired)
    assert "orphan" in after.leases and "waits" in after.queue
    assert after.next_deadline() == 1010.0
    decisions = after.decide(1010.0)
    assert [lease.id for lease in decisions.unclaimed] == ["orphan"]
    assert granted_ids(decisions) == ["waits"]
    assert not after.leases["waits"].claimed  # granted while nobody watched
    after.submit(req("third", 20 * GiB, ttl_s=30.0), 1011.0)
    assert [r.id for r in after.decide(1041.0).abandoned] == ["third"]
