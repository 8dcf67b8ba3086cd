"""Victim selection (I5), seen through the scheduler's decisions."""

from __future__ import annotations

from typing import Any

from gpu_arbiter.core import Constraints, LeaseState, Policy, Scheduler
from tests.core.support import gpu, grant_now, granted_ids, req, revoked_ids, scheduler


def _with_leases(
    *leases: tuple[str, int, dict[str, Any]], policy: Policy | None = None
) -> Scheduler:
    """One 24576 MiB GPU holding ``leases`` (id, MiB, request fields), granted at t = 0, 1, ..."""
    sched = scheduler(gpu(0, 24576), policy=policy)
    for at, (lease_id, mb, fields) in enumerate(leases):
        grant_now(sched, req(lease_id, mb, **fields), float(at))
    return sched


def _preempt(sched: Scheduler, mb: int, now: float = 100.0, **fields: Any) -> list[str]:
    sched.submit(req("p", mb, **fields), now)
    decisions = sched.decide(now)
    assert granted_ids(decisions) == []
    return sorted(revoked_ids(decisions))


BATCH = {"priority": "batch"}


def test_fewest_victims() -> None:
    sched = _with_leases(("a", 6000, BATCH), ("b", 6000, BATCH), ("big", 12000, BATCH))
    assert _preempt(sched, 12000) == ["big"]


def test_the_victims_together_free_enough() -> None:
    sched = _with_leases(("a", 8000, BATCH), ("b", 8000, BATCH), ("c", 8000, BATCH))
    victims = _preempt(sched, 16000)
    assert len(victims) == 2
    free = sched.figures(sched.gpu_ids()[0]).free_mb
    freed = sum(sched.leases[v].vram_mb for v in victims)
    assert free + freed >= 16000


def test_lowest_priority_first() -> None:
    sched = _with_leases(("bg", 12000, {"priority": "background"}), ("batch", 12000, BATCH))
    assert _preempt(sched, 10000) == ["batch"]


def test_youngest_among_equals() -> None:
    sched = _with_leases(("old", 12000, BATCH), ("young", 12000, BATCH))
    assert _preempt(sched, 10000) == ["young"]


def test_lower_priority_goes_first_whatever_work_it_loses() -> None:
    # a 4-GPU run of 100 s (400 GPU-seconds) before a 1-GPU run of 10 s of higher priority
    sched = scheduler(*(gpu(i, 24576) for i in range(5)))
    grant_now(sched, req("finetune", 20000, priority="batch", gpus=4), 0.0)
    grant_now(sched, req("solo", 20000, priority="background"), 90.0)
    assert _preempt(sched, 10000) == ["finetune"]


def _behind_a_load() -> Scheduler:
    """gpu 0: a busy ``batch`` run, 4576 MiB free; gpu 1: 14576 MiB free, its load gate
    taken by a lease nobody below ``normal`` may revoke."""
    sched = scheduler(gpu(0, 24576), gpu(1, 24576))
    grant_now(sched, req("run", 20000, priority="batch"), 0.0)
    grant_now(sched, req("loader", 10000), 1.0, ready=False)
    g0, g1 = sched.gpu_ids()
    assert sched.lease("run").gpus == (g0,) and sched.lease("loader").gpus == (g1,)
    return sched


def test_a_request_that_fits_behind_a_load_gate_waits_instead_of_preempting() -> None:
    sched = _behind_a_load()
    assert _preempt(sched, 10000, now=10.0) == []
    assert sched.explain("p", 10.0).code == "load_in_progress"
    sched.ready("loader", 20.0)
    decisions = sched.decide(20.0)
    assert granted_ids(decisions) == ["p"]
    assert decisions.grants[0].gpus == (sched.gpu_ids()[1],)


def test_memory_behind_a_load_gate_held_by_a_request_ahead_is_not_room_for_the_next() -> None:
    # "a" waits for the gate and holds what gpu 1 has free: "b" could only wait for a's run
    sched = _behind_a_load()
    sched.submit(req("a", 10000), 10.0)
    sched.submit(req("b", 10000), 10.0)
    decisions = sched.decide(10.0)
    assert granted_ids(decisions) == []
    assert revoked_ids(decisions) == ["run"]
    assert sched.leases["run"].preempted_for == "b"


def test_revoked_leases_keep_their_memory_and_state() -> None:
    sched = _with_leases(("a", 20000, BATCH))
    assert _preempt(sched, 10000) == ["a"]
    lease = sched.lease("a")
    assert lease.state is LeaseState.REVOKING
    assert lease.revoke_reason == "preempted"
    assert lease.preempted_for == "p"
    assert sched.figures(lease.gpus[0]).committed_mb == 20000


def test_idle_leases_go_first_least_recently_used() -> None:
    sched = _with_leases(
        ("busy_batch", 8000, BATCH), ("warm_recent", 8000, {}), ("warm_old", 8000, {})
    )
    sched.set_idle("warm_old", True, 10.0)
    sched.set_idle("warm_recent", True, 20.0)
    assert _preempt(sched, 8000, priority="normal") == ["warm_old"]


