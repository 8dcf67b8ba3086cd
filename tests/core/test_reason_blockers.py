"""A request that only leases keep out names them: holder, state, priority, and when and by
which rule (I5) each gives way to it, on a virtual clock; the countdown it shows is the
one the cycle keeps. A rejection names the largest GPU among those that match."""

from __future__ import annotations

import json
import math

from hypothesis import event, given, settings
from hypothesis import strategies as st

from gpu_arbiter.core import (
    Constraints,
    GpuProbe,
    LeaseState,
    PendingReason,
    Policy,
    Scheduler,
)
from gpu_arbiter.core.stages import usable

from .support import GiB, gid, gpu, grant_now, granted_ids, req, revoked_ids, scheduler


def _idle_chat(policy: Policy) -> Scheduler:
    """A 24 GiB GPU holding 'chat' (interactive, 14 GiB), idle since t=5."""
    sched = scheduler(gpu(), policy=policy)
    grant_now(sched, req("chat", 14 * GiB, priority="interactive", holder="chat"), 0.0)
    sched.set_idle("chat", True, 5.0)
    return sched


def _pending(sched: Scheduler, request_id: str, vram_mb: int, now: float, **fields: object) -> None:
    sched.submit(req(request_id, vram_mb, **fields), now)
    assert not granted_ids(sched.decide(now))


def test_idle_lease_names_its_idle_reclaim_countdown() -> None:
    sched = _idle_chat(Policy())  # idle_reclaim_s 60, starvation_s 120
    _pending(sched, "job", 14 * GiB, 10.0, priority="batch", holder="indexer")
    reason = sched.explain("job", 10.0)
    assert reason.code == "insufficient_vram"
    assert reason.blocked_by == "chat"
    assert [b.id for b in reason.blockers] == ["chat"]
    blocker = reason.blockers[0]
    assert (blocker.state, blocker.holder, blocker.priority) == ("idle", "chat", 800)
    assert (blocker.until, blocker.rule) == (65.0, "idle_reclaim_s")
    assert "idle lease chat (holder 'chat', interactive) on w1:0" in reason.message
    assert "reclaimable by batch in 55s (idle_reclaim_s)" in reason.message
    assert "in 25s (idle_reclaim_s)" in sched.explain("job", 40.0).message
    as_json = reason.as_dict()["blockers"]
    assert isinstance(as_json, list) and as_json[0]["rule"] == "idle_reclaim_s"
    # the countdown is the cycle's: nothing gives way before it, the lease does at it
    assert not revoked_ids(sched.decide(64.9))
    assert revoked_ids(sched.decide(65.0)) == ["chat"]


def test_idle_lease_names_the_starvation_countdown_when_it_comes_first() -> None:
    sched = _idle_chat(Policy(idle_reclaim_s=math.inf, starvation_s=150.0))
    _pending(sched, "job", 14 * GiB, 10.0, priority="batch")
    blocker = sched.explain("job", 10.0).blockers[0]
    assert (blocker.until, blocker.rule) == (160.0, "starvation_s")
    assert "reclaimable by batch in 2m (starvation_s)" in sched.explain("job", 10.0).message
    assert "in 10s (starvation_s)" in sched.explain("job", 150.0).message
    assert not revoked_ids(sched.decide(159.0))
    assert revoked_ids(sched.decide(160.0)) == ["chat"]


def test_busy_lease_of_higher_priority_is_named_as_never_giving_way() -> None:
    sched = scheduler(gpu())
    grant_now(sched, req("big", 14 * GiB, priority="interactive", holder="big"), 0.0)
    _pending(sched, "job", 14 * GiB, 10.0, priority="batch")
    reason = sched.explain("job", 10.0)
    blocker = reason.blockers[0]
    assert (blocker.state, blocker.until, blocker.rule) == ("busy", None, "not_preemptible")
    assert "busy lease big (holder 'big', interactive) on w1:0" in reason.message
    assert "not preemptible by batch (I5)" in reason.message


