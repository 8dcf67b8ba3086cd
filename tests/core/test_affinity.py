"""Worker sets: ``constraints.workers`` (any of these workers, a filter) and
``constraints.prefer_workers`` (placed on one of these when it fits there now, a rank:
never a reason for a request to wait, be rejected or preempt)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_arbiter.core import (
    Constraints,
    GpuId,
    GpuProbe,
    InvalidInput,
    Policy,
    Request,
    Scheduler,
    Unschedulable,
)
from gpu_arbiter.core.stages import fits
from gpu_arbiter.core.verify import check_plan
from tests.core.support import GiB, gid, gpu, grant_now, granted_ids, req, scheduler


def prefer(*names: str) -> Constraints:
    return Constraints.build(prefer_workers=list(names))


def placed(sched: Scheduler, request: Request, now: float = 1.0) -> str:
    """Submits ``request``, runs a cycle that must grant it and marks it loaded (its load
    gate open again); its GPUs, as text."""
    sched.submit(request, now)
    assert granted_ids(sched.decide(now)) == [request.id]
    sched.ready(request.id, now)
    return ",".join(map(str, sched.lease(request.id).gpus))


# ---------------------------------------------------------------------- workers: any of


def test_workers_is_any_of_its_names_and_a_filter() -> None:
    sched = scheduler(gpu(0, worker="a"), gpu(0, worker="b"), gpu(0, worker="c"))
    grant_now(sched, req("on-a", 20 * GiB, constraints=Constraints.build(worker="a")))
    grant_now(sched, req("on-c", 12 * GiB, constraints=Constraints.build(worker="c")))
    only_a_or_c = Constraints.build(workers=["C", "a", "c"])
    assert only_a_or_c.workers == ("a", "c")  # case-folded, each once, sorted
    # binpack alone would pick c (12 GiB left); b (24 GiB) is not one of them
    assert placed(sched, req("r1", 8 * GiB, constraints=only_a_or_c)) == "c:0"
    sched.submit(req("r2", 8 * GiB, constraints=only_a_or_c), 2.0)
    assert granted_ids(sched.decide(2.0)) == []  # b has room, but b is not allowed
    reason = sched.explain("r2", 2.0)
    codes = {v.code: v.count for v in reason.gpus}
    assert codes == {"worker_mismatch": 1, "insufficient_vram": 2}  # b, then a and c


def test_a_request_no_worker_of_its_set_could_ever_take_is_rejected() -> None:
    sched = scheduler(gpu(0, worker="a", total_mb=8 * GiB), gpu(0, worker="b"))
    with pytest.raises(Unschedulable, match="more than any matching GPU"):
        sched.submit(req("big", 16 * GiB, constraints=Constraints.build(workers=["a"])), 0.0)
    both = Constraints.build(worker="b", workers=["a"])  # a GPU must satisfy both
    with pytest.raises(Unschedulable, match="no GPU matches worker=b,workers=a"):
        sched.submit(req("none", GiB, constraints=both), 0.0)
    assert not sched.queue


def test_gpu_ids_must_be_on_one_of_the_workers() -> None:
    exact = Constraints.build(workers=["a", "b"], gpu_ids=["b:1"])
    assert exact.gpu_ids == (gid("b:1"),)
    with pytest.raises(InvalidInput) as caught:
        Constraints.build(workers=["a", "b"], gpu_ids=["c:0"])
    assert caught.value.field == "constraints.gpu_ids"
    assert "constraints.workers" in caught.value.reason


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("workers", []),
        ("workers", ["BAD NAME"]),
        ("workers", "a"),
        ("workers", [f"w{i}" for i in range(65)]),
        ("workers", ["a:0"]),
        ("prefer_workers", ["-a"]),
        ("prefer_workers", [f"w{i}" for i in range(65)]),
        ("prefer_workers", [7]),
    ],
)
def test_a_bad_worker_set_names_its_field(field: str, value: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        Constraints.build(**{field: value})  # type: ignore[arg-type]
    assert caught.value.field == f"constraints.{field}"


def test_prefer_workers_may_be_empty_and_names_workers_not_registered() -> None:
    assert Constraints.build(prefer_workers=[]) == Constraints()
    sched = scheduler(gpu(0, worker="a"))
    assert placed(sched, req("r", GiB, constraints=prefer("gone", "elsewhere"))) == "a:0"


# ---------------------------------------------------------------------- prefer: a rank


def _two_workers(policy: Policy | None = None) -> Scheduler:
    """``a`` empty (24 GiB free on each of 2 GPUs), ``b`` with 12 GiB free: binpack alone
    places an 8 GiB request on b."""
    sched = scheduler(gpu(0, worker="a"), gpu(1, worker="a"), gpu(0, worker="b"), policy=policy)
    grant_now(sched, req("b-half", 12 * GiB, constraints=Constraints.build(worker="b")))
    return sched


def test_a_preferred_worker_where_the_request_fits_is_chosen_over_binpack() -> None:
    sched = _two_workers()
    assert placed(sched, req("plain", 4 * GiB)) == "b:0"
    grant_now(sched, req("a1-quarter", 6 * GiB, constraints=Constraints.build(gpu_ids=["a:1"])))
    # among a's GPUs binpack still ranks: a:1 has the least room left
    assert placed(sched, req("warm", 8 * GiB, constraints=prefer("a")), 2.0) == "a:1"


def test_spread_ranks_within_the_preferred_workers() -> None:
    sched = _two_workers(Policy(placement="spread"))
    grant_now(sched, req("a0-some", 2 * GiB, constraints=Constraints.build(gpu_ids=["a:0"])))
    grant_now(sched, req("b-more", 2 * GiB, constraints=Constraints.build(gpu_ids=["b:0"])))
    assert placed(sched, req("warm", 4 * GiB, constraints=prefer("b"))) == "b:0"
    assert placed(sched, req("warm-a", 4 * GiB, constraints=prefer("a")), 2.0) == "a:1"


def test_several_gpus_go_to_a_preferred_worker_that_has_them() -> None:
    sched = scheduler(*(gpu(i, worker=w) for w in ("a", "b") for i in range(2)))
    grant_now(sched, req("b-some", 4 * GiB, constraints=Constraints.build(gpu_ids=["b:0"])))
    assert placed(sched, req("pair", 8 * GiB, gpus=2, constraints=prefer("a"))) == "a:0,a:1"
    # b alone has 2 GPUs with room now: the preference for a (full) is no filter
    assert placed(sched, req("pair-2", 20 * GiB, gpus=2, constraints=prefer("a")), 2.0) == (
        "b:0,b:1"
    )


def test_a_full_preferred_worker_falls_back_to_the_usual_placement() -> None:
    sched = _two_workers()
    grant_now(sched, req("a0-full", 20 * GiB, constraints=Constraints.build(gpu_ids=["a:0"])))
    grant_now(sched, req("a1-full", 18 * GiB, constraints=Constraints.build(gpu_ids=["a:1"])))
    # 4 and 6 GiB left on a: the 8 GiB request goes where it would go without preference
    assert placed(sched, req("warm", 8 * GiB, constraints=prefer("a")), 2.0) == "b:0"


def test_a_preferred_worker_whose_probe_shows_strangers_memory_falls_back() -> None:
    sched = _two_workers()
    for index in (0, 1):
        sched.set_probe(gid(f"a:{index}"), GpuProbe(used_mb=20 * GiB))  # not ours (I2)
    assert placed(sched, req("warm", 8 * GiB, constraints=prefer("a"))) == "b:0"


def test_a_draining_preferred_worker_gets_nothing_new() -> None:
    sched = _two_workers()
    sched.drain("a", 1.0)
    assert placed(sched, req("warm", 8 * GiB, constraints=prefer("a", "b")), 2.0) == "b:0"
    sched.cancel_drain("a")
    assert placed(sched, req("warm-2", 8 * GiB, constraints=prefer("a")), 3.0) == "a:0"


def test_a_preferred_gpu_whose_load_gate_is_busy_is_passed_over() -> None:
    sched = scheduler(gpu(0, worker="a"), gpu(0, worker="b"))
    loading = req("loading", 4 * GiB, constraints=Constraints.build(worker="a"))
    grant_now(sched, loading, ready=False)  # a:0 is loading (I3): 20 GiB free, gate closed
    assert placed(sched, req("warm", 8 * GiB, constraints=prefer("a"))) == "b:0"
    sched.ready("loading", 2.0)
    assert placed(sched, req("warm-2", 8 * GiB, constraints=prefer("a")), 3.0) == "a:0"


def test_the_hold_of_a_nomination_ahead_is_respected_on_a_preferred_worker() -> None:
    """``big`` fits nowhere and preempts nothing (its leases are not preemptible): it holds
    a:0, where it is closest to fitting (I6). The request behind it that prefers a fits in
    a:0's free memory, but not beyond that hold: it goes to b."""
    sched = scheduler(gpu(0, worker="a"), gpu(0, worker="b"))
    for worker, used in (("a", 8 * GiB), ("b", 12 * GiB)):
        pinned = Constraints.build(worker=worker)
        grant_now(sched, req(f"{worker}-held", used, constraints=pinned, preemptible=False))
    sched.submit(req("big", 20 * GiB, priority="interactive"), 1.0)
    sched.submit(req("warm", 8 * GiB, priority="batch", constraints=prefer("a")), 1.0)
    assert granted_ids(sched.decide(1.0)) == ["warm"]
    assert sched.lease("warm").gpus == (gid("b:0"),)
    assert sched.explain("big", 1.0).nominated == (gid("a:0"),)


