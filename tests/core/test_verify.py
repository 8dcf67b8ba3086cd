"""Plan verification: a sound plan passes; each kind of unsound one is named."""

from __future__ import annotations

import math
from dataclasses import replace

from gpu_arbiter.core import GpuProbe, Lease, LeaseState, Policy, Scheduler
from gpu_arbiter.core.nominations import Hold
from gpu_arbiter.core.plan import Plan
from gpu_arbiter.core.verify import check_plan

from .support import GiB, gid, gpu, grant_now, req, scheduler


def contended() -> Scheduler:
    """One 24 GiB GPU: a batch lease holds 16 GiB, an interactive request wants 16 GiB
    (it preempts), a small one fits beside."""
    sched = scheduler(gpu(), gpu(index=1, total_mb=8 * GiB))
    sched.submit(req("batch", 16 * GiB, priority="batch"), 0.0)
    sched.decide(0.0)
    sched.ready("batch", 0.0)
    sched.submit(req("chat", 16 * GiB, priority="interactive"), 1.0)
    sched.submit(req("small", 4 * GiB), 1.0)
    sched.submit(req("late", 20 * GiB, max_wait_s=1.0), 1.0)
    return sched


def test_a_plan_with_grants_and_a_preemption_is_sound() -> None:
    sched = contended()
    plan = sched.plan(2.0)
    assert [lease.id for lease in plan.grants] == ["small"]
    assert [(r.id, r.preempted_for) for r in plan.revocations] == [("batch", "chat")]
    assert check_plan(sched, plan) == []


def test_tokens_out_of_order_are_named() -> None:
    sched = contended()
    plan = sched.plan(2.0)
    problems = check_plan(sched, replace(plan, first_token=plan.first_token + 1))
    assert any("first token" in p for p in problems)
    assert any("not consecutive" in p for p in problems)


def test_a_plan_made_before_the_worker_drained_breaks_i7() -> None:
    sched = contended()
    plan = sched.plan(2.0)
    sched.drain("w1", 2.0)
    assert any("small: w1:1 may take no new work" in p for p in check_plan(sched, plan))


def test_a_plan_made_before_the_probe_showed_memory_used_breaks_i2() -> None:
    sched = contended()
    plan = sched.plan(2.0)
    sched.set_probe(gid("w1:1"), GpuProbe(used_mb=6 * GiB))
    assert any("MiB free there (I1, I2)" in p for p in check_plan(sched, plan))


def test_a_second_load_on_a_gated_gpu_breaks_i3() -> None:
    sched = scheduler(gpu())
    sched.submit(req("a", GiB), 0.0)
    sched.submit(req("b", GiB), 0.0)
    plan = sched.plan(0.0)
    assert [lease.id for lease in plan.grants] == ["a"]
    second = replace(plan.grants[0], request=sched.queue.get("b"), token=plan.first_token + 1)
    problems = check_plan(sched, replace(plan, grants=(*plan.grants, second)))
    assert problems == ["b: a load on w1:0 with its gate closed (I3)"]


def test_preempting_for_a_request_of_no_higher_priority_breaks_i5() -> None:
    sched = contended()
    sched.submit(req("peer", 16 * GiB, priority="batch"), 1.0)
    plan = sched.plan(2.0)
    revoked = replace(plan.revocations[0], preempted_for="peer")
    problems = check_plan(sched, replace(plan, revocations=(revoked,)))
    assert "batch may not be preempted by peer (I5)" in problems


def test_a_grant_while_paused_and_an_unknown_request_are_named() -> None:
    sched = contended()
    plan = sched.plan(2.0)
    sched.pause()
    assert "grants while paused" in check_plan(sched, plan)
    sched.resume()
    sched.cancel("small")
    assert "small is granted but is not that pending request" in check_plan(sched, plan)


def test_early_time_outs_and_false_drains_are_named() -> None:
    sched = contended()
    plan = sched.plan(2.0)
    bad = replace(
        plan,
        timed_out=("chat", "late"),
        drained=(("w1", *sorted({sched.workers["w1"].status}), sched.workers["w1"].status),),
    )
    problems = check_plan(sched, bad)
    assert "chat is timed out before its max_wait_s" in problems
    assert "late is timed out before its max_wait_s" not in problems  # it waited 1 s
    assert any(p.startswith("w1 is marked") for p in problems)


def test_every_plan_of_a_busy_sequence_is_sound() -> None:
    """Plans across a sequence of events (grants, preemption, releases, time-outs)."""
    sched = scheduler(gpu(), gpu(index=1), policy=Policy(max_concurrent_loads=2))
    now = 0.0
    for i, (size, priority) in enumerate([(20, "batch"), (10, "normal"), (20, "interactive")]):
        sched.submit(req(f"r{i}", size * GiB, priority=priority, max_wait_s=5.0), now)
    for now in (0.0, 1.0, 2.0, 7.0):
        plan = sched.plan(now)
        assert check_plan(sched, plan) == []
        for lease in sched.apply(plan).revocations:
            sched.release(lease.id, now)


