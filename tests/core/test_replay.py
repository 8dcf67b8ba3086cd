"""Decisions replayed from a log: the same calls on a fresh scheduler decide the same."""

from __future__ import annotations

import contextlib
from typing import Any

import hypothesis.strategies as st
from hypothesis import given, settings

from gpu_arbiter.core import ArbiterError, GpuProbe, Policy, Scheduler, Worker
from gpu_arbiter.core.replay import Call, Recorder, replay

from .support import GiB, gid, gpu, req

GPUS = [gpu(0, worker="w1"), gpu(1, total_mb=16 * GiB, worker="w1"), gpu(0, worker="w2")]
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.sampled_from([2, 6, 12, 20, 24]),
            st.sampled_from(["batch", "normal", "interactive"]),
        ),
        st.tuples(st.sampled_from(["release", "ready", "idle", "revoke"]), st.integers(0, 30)),
        st.tuples(st.just("probe"), st.integers(0, 2), st.integers(0, 20)),
        st.tuples(st.sampled_from(["drain", "cancel_drain"]), st.sampled_from(["w1", "w2"])),
        st.tuples(st.just("time"), st.sampled_from([0.5, 5.0, 40.0])),
        st.just(("decide",)),
    ),
    max_size=60,
)


def _run(sched: Any, ops: list[tuple[Any, ...]]) -> None:
    """Drives ``sched`` (a :class:`Recorder`) through ``ops``, as a driver would."""
    now = 0.0
    for name, worker in (("w1", GPUS[:2]), ("w2", GPUS[2:])):
        sched.put_worker(Worker(name), worker)
    for i, op in enumerate(ops):
        with contextlib.suppress(ArbiterError):  # a refusal is logged as an outcome too
            _step(sched, op, i, now)
        if op[0] == "time":
            now += op[1]
        sched.decide(now)


def _step(sched: Any, op: tuple[Any, ...], i: int, now: float) -> None:
    kind = op[0]
    if kind == "submit":
        sched.submit(req(f"r{i}", op[1] * GiB, priority=op[2], ttl_s=30.0), now)
    elif kind in ("release", "ready", "idle", "revoke"):
        lease_id = f"r{op[1]}"
        if kind == "release":
            sched.release(lease_id, now)
        elif kind == "ready":
            sched.ready(lease_id, now)
        elif kind == "idle":
            sched.set_idle(lease_id, True, now)
        else:
            sched.revoke(lease_id, "revoked_by_admin", now)
    elif kind == "probe":
        target = GPUS[op[1]]
        sched.set_probe(gid(str(target.id)), GpuProbe(used_mb=op[2] * GiB))
    elif kind == "drain":
        sched.drain(op[1], now)
    elif kind == "cancel_drain":
        sched.cancel_drain(op[1])


@settings(max_examples=150, deadline=None)
@given(ops=OPS, placement=st.sampled_from(["binpack", "spread"]))
def test_a_logged_run_replays_to_the_same_decisions(
    ops: list[tuple[Any, ...]], placement: str
) -> None:
    policy = Policy(placement=placement, idle_reclaim_s=10.0)  # type: ignore[arg-type]
    recorder = Recorder(Scheduler(policy))
    _run(recorder, ops)
    assert replay(recorder.calls, policy) == recorder.outcomes


def test_a_replay_under_another_policy_decides_otherwise() -> None:
    """The comparison sees a difference: binpack and spread place the same request apart."""
    recorder = Recorder(Scheduler(Policy(placement="binpack")))
    _run(recorder, [("submit", 2, "normal"), ("decide",)])
    outcomes = zip(recorder.outcomes, recorder.calls, strict=True)
    grants = [o for o, c in outcomes if c.name == "decide"]
    assert [lease.gpus for d in grants for lease in d.grants] == [(gid("w1:1"),)]
    spread = replay(recorder.calls, Policy(placement="spread"))
    assert spread != recorder.outcomes
    assert recorder.calls[0] == Call("put_worker", (Worker("w1"), GPUS[:2]), {})