def test_a_request_goes_to_its_own_nomination_before_its_preferred_worker() -> None:
    """A preemptor's memory comes back on the GPU it is nominated to: it is placed there,
    not on the preferred worker where room appeared meanwhile."""
    sched = scheduler(gpu(0, worker="a"), gpu(0, worker="b"))
    for worker, priority in (("a", "background"), ("b", "batch")):
        pinned = Constraints.build(worker=worker)
        grant_now(sched, req(f"{worker}-20g", 20 * GiB, priority=priority, constraints=pinned))
    sched.submit(req("warm", 16 * GiB, constraints=prefer("a")), 1.0)
    revoked = sched.decide(1.0).revocations
    assert [v.id for v in revoked] == ["b-20g"]  # the lowest priority: preemption's own rule
    assert sched.nominations["warm"].gpus == (gid("b:0"),)
    sched.release("b-20g", 2.0)
    sched.release("a-20g", 2.0)  # a has room now too
    assert granted_ids(sched.decide(2.0)) == ["warm"]
    assert sched.lease("warm").gpus == (gid("b:0"),)


# ---------------------------------------------------------------------- the property

_WORKERS = ("a", "b", "c", "d")


@dataclass(frozen=True)
class _GpuSpec:
    at: GpuId
    total_mb: int
    held_mb: int | None  # a lease on it, or none
    loading: bool  # the lease is still loading: the GPU's load gate is closed
    preemptible: bool
    priority: str
    stranger_mb: int  # memory the probe sees that no lease holds