def test_idle_leases_go_before_lower_priority_busy_ones() -> None:
    sched = _with_leases(("busy_batch", 12000, BATCH), ("warm", 12000, {"priority": "background"}))
    sched.set_idle("warm", True, 5.0)
    assert _preempt(sched, 10000, priority="normal") == ["warm"]


def test_equal_priority_reclaims_an_idle_lease() -> None:
    sched = _with_leases(("warm", 20000, {}))
    sched.set_idle("warm", True, 5.0)
    assert _preempt(sched, 10000, priority="normal") == ["warm"]


def test_equal_priority_never_preempts_a_busy_lease() -> None:
    sched = _with_leases(("busy", 20000, {}))
    assert _preempt(sched, 10000, priority="normal") == []
    sched.set_idle("busy", True, 50.0)
    sched.set_idle("busy", False, 60.0)  # busy again
    assert sched.decide(100.0).revocations == ()


def test_lower_priority_never_reclaims_an_idle_lease() -> None:
    """... before ``idle_reclaim_s`` (60 s by default): idle 25 s here."""
    sched = _with_leases(("warm", 20000, {}))
    sched.set_idle("warm", True, 5.0)
    assert _preempt(sched, 10000, now=30.0, priority="background") == []


def test_busy_non_preemptible_leases_are_never_victims() -> None:
    sched = _with_leases(("pinned", 20000, {"priority": "batch", "preemptible": False}))
    assert _preempt(sched, 10000, priority="critical") == []


def test_idle_marks_consent_to_reclaim_even_when_not_preemptible() -> None:
    sched = _with_leases(("warm", 20000, {"priority": "interactive", "preemptible": False}))
    sched.submit(req("lower", 10000, priority="normal"), 100.0)
    sched.submit(req("equal", 10000, priority="interactive"), 100.0)
    assert sched.decide(100.0).revocations == ()  # busy: neither may preempt it
    sched.set_idle("warm", True, 101.0)
    decisions = sched.decide(102.0)
    assert revoked_ids(decisions) == ["warm"]
    assert decisions.revocations[0].preempted_for == "equal"  # lower priority never reclaims


def test_aging_gives_no_preemption_rights() -> None:
    policy = Policy(aging_interval_s=1, aging_step=100)
    sched = _with_leases(("batch", 20000, BATCH), policy=policy)
    sched.submit(req("aged", 10000, priority="batch"), 0.0)
    decisions = sched.decide(10_000.0)  # aged to the cap long ago
    assert decisions.revocations == ()
    assert decisions.grants == ()


def test_young_leases_are_spared_by_preempt_exempt_s() -> None:
    sched = _with_leases(("young", 20000, BATCH), policy=Policy(preempt_exempt_s=60))
    assert _preempt(sched, 10000, now=10.0) == []
    deadline = sched.next_deadline()
    assert deadline is not None
    assert deadline <= 60.0  # the scheduler wakes itself when the lease comes of age
    assert revoked_ids(sched.decide(60.0)) == ["young"]


def test_idle_leases_are_not_spared_by_preempt_exempt_s() -> None:
    sched = _with_leases(("young", 20000, {}), policy=Policy(preempt_exempt_s=60))
    sched.set_idle("young", True, 1.0)
    assert _preempt(sched, 10000, now=2.0) == ["young"]


def test_no_revocation_that_cannot_free_enough() -> None:
    sched = _with_leases(("pinned", 16000, {"preemptible": False}), ("batch", 4000, BATCH))
    assert _preempt(sched, 12000, priority="critical") == []
    reason = sched.explain("p", 100.0)
    assert reason.code == "insufficient_vram"


def test_no_revocation_when_the_probe_shows_the_memory_is_used_by_strangers() -> None:
    from gpu_arbiter.core import GpuProbe

    sched = _with_leases(("batch", 8000, BATCH))
    g0 = sched.gpu_ids()[0]
    sched.set_probe(g0, GpuProbe(used_mb=8000 + 14000))  # 14000 MiB we know nothing about
    assert _preempt(sched, 12000, priority="critical") == []


def test_a_plan_spans_the_gpus_of_one_worker() -> None:
    sched = scheduler(gpu(0, 24576), gpu(1, 24576))
    grant_now(sched, req("a", 20000, priority="batch"), 0.0)
    grant_now(sched, req("b", 20000, priority="batch"), 1.0)
    sched.submit(req("p", 10000, gpus=2), 2.0)
    decisions = sched.decide(2.0)
    assert sorted(revoked_ids(decisions)) == ["a", "b"]


def test_preemption_does_not_repeat_while_victims_stop() -> None:
    sched = _with_leases(("a", 20000, BATCH), ("b", 4000, BATCH))
    assert _preempt(sched, 10000) == ["a"]
    for now in (101.0, 102.0, 103.0):
        assert sched.decide(now).revocations == ()
    assert sched.explain("p", 103.0).code == "preempting"
    sched.release("a", 104.0)
    assert granted_ids(sched.decide(104.0)) == ["p"]
    assert "b" in sched.leases
    assert sched.leases["b"].state is LeaseState.ACTIVE


# ---------------------------------------------------------------- idle memory is a cache