def test_busy_preemptible_lease_counts_down_the_requests_patience() -> None:
    sched = scheduler(gpu(), policy=Policy(preempt_patience_s=30.0))
    grant_now(sched, req("low", 14 * GiB, priority="batch"), 0.0)
    _pending(sched, "job", 14 * GiB, 10.0, priority="normal")
    reason = sched.explain("job", 20.0)
    assert (reason.blockers[0].until, reason.blockers[0].rule) == (40.0, "preempt_patience_s")
    assert "preemptible by normal in 20s (preempt_patience_s)" in reason.message
    assert revoked_ids(sched.decide(40.0)) == ["low"]


def test_loading_lease_is_named_loading() -> None:
    sched = scheduler(gpu(), policy=Policy(max_concurrent_loads=2))
    grant_now(sched, req("warming", 14 * GiB, priority="interactive"), 0.0, ready=False)
    _pending(sched, "job", 14 * GiB, 1.0, priority="batch")
    blocker = sched.explain("job", 1.0).blockers[0]
    assert (blocker.id, blocker.state, blocker.rule) == ("warming", "loading", "not_preemptible")


def test_revoking_lease_gives_its_memory_back_at_the_latest_after_grace_and_ttl() -> None:
    sched = scheduler(gpu())  # grace_s 10
    grant_now(sched, req("old", 14 * GiB, priority="interactive", ttl_s=30.0), 0.0)
    sched.renew("old", 4.0)
    sched.revoke("old", "admin", 5.0)  # expires at 34: before 5 + grace + TTL = 45
    _pending(sched, "job", 14 * GiB, 10.0, priority="batch")
    reason = sched.explain("job", 10.0)
    blocker = reason.blockers[0]
    assert (blocker.state, blocker.rule, blocker.until) == ("revoking", "revoking", 34.0)
    assert "memory back when its holder stops, at the latest in 24s (grace + TTL)" in (
        reason.message
    )


def test_every_lease_that_must_go_is_named_and_the_last_one_is_the_blocker() -> None:
    sched = scheduler(gpu(), policy=Policy(starvation_s=math.inf))
    for name, at in (("a", 1.0), ("b", 2.0)):
        grant_now(sched, req(name, 8 * GiB, priority="interactive", holder=name), 0.0)
        sched.set_idle(name, True, at)
    grant_now(sched, req("busy", 4 * GiB, priority="critical"), 0.0)
    _pending(sched, "job", 20 * GiB, 3.0, priority="batch")
    reason = sched.explain("job", 3.0)
    assert [b.id for b in reason.blockers] == ["b", "a"]  # the last to give way first
    assert reason.blocker is not None and reason.blocker.id == "b"
    assert "reclaimable by batch in 59s" in reason.message
    assert "reclaimable by batch in 58s" in reason.message


def test_memory_the_arbiter_does_not_know_of_names_no_lease() -> None:
    sched = scheduler(gpu())
    grant_now(sched, req("chat", 4 * GiB, priority="interactive"), 0.0)
    sched.set_probe(gid("w1:0"), GpuProbe(used_mb=20 * GiB))
    _pending(sched, "job", 14 * GiB, 1.0, priority="critical")
    reason = sched.explain("job", 1.0)
    assert reason.code == "insufficient_vram"
    assert reason.blockers == () and reason.blocker is None
    assert reason.message.startswith("0/1 GPUs fit: 1 insufficient_vram")


# ---------------------------------------------------------------------- figures JSON carries


def _strict(reason: PendingReason) -> dict[str, object]:
    """The reason as the API renders it, through strict JSON (no NaN, no Infinity)."""
    loaded: dict[str, object] = json.loads(json.dumps(reason.as_dict(), allow_nan=False))
    return loaded