@dataclass(frozen=True)
class _Spec:
    gpus: tuple[_GpuSpec, ...]
    draining: tuple[str, ...]
    placement: Literal["binpack", "spread"]
    request: Request  # without preference
    prefer: tuple[str, ...]


@st.composite
def _spec(draw: st.DrawFn) -> _Spec:
    """A small cluster: 2-4 workers of 1-2 GPUs, a lease (or none) on each GPU, strangers'
    memory, drains; and a request with the workers it prefers."""
    names = _WORKERS[: draw(st.integers(2, 4))]
    gpus = []
    for name in names:
        for index in range(draw(st.integers(1, 2))):
            total = draw(st.sampled_from([8, 16, 24])) * GiB
            gpus.append(
                _GpuSpec(
                    at=GpuId(name, index),
                    total_mb=total,
                    held_mb=draw(st.none() | st.integers(1, total // GiB).map(lambda n: n * GiB)),
                    loading=draw(st.booleans()),
                    preemptible=draw(st.booleans()),
                    priority=draw(st.sampled_from(["batch", "normal"])),
                    stranger_mb=draw(st.sampled_from([0, 0, 2 * GiB, 6 * GiB])),
                )
            )
    request = req(
        "r",
        draw(st.integers(1, 24)) * GiB,
        gpus=draw(st.integers(1, 2)),
        priority=draw(st.sampled_from(["batch", "normal", "interactive"])),
    )
    return _Spec(
        gpus=tuple(gpus),
        draining=tuple(draw(st.lists(st.sampled_from(names), max_size=2, unique=True))),
        placement=draw(st.sampled_from(["binpack", "spread"])),
        request=request,
        prefer=tuple(draw(st.lists(st.sampled_from([*names, "gone"]), min_size=1, max_size=3))),
    )


def _build(spec: _Spec) -> Scheduler:
    sched = scheduler(
        *(gpu(g.at.index, total_mb=g.total_mb, worker=g.at.worker) for g in spec.gpus),
        policy=Policy(placement=spec.placement),
    )
    for g in spec.gpus:
        if g.held_mb is not None:
            holder = req(
                f"held-{g.at}",
                g.held_mb,
                constraints=Constraints.build(gpu_ids=[str(g.at)]),
                preemptible=g.preemptible,
                priority=g.priority,
            )
            grant_now(sched, holder, ready=not g.loading)
        if g.stranger_mb:
            sched.set_probe(g.at, GpuProbe(used_mb=(g.held_mb or 0) + g.stranger_mb))
    for name in spec.draining:
        sched.drain(name, 0.5)
    return sched


def _cycle(sched: Scheduler, now: float) -> tuple[list[str], list[str]]:
    """One cycle, its plan verified first: what it granted and what it revoked."""
    plan = sched.plan(now)
    assert check_plan(sched, plan) == []
    decisions = sched.apply(plan)
    return granted_ids(decisions), sorted(v.id for v in decisions.revocations)


@settings(max_examples=300, deadline=None)
@given(_spec())
def test_a_preference_changes_where_a_request_goes_never_whether(spec: _Spec) -> None:
    plain_request = spec.request
    warm_request = replace(plain_request, constraints=Constraints.build(prefer_workers=spec.prefer))
    plain, warm = _build(spec), _build(spec)
    on_preferred: dict[str, int] = {}  # GPUs of each preferred worker where it fits now
    for name in warm_request.constraints.prefer_workers:
        for gpu_id in warm.gpu_ids(name):
            if fits(warm, warm_request, gpu_id, {}):
                on_preferred[name] = on_preferred.get(name, 0) + 1
    could = any(n >= warm_request.gpus for n in on_preferred.values())
    outcomes: list[tuple[list[str], list[str]] | None] = []
    for sched, request in ((plain, plain_request), (warm, warm_request)):
        try:
            sched.submit(request, 1.0)
        except Unschedulable:
            outcomes.append(None)
            continue
        outcomes.append(_cycle(sched, 1.0))
    plain_outcome, warm_outcome = outcomes
    assert (plain_outcome is None) == (warm_outcome is None)  # rejection ignores preference
    if plain_outcome is None or warm_outcome is None:
        return
    (plain_granted, plain_revoked), (warm_granted, warm_revoked) = plain_outcome, warm_outcome
    assert plain_granted == warm_granted  # granted in the cycle iff granted without it
    assert plain_revoked == warm_revoked  # the same victims, or none
    if not warm_granted:
        assert not could  # GPUs where it fits now take it (I10)
        return
    warm_gpus, plain_gpus = warm.lease("r").gpus, plain.lease("r").gpus
    if could:
        assert warm_gpus[0].worker in warm_request.constraints.prefer_workers
    else:
        assert warm_gpus == plain_gpus  # exactly the placement without the preference