NEVER = float("inf")


def test_lower_priority_reclaims_an_idle_lease_once_idle_reclaim_s_passed() -> None:
    policy = Policy(idle_reclaim_s=60, starvation_s=NEVER)
    sched = _with_leases(("warm", 20000, {"priority": "interactive"}), policy=policy)
    sched.set_idle("warm", True, 5.0)
    assert _preempt(sched, 10000, now=30.0, priority="batch") == []
    assert sched.next_deadline() == 65.0  # the scheduler wakes itself when it may reclaim
    assert revoked_ids(sched.decide(65.0)) == ["warm"]


def test_idle_leases_are_reclaimed_least_recently_used_first_whatever_their_priority() -> None:
    policy = Policy(idle_reclaim_s=60, starvation_s=NEVER)
    sched = _with_leases(
        ("critical_old", 12000, {"priority": "critical"}),
        ("batch_recent", 12000, BATCH),
        policy=policy,
    )
    sched.set_idle("critical_old", True, 2.0)
    sched.set_idle("batch_recent", True, 3.0)
    assert _preempt(sched, 10000, now=100.0, priority="batch") == ["critical_old"]


def test_idle_reclaim_never_takes_a_busy_lease() -> None:
    policy = Policy(idle_reclaim_s=0, starvation_s=0)
    sched = _with_leases(("busy", 20000, {"priority": "normal"}), policy=policy)
    sched.set_idle("busy", True, 1.0)
    sched.set_idle("busy", False, 2.0)
    assert _preempt(sched, 10000, now=10_000.0, priority="batch") == []
    assert sched.decide(20_000.0).revocations == ()


def test_a_starving_request_reclaims_any_idle_lease() -> None:
    policy = Policy(idle_reclaim_s=NEVER, starvation_s=100)
    sched = _with_leases(("warm", 20000, {"priority": "interactive"}), policy=policy)
    sched.set_idle("warm", True, 1.0)
    assert _preempt(sched, 10000, now=10.0, priority="batch") == []
    assert sched.next_deadline() == 110.0
    decisions = sched.decide(110.0)
    assert revoked_ids(decisions) == ["warm"]
    assert decisions.revocations[0].preempted_for == "p"


def test_starvation_gives_no_rights_over_busy_work() -> None:
    policy = Policy(idle_reclaim_s=0, starvation_s=0)
    sched = _with_leases(("busy", 20000, {"priority": "normal"}), policy=policy)
    assert _preempt(sched, 10000, now=10.0, priority="batch") == []
    assert sched.decide(100_000.0).revocations == ()


def test_busy_work_is_preempted_only_for_a_request_that_waited_preempt_patience_s() -> None:
    sched = _with_leases(("job", 20000, BATCH), policy=Policy(preempt_patience_s=30))
    assert _preempt(sched, 10000, now=100.0, priority="interactive") == []
    assert sched.next_deadline() == 130.0
    assert revoked_ids(sched.decide(129.0)) == []
    assert revoked_ids(sched.decide(130.0)) == ["job"]


def test_preempt_patience_s_does_not_delay_reclaiming_idle_leases() -> None:
    sched = _with_leases(("warm", 20000, BATCH), policy=Policy(preempt_patience_s=30))
    sched.set_idle("warm", True, 50.0)
    assert _preempt(sched, 10000, now=100.0, priority="interactive") == ["warm"]


def test_a_release_before_the_patience_ends_means_no_preemption() -> None:
    sched = _with_leases(("job", 20000, BATCH), policy=Policy(preempt_patience_s=30))
    assert _preempt(sched, 10000, now=100.0, priority="interactive") == []
    sched.release("job", 110.0)
    assert granted_ids(sched.decide(110.0)) == ["p"]
    assert sched.decide(130.0).revocations == ()


def _never_preempt(*lease_ids: str) -> dict[str, Any]:
    return {"constraints": Constraints.build(never_preempt=list(lease_ids))}


def test_a_lease_named_never_preempt_is_not_a_victim_busy_or_idle() -> None:
    """A wake's lease of the difference names the sleeping lease it extends: a higher
    priority caller's wake never revokes the very process it wakes."""
    sched = _with_leases(("asleep", 12000, BATCH), ("other", 12000, BATCH))
    assert _preempt(sched, 10000, **_never_preempt("other")) == ["asleep"]
    sched = _with_leases(("asleep", 12000, BATCH), ("other", 12000, BATCH))
    sched.set_idle("asleep", True, 5.0)
    assert _preempt(sched, 10000, **_never_preempt("asleep")) == ["other"]


def test_a_request_that_may_take_nothing_else_waits() -> None:
    sched = _with_leases(("asleep", 20000, BATCH))
    sched.set_idle("asleep", True, 5.0)
    sched.submit(req("p", 10000, **_never_preempt("asleep")), 100.0)
    decisions = sched.decide(100.0)
    assert granted_ids(decisions) == [] and revoked_ids(decisions) == []
    assert sched.lease("asleep").state is LeaseState.ACTIVE
    assert _preempt(_with_leases(("asleep", 20000, BATCH)), 10000) == ["asleep"]  # unnamed