# ---------------------------------------------------------------- order (I6, I10)


def test_a_grant_behind_a_nominated_request_taking_its_memory_breaks_i6() -> None:
    """``big`` cannot fit and holds the GPU; the walk leaves ``small`` behind it pending.
    A plan granting ``small`` there is named; the walk's own plan is sound."""
    sched = scheduler(gpu())
    grant_now(sched, req("warm", 12 * GiB))
    sched.submit(req("big", 20 * GiB), 1.0)
    sched.submit(req("small", 8 * GiB), 2.0)
    plan = sched.plan(3.0)
    assert plan.grants == ()
    assert [(h.request_id, h.preheld) for h in plan.held()] == [("big", False)]
    assert check_plan(sched, plan) == []
    forged = _granting(sched, plan, "small", "w1:0")
    assert check_plan(sched, forged) == [
        "I6: small took 8192 MiB of w1:0 with -8192 MiB there beyond the holds ahead of it"
    ]


def test_a_request_left_pending_where_it_fitted_breaks_i10() -> None:
    sched = scheduler(gpu(), gpu(index=1))
    sched.submit(req("a", 8 * GiB), 0.0)
    sched.submit(req("b", 8 * GiB), 0.0)
    plan = sched.plan(0.0)
    assert [lease.id for lease in plan.grants] == ["a", "b"]
    problems = check_plan(sched, replace(plan, grants=plan.grants[:1]))
    assert problems == [
        "I10: b fitted on [GpuId(worker='w1', index=1)] at its turn but was left pending"
    ]


def _preempted_and_aged() -> Scheduler:
    """One 24 GiB GPU. ``victim`` (batch) is preempted at 1 s for ``preemptor`` (normal);
    ``aged`` (batch, waiting since 0 s) has aged to the preemptor's cap by 100 s, when the
    victim stops: memory its preemption freed is pre-held for ``preemptor``."""
    policy = Policy(aging_interval_s=10.0, aging_step=50, aging_cap=600)
    sched = scheduler(gpu(), policy=policy)
    grant_now(sched, req("victim", 16 * GiB, priority="batch"))
    sched.submit(req("aged", 16 * GiB, priority="batch"), 0.0)
    sched.submit(req("preemptor", 16 * GiB, priority="normal"), 1.0)
    decisions = sched.decide(1.0)
    assert [(r.id, r.preempted_for) for r in decisions.revocations] == [("victim", "preemptor")]
    sched.release("victim", 100.0)
    return sched


def test_the_prehold_rule_is_modelled_a_preemptor_takes_its_freed_memory() -> None:
    """``aged`` is ahead of the preemptor in the walk, but memory a preemption freed is
    pre-held against requests of equal or lower base priority: the preemptor's grant is
    sound, and so is ``aged`` left pending; granting ``aged`` that memory breaks I6."""
    sched = _preempted_and_aged()
    order = [r.id for _, r, _ in sched.pending(100.0)]
    assert order == ["aged", "preemptor"]
    plan = sched.plan(100.0)
    assert [lease.id for lease in plan.grants] == ["preemptor"]
    held = plan.held()
    assert held[0] == Hold("preemptor", (gid("w1:0"),), 16 * GiB, True)
    assert not any(h.request_id == "aged" and h.gpus for h in held)  # it holds nothing there
    assert check_plan(sched, plan) == []
    forged = _granting(sched, replace(plan, grants=()), "aged", "w1:0")
    problems = check_plan(sched, forged)
    assert "I6: aged took 16384 MiB of w1:0 with 8192 MiB there beyond the holds ahead of it" in (
        problems
    )


def test_a_request_of_higher_base_priority_may_take_pre_held_memory() -> None:
    sched = _preempted_and_aged()
    sched.submit(req("chat", 16 * GiB, priority="interactive"), 100.0)
    plan = sched.plan(100.0)
    assert [lease.id for lease in plan.grants] == ["chat"]
    assert check_plan(sched, plan) == []


def _granting(sched: Scheduler, plan: Plan, request_id: str, gpu_text: str) -> Plan:
    """``plan`` with ``request_id`` granted on one GPU as well (in walk order)."""
    request = sched.queue.get(request_id)
    extra = Lease(
        request=request,
        gpus=(gid(gpu_text),),
        token=plan.first_token + len(plan.grants),
        state=LeaseState.LOADING,
        granted_at=plan.now,
        expires_at=math.inf,
        load_deadline=plan.now + request.load_timeout_s,
        last_used_at=plan.now,
    )
    return replace(plan, grants=(*plan.grants, extra))
