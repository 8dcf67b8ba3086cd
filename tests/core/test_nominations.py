"""The holds of a cycle (I6) and the preemptors' nominations, alone."""

from __future__ import annotations

from gpu_arbiter.core import GpuProbe, Lease, LeaseState
from gpu_arbiter.core.ledger import Ledger
from gpu_arbiter.core.nominations import Holds, Nomination
from gpu_arbiter.core.verify import check_plan

from .support import GiB, gid, gpu, grant_now, req, scheduler

A, B = gid("w1:0"), gid("w1:1")


def test_a_hold_leaves_the_requests_behind_only_what_is_beyond_it() -> None:
    holds = Holds()
    holds.hold(req("big", 20 * GiB), (A,))
    holds.hold(req("next", 8 * GiB), (A, B))
    assert holds.held_mb(A) == 28 * GiB and holds.held_mb(B) == 8 * GiB
    assert holds.journal == [("big", (A,), 20 * GiB), ("next", (A, B), 8 * GiB)]


def test_a_preemptors_own_hold_is_lifted_for_its_turn_for_good() -> None:
    holds = Holds()
    preemptor = req("chat", 16 * GiB, priority="interactive")
    holds.prehold(preemptor, (A,))
    assert holds.held_mb(A) == 16 * GiB and list(holds.preheld) == ["chat"]
    preheld, lifted = holds.turn(preemptor)
    assert preheld and lifted == []
    holds.end_turn(lifted)
    assert holds.held_mb(A) == 0 and list(holds.preheld) == []


def test_a_lower_preemptors_hold_is_lifted_only_during_a_higher_requests_turn() -> None:
    holds = Holds()
    holds.prehold(req("normal-preemptor", 16 * GiB, priority="normal"), (A,))
    preheld, lifted = holds.turn(req("critical", 4 * GiB, priority="critical"))
    assert not preheld and holds.held_mb(A) == 0  # it could preempt the preemptor anyway
    holds.end_turn(lifted)
    assert holds.held_mb(A) == 16 * GiB
    _, lifted = holds.turn(req("peer", 4 * GiB, priority="normal"))  # no more rights
    assert lifted == [] and holds.held_mb(A) == 16 * GiB


def test_memory_pre_held_for_a_preemptor_is_not_claimed_again_by_a_nomination() -> None:
    holds = Holds()
    holds.prehold(req("chat", 16 * GiB, priority="interactive"), (A,))
    holds.hold(req("batch", 8 * GiB, priority="batch"), (A, B))
    assert holds.held_mb(A) == 16 * GiB  # A stays the preemptor's
    assert holds.held_mb(B) == 8 * GiB
    assert holds.journal[-1] == ("batch", (B,), 8 * GiB)
    holds.hold(req("critical", 8 * GiB, priority="critical"), (A,))
    assert holds.held_mb(A) == 24 * GiB  # a request of higher base priority may hold it
    holds.hold(req("batch-own", 8 * GiB, priority="batch"), (A,), own=True)
    assert holds.held_mb(A) == 32 * GiB  # what its own preemption frees is always held


def _lease(lease_id: str, on: tuple[int, ...]) -> Lease:
    return Lease(
        request=req(lease_id, 4 * GiB),
        gpus=tuple(gid(f"w1:{i}") for i in on),
        token=1,
        state=LeaseState.REVOKING,
        granted_at=0.0,
        expires_at=60.0,
        load_deadline=0.0,
    )


def test_a_nomination_holds_until_its_victims_end_and_the_probe_shows_it() -> None:
    ledger = Ledger()
    ledger.put_gpu(gpu(0))
    ledger.put_gpu(gpu(1))
    ledger.set_probe(A, GpuProbe(used_mb=8 * GiB))
    victim, other = _lease("victim", (0,)), _lease("other", (1,))
    ledger.commit(victim)
    nomination = Nomination((A,), {"victim"})
    assert nomination.preempting(ledger)
    nomination.victim_ended("other", ledger)  # not its victim: nothing changes
    assert nomination.victims == {"victim"}
    ledger.uncommit(victim)
    nomination.victim_ended(victim.id, ledger)
    assert nomination.victims == set()
    assert nomination.preempting(ledger)  # the probe has not shown the memory back yet
    ledger.set_probe(A, GpuProbe(used_mb=0))
    assert not nomination.preempting(ledger)
    assert other.id not in nomination.victims


def test_the_last_preemptor_whose_victim_still_stops_has_its_turn() -> None:
    """The walk's early stop (no room anywhere, nothing left to preempt) never skips a
    preemptor whose own memory is pre-held: it has its turn, keeps its memory (a hold in
    the plan) and its diagnosis, cycle after cycle while its victim stops."""
    sched = scheduler(gpu())
    grant_now(sched, req("victim", 24 * GiB, priority="batch"))
    sched.submit(req("preemptor", 24 * GiB), 1.0)
    assert [lease.id for lease in sched.decide(1.0).revocations] == ["victim"]
    plan = sched.plan(2.0)  # the victim still stops
    assert "preemptor" in plan.turns
    assert [(h.request_id, h.preheld) for h in plan.held()] == [
        ("preemptor", True),
        ("preemptor", False),
    ]
    assert check_plan(sched, plan) == []
