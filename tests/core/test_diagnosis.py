"""A diagnosis counts what the stages say of every GPU, without asking them of every GPU:
checked against the stages asked GPU by GPU, on random clusters, leases, probes, holds,
worker states and requests; and a reason is read from it."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_arbiter.core import Constraints, GpuProbe, Policy, Request, Scheduler, cycle
from gpu_arbiter.core.diagnosis import diagnose
from gpu_arbiter.core.nominations import Holds
from gpu_arbiter.core.outcomes import Outcome
from gpu_arbiter.core.stages import outcome
from gpu_arbiter.core.state import _Reads

from .support import gid, gpu, grant_now, req, scheduler

GiB = 1024
WORKERS = ("a", "b", "c")


@st.composite
def clusters(draw: st.DrawFn) -> tuple[object, ...]:
    gpus = []
    for worker in WORKERS:
        for index in range(draw(st.integers(1, 3))):
            size = draw(st.sampled_from([8, 16, 24, 48]))
            arch = draw(st.sampled_from(["sm_80", "sm_90"]))
            gpus.append(gpu(index, size * GiB, worker=worker, arch=arch))
    leases = draw(st.lists(st.sampled_from([2, 4, 8, 12]), max_size=8))
    ready = draw(st.lists(st.booleans(), min_size=len(leases), max_size=len(leases)))
    stale = draw(st.sets(st.integers(0, len(gpus) - 1), max_size=2))
    used = draw(st.dictionaries(st.integers(0, len(gpus) - 1), st.sampled_from([1, 6]), max_size=3))
    status = draw(st.sampled_from([None, "draining", "offline"]))
    holds = draw(
        st.dictionaries(st.integers(0, len(gpus) - 1), st.sampled_from([2, 10]), max_size=3)
    )
    need = draw(st.sampled_from([1, 4, 10, 20, 30, 60]))
    count = draw(st.sampled_from([1, 1, 2]))
    arch = draw(st.sampled_from([None, "sm_90"]))
    return (
        gpus,
        list(zip(leases, ready, strict=True)),
        stale,
        used,
        status,
        holds,
        need,
        count,
        arch,
    )


def _hold_leases(sched: Scheduler, leases: list[tuple[int, bool]]) -> None:
    """Grants what fits of ``leases`` (size in GiB, ready or still loading)."""
    for i, (size, ready) in enumerate(leases):
        request = req(f"l{i}", size * GiB)
        if sched.rejection_for(request) is None:
            sched.submit(request, 0.0)
            for lease in sched.decide(0.0).grants:
                if ready:
                    sched.ready(lease.id, 0.0)


@settings(max_examples=300, deadline=None)
@given(clusters(), st.sampled_from([1, 2]))
def test_counts_and_nearest_are_what_the_stages_say_of_every_gpu(
    case: tuple[object, ...], loads: int
) -> None:
    gpus, leases, stale, used, status, holds_at, need, count, arch = case  # type: ignore[misc]
    sched = scheduler(*gpus, policy=Policy(max_concurrent_loads=loads))
    _hold_leases(sched, leases)
    ids = sched.gpu_ids()
    for i in used:
        sched.set_probe(
            ids[i], GpuProbe(used_mb=sched.figures(ids[i]).committed_mb + used[i] * GiB)
        )
    for i in stale:
        sched.set_probe(ids[i], None)
    if status == "draining":
        sched.drain("b", 1.0)
    elif status == "offline":
        sched.set_offline("c", 1.0)
    holds = Holds()
    for i, mb in holds_at.items():
        holds.hold(req(f"h{i}", mb * GiB), (ids[i],))
    request = req("r", need * GiB, gpus=count, constraints=Constraints.build(gpu_arch=arch))
    reads = _Reads(sched)

    diagnosis = diagnose(reads, request, holds)

    said = {g: outcome(reads, request, g, holds.by_gpu) or Outcome.FITS for g in ids}
    expected = Counter(said.values())
    if count > 1 and expected[Outcome.FITS]:
        fitting = Counter(g.worker for g, code in said.items() if code is Outcome.FITS)
        if max(fitting.values()) < count:  # GPUs with room, too few on any one worker
            expected[Outcome.TOO_FEW_GPUS_ON_WORKER] += expected.pop(Outcome.FITS)
    assert {Outcome(v.code): v.count for v in diagnosis.verdicts} == dict(expected)
    assert diagnosis.total == len(ids)
    free = {g: sched.ledger.free_mb(g) for g in ids}
    room = {g: free[g] - holds.by_gpu.get(g, 0) for g in ids}
    for verdict in diagnosis.verdicts:
        code = Outcome(verdict.code)
        same = [g for g, c in said.items() if c is code]
        if code is Outcome.INSUFFICIENT_VRAM:  # the nearest to fitting: the most free
            assert free[verdict.gpu] == max(free[g] for g in same)
        if code is Outcome.NOMINATED_FOR:  # the most room beyond the holds
            assert room[verdict.gpu] == max(room[g] for g in same)
        assert said[verdict.gpu] in (code, Outcome.FITS)


def test_a_reason_is_read_from_the_walk_and_names_the_gpu_nearest_to_taking_it() -> None:
    sched = scheduler(gpu(0, 24 * GiB), gpu(1, 24 * GiB), gpu(0, 16 * GiB, worker="w2"))
    grant_now(sched, req("a", 20 * GiB), 0.0)
    grant_now(sched, req("b", 22 * GiB), 0.0)
    grant_now(sched, req("c", 14 * GiB), 0.0)
    sched.submit(req("wait", 6 * GiB), 1.0)
    sched.submit(req("small", 1 * GiB), 1.0)  # fits: the walk goes on, past "wait"
    plan = sched.plan(1.0)
    assert set(plan.turns) == {"wait"}
    assert [lease.id for lease in plan.grants] == ["small"]
    sched.apply(plan)
    reason = sched.explain("wait", 1.0)
    (verdict,) = reason.gpus
    assert (verdict.code, verdict.count, str(verdict.gpu)) == ("insufficient_vram", 3, "w1:0")
    assert reason.message.startswith(
        "0/3 GPUs fit: 3 insufficient_vram (need 6.0 GiB, most free 4.0 GiB)"
    )
    assert reason.blocker is not None and reason.blocker.id == "a"  # on w1:0, the nearest


def test_a_worker_that_is_not_online_is_said_of_its_gpus() -> None:
    sched = scheduler(gpu(0), gpu(0, worker="w2"))
    sched.drain("w1", 0.0)
    sched.set_offline("w2", 0.0)
    sched.submit(req("r", 4 * GiB), 1.0)
    sched.decide(1.0)
    reason = sched.explain("r", 1.0)
    assert reason.code == "workers_draining"
    assert {v.code: v.count for v in reason.gpus} == {"worker_drained": 1, "worker_offline": 1}
    sched.cancel_drain("w1")
    assert sched.explain("r", 1.0).code == "queued"  # not diagnosed by the walk: asked now
    assert [lease.id for lease in sched.decide(1.0).grants] == ["r"]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from([4, 8, 12, 20, 30]), min_size=1, max_size=6),
    st.lists(
        st.tuples(st.sampled_from([2, 6, 10, 16, 26]), st.sampled_from(["batch", "normal"])),
        min_size=1,
        max_size=10,
    ),
    st.sampled_from([1, 2]),
)
def test_a_why_worked_out_from_a_turn_is_what_the_walk_saw_there(
    held: list[int], pending: list[tuple[int, str]], loads: int
) -> None:
    """The walk writes down where it stood (a Turn); the diagnosis worked out from it after
    the plan was applied is the one the walk would have made on the spot."""
    sched = scheduler(
        gpu(0, 32 * GiB), gpu(1, 32 * GiB), gpu(0, 24 * GiB, worker="w2"),
        policy=Policy(max_concurrent_loads=loads),
    )  # fmt: skip
    for i, size in enumerate(held):
        request = req(f"l{i}", size * GiB, preemptible=False)
        sched.submit(request, 0.0)
        for lease in sched.decide(0.0).grants:
            sched.ready(lease.id, 0.0)
        if request.id in sched.queue:
            sched.cancel(request.id)
    for i, (size, priority) in enumerate(pending):
        sched.submit(req(f"p{i}", size * GiB, priority=priority), 1.0)
    on_the_spot: dict[str, object] = {}
    walk = cycle._Walk
    recorded = walk.diagnose

    def diagnose_now(self: cycle._Walk, request: Request) -> None:
        on_the_spot[request.id] = diagnose(self, request, self.holds)
        recorded(self, request)

    walk.diagnose = diagnose_now  # type: ignore[method-assign]
    try:
        plan = sched.plan(1.0)
    finally:
        walk.diagnose = recorded  # type: ignore[method-assign]
    sched.apply(plan)
    assert set(on_the_spot) == set(plan.turns)
    for request_id, seen in on_the_spot.items():
        assert sched.diagnosis(sched.queue.get(request_id)) == seen, request_id


def test_a_request_waiting_for_memory_being_revoked_names_that_lease_not_the_nearest_gpu() -> None:
    """The post-filter's answer shows in the why: the walk has the request wait on w1:0,
    where a revoked lease's memory comes back; w1:1 has more free memory (the nearest GPU)
    but a warm lease it may not reclaim yet."""
    sched = scheduler(gpu(0, 24 * GiB), gpu(1, 24 * GiB), policy=Policy(idle_reclaim_s=60.0))
    grant_now(sched, req("revoked", 20 * GiB, constraints=Constraints.build(gpu_ids=["w1:0"])))
    warm = req("warm", 16 * GiB, priority="interactive", preemptible=False)
    grant_now(sched, warm)
    sched.set_idle("warm", True, 0.0)
    sched.revoke("revoked", "revoked_by_admin", 0.0)
    sched.submit(req("r", 12 * GiB), 1.0)
    plan = sched.plan(1.0)
    assert plan.turns["r"].waits_on == (gid("w1:0"),)
    sched.apply(plan)
    reason = sched.explain("r", 1.0)
    assert reason.code == "insufficient_vram"
    assert str(reason.gpus[0].gpu) == "w1:1"  # the nearest: 8 GiB free, against 4 GiB
    assert reason.blocker is not None
    assert (reason.blocker.id, reason.blocker.rule) == ("revoked", "revoking")
    assert "memory back when its holder stops" in reason.message


def test_a_gpu_that_takes_no_new_work_offers_no_room_in_a_reason() -> None:
    """An offline worker left from an earlier run, a draining one and a GPU whose probe
    failed hold 80 GiB free by their books: the reason counts them by why they take no
    work and offers none of their memory (free 0), the online GPU's figures as they are."""
    sched = scheduler(
        gpu(),
        gpu(worker="old", total_mb=80 * 1024),
        gpu(worker="leaving", total_mb=80 * 1024),
        gpu(worker="flaky", total_mb=80 * 1024),
    )
    grant_now(sched, req("hold", 20 * 1024))
    sched.set_offline("old", 0.0)
    sched.drain("leaving", 0.0)
    sched.set_probe(gid("flaky:0"), None)  # its probe failed: memory unknown (I2)
    sched.submit(req("r", 10 * 1024), 1.0)
    sched.decide(1.0)
    reason = sched.explain("r", 1.0)
    by_code = {v.code: v for v in reason.gpus}
    assert by_code[Outcome.WORKER_OFFLINE].free_mb == 0
    assert by_code[Outcome.WORKER_DRAINED].free_mb == 0  # draining with nothing to finish
    assert by_code[Outcome.PROBE_STALE].free_mb == 0
    assert by_code[Outcome.INSUFFICIENT_VRAM].free_mb == 4 * 1024
    assert "80" not in reason.message