def test_an_idle_lease_reclaimable_at_once_gave_way_at_a_time_json_carries() -> None:
    """An idle batch lease the request may reclaim at once, beside a busy interactive one
    it may not preempt: the idle one gave way when the request came (it was idle before),
    a time past, never ``-inf``."""
    sched = scheduler(gpu())
    grant_now(sched, req("warm", 8 * GiB, priority="batch", holder="warm"), 0.0)
    sched.set_idle("warm", True, 1.0)
    grant_now(sched, req("big", 12 * GiB, priority="interactive", holder="big"), 0.0)
    _pending(sched, "job", 14 * GiB, 2.0, priority="normal")
    reason = sched.explain("job", 5.0)
    assert [b.id for b in reason.blockers] == ["big", "warm"]
    warm = reason.blockers[1]
    assert (warm.rule, warm.until, warm.expires_at) == ("at_once", 2.0, None)
    assert "idle lease warm (holder 'warm', batch) on w1:0: reclaimable by normal now" in (
        reason.message
    )
    blockers = _strict(reason)["blockers"]
    assert isinstance(blockers, list) and blockers[1]["until"] == 2.0
    assert blockers[1]["expires_at"] is None  # no TTL


def test_a_revoked_lease_without_a_ttl_gives_its_memory_back_with_no_bound() -> None:
    sched = scheduler(gpu())
    grant_now(sched, req("old", 14 * GiB, priority="interactive", holder="old"), 0.0)
    sched.revoke("old", "admin", 5.0)
    _pending(sched, "job", 14 * GiB, 10.0, priority="batch")
    reason = sched.explain("job", 10.0)
    blocker = reason.blockers[0]
    assert (blocker.rule, blocker.until, blocker.expires_at) == ("revoking", None, None)
    assert "memory back when its holder stops (it has no TTL to bound that)" in reason.message
    assert "inf" not in reason.message
    _strict(reason)


def test_a_revoked_lease_without_a_ttl_gives_way_before_one_that_never_does() -> None:
    """Both unbounded, the revoked one still stops some day: the blocker, the one waited for
    last, is the lease that never gives way."""
    sched = scheduler(gpu())
    grant_now(sched, req("a-old", 10 * GiB, priority="batch"), 0.0)
    grant_now(sched, req("z-big", 10 * GiB, priority="critical"), 0.0)
    sched.revoke("a-old", "admin", 1.0)
    _pending(sched, "job", 20 * GiB, 2.0, priority="normal")
    reason = sched.explain("job", 2.0)
    assert [(b.id, b.rule) for b in reason.blockers] == [
        ("z-big", "not_preemptible"),
        ("a-old", "revoking"),
    ]


def test_a_loading_lease_without_a_ttl_names_its_load_timeout_alone() -> None:
    sched = scheduler(gpu())
    grant_now(
        sched, req("warming", 4 * GiB, holder="warming", load_timeout_s=300.0), 0.0, ready=False
    )
    _pending(sched, "next", 4 * GiB, 10.0)
    reason = sched.explain("next", 10.0)
    assert reason.code == "load_in_progress"
    assert reason.blocker is not None
    assert (reason.blocker.until, reason.blocker.expires_at) == (300.0, None)
    assert "at the latest in 5m (its load timeout)" in reason.message
    assert "TTL" not in reason.message
    _strict(reason)


def test_the_loading_lease_whose_gate_opens_first_is_named_a_missing_ttl_never_first() -> None:
    """A load gate of two, both loads with a 300 s timeout: one bounded by its TTL too (in
    20 s), one with no TTL (its expiry None: never, not time 0): the first opens first."""
    sched = scheduler(gpu(), policy=Policy(max_concurrent_loads=2))
    grant_now(sched, req("a-no-ttl", 4 * GiB), 0.0, ready=False)
    grant_now(sched, req("b-ttl", 4 * GiB, ttl_s=20.0), 0.0, ready=False)
    _pending(sched, "next", 4 * GiB, 0.0)
    reason = sched.explain("next", 0.0)
    assert reason.blocker is not None and reason.blocker.id == "b-ttl"
    assert "or in 20s if its TTL lapses unrenewed" in reason.message


def test_a_preempted_lease_without_a_ttl_is_named_without_an_expiry() -> None:
    sched = scheduler(gpu(), policy=Policy(grace_s=math.inf))
    grant_now(sched, req("victim", 20 * GiB, priority="batch", holder="victim"), 0.0)
    sched.submit(req("urgent", 20 * GiB, priority="critical"), 1.0)
    assert revoked_ids(sched.decide(1.0)) == ["victim"]
    reason = sched.explain("urgent", 3.0)
    assert reason.code == "preempting"
    assert reason.blocker is not None
    assert (reason.blocker.until, reason.blocker.expires_at) == (None, None)  # no grace end
    assert "lease victim (holder 'victim') was preempted 2.0s ago" in reason.message
    _strict(reason)


def test_rejection_names_the_largest_gpu_among_those_that_match() -> None:
    sched = scheduler(gpu(arch="sm_86"), gpu(total_mb=80 * GiB, arch="sm_90", worker="w2"))
    request = req("r", 40 * GiB, constraints=Constraints(gpu_arch=("sm_86",)))
    reason = sched.rejection_for(request)
    assert reason is not None and reason.code == "too_large"
    assert "(largest capacity 24.0 GiB)" in reason.message


# ---------------------------------------------------------------------- property


_LEASE = st.tuples(
    st.integers(1, 16),  # GiB
    st.sampled_from([100, 300, 500, 800, 1000]),
    st.sampled_from(["busy", "idle", "revoking", "loading"]),
    st.floats(0.0, 100.0),  # when it went idle
)


@settings(max_examples=150, deadline=None)
@given(
    totals_gib=st.lists(st.sampled_from([16, 24, 48]), min_size=1, max_size=4),
    leases=st.lists(_LEASE, max_size=10),
    requests=st.lists(
        st.tuples(st.integers(1, 40), st.sampled_from([100, 500, 800]), st.integers(1, 2)),
        min_size=1,
        max_size=6,
    ),
    now=st.floats(100.0, 400.0),
)
def test_every_named_blocker_exists_and_sits_on_a_candidate_gpu(
    totals_gib: list[int],
    leases: list[tuple[int, int, str, float]],
    requests: list[tuple[int, int, int]],
    now: float,
) -> None:
    sched = scheduler(
        *(gpu(i % 2, total * GiB, worker=f"w{i // 2}") for i, total in enumerate(totals_gib)),
        policy=Policy(max_concurrent_loads=4),
    )
    for n, (size_gib, priority, state, idle_at) in enumerate(leases):
        sched.submit(req(f"l{n}", size_gib * GiB, priority=priority, ttl_s=1000.0), 0.0)
        if f"l{n}" not in granted_ids(sched.decide(0.0)):
            continue
        if state != "loading":
            sched.ready(f"l{n}", 0.0)
        if state == "idle":
            sched.set_idle(f"l{n}", True, idle_at)
        elif state == "revoking":
            sched.revoke(f"l{n}", "admin", idle_at)
    for n, (size_gib, priority, count) in enumerate(requests):
        request = req(f"r{n}", size_gib * GiB, priority=priority, gpus=count)
        if sched.rejection_for(request) is None:
            sched.submit(request, now)
    sched.decide(now)
    named = 0
    for _, request, _ in list(sched.pending(now)):
        named += _check_blockers(sched, request.id, sched.explain(request.id, now))
    event(f"requests naming blockers: {min(named, 2)}+")


def _check_blockers(sched: Scheduler, request_id: str, reason: PendingReason) -> int:
    if not reason.blockers:
        return 0
    request = sched.queue.get(request_id)
    candidates = {g for g in sched.matching(request) if usable(sched, g)}
    assert reason.blocker is reason.blockers[0] and reason.blocked_by == reason.blocker.id
    for blocker in reason.blockers:
        lease = sched.leases[blocker.id]  # it exists
        assert lease.state in (LeaseState.LOADING, LeaseState.ACTIVE, LeaseState.REVOKING)
        assert set(lease.gpus) & candidates, (blocker, candidates)
        assert blocker.id in reason.message
    # the leases named on a GPU make room there for the request once gone
    named = {b.id for b in reason.blockers}
    gpus = {g for b in reason.blockers for g in sched.leases[b.id].gpus} & candidates
    assert any(sched.ledger.free_after(g, named) >= request.vram_mb for g in gpus)
    return 1
