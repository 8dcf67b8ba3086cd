"""After every acknowledged change, the store holds exactly what the controller holds,
and a controller started from the store holds it too (hypothesis over random changes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_arbiter.controller import Controller, GpuProbeReport
from gpu_arbiter.core import ArbiterError, Gpu
from gpu_arbiter.store import MemoryStore

from .support import request

WORKERS = ("gpu", "gpu-2")
op = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 30), st.sampled_from((1, 2)), st.floats(1, 20)),
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("ready"), st.integers(0, 40)),
    st.tuples(st.just("idle"), st.integers(0, 40)),
    st.tuples(st.just("shrink"), st.integers(0, 40), st.integers(1, 40)),
    st.tuples(st.just("revoke"), st.integers(0, 40)),
    st.tuples(st.just("drain"), st.sampled_from(WORKERS), st.booleans()),
    st.tuples(st.just("cancel_drain"), st.sampled_from(WORKERS)),
    st.tuples(st.just("heartbeat"), st.sampled_from(WORKERS), st.integers(0, 8)),
    st.tuples(st.just("stop"), st.sampled_from(WORKERS), st.integers(0, 40)),
    st.tuples(st.just("tick"), st.floats(0.1, 20)),
    st.tuples(st.just("restart")),
)


class Clock:
    now = 10_000.0

    def __call__(self) -> float:
        return self.now


def _start(store: MemoryStore, clock: Clock) -> Controller:
    controller = Controller(store, clock=clock, heartbeat_timeout_s=15.0)
    controller.start()
    return controller


def _apply(c: Controller, clock: Clock, ids: list[str], step: tuple[Any, ...]) -> None:
    kind = step[0]
    pick = (lambda i: ids[i % len(ids)]) if ids else (lambda i: "none")
    if kind == "submit":
        asked = request(step[1] * 1024, gpus=step[2], ttl_s=step[3])
        record = c.leases.submit("owner", asked).record
        ids.append(record.id)
    elif kind in ("release", "ready", "revoke"):
        getattr(c.leases, kind)(pick(step[1]))
    elif kind == "idle":
        c.leases.set_idle(pick(step[1]), True)
    elif kind == "shrink":  # larger than the lease holds: refused
        c.leases.shrink(pick(step[1]), step[2] * 512)
    elif kind == "drain":
        c.workers.drain(step[1], force=step[2])
    elif kind == "cancel_drain":
        c.workers.cancel_drain(step[1])
    elif kind == "heartbeat":
        c.workers.heartbeat(step[1], [GpuProbeReport(0, step[2] * 1024), GpuProbeReport(1, 0)])
    elif kind == "stop":
        c.workers.heartbeat(step[1], [], stopped=[pick(step[2])])
    elif kind == "tick":
        clock.now += step[1]
        c.pause()
        c.resume()


def _live(c: Controller) -> dict[str, Any]:
    return {
        r.id: (r.state, r.token, r.lease and (r.lease.gpus, r.lease.vram_mb))
        for r in c.leases.all()
        if not r.state.is_final
    }


def _check(c: Controller, store: MemoryStore) -> None:
    snapshot = store.load()
    stored = {
        r.id: (r.state, r.token, r.lease and (r.lease.gpus, r.lease.vram_mb))
        for r in snapshot.leases
    }
    assert stored == _live(c)
    assert {w.name: w.status for w in snapshot.workers} == {
        w.name: w.status for w in c.workers.all()
    }
    assert snapshot.meta["next_token"] == c.scheduler.next_token
    committed: dict[Any, int] = defaultdict(int)
    for record in c.leases.all():
        if record.state.holds_memory and record.lease is not None:
            for gpu in record.lease.gpus:
                committed[gpu] += record.lease.vram_mb  # as shrunk
    for name in WORKERS:
        for figures in c.workers.gpu_figures(name):
            assert committed[figures.gpu.id] == figures.committed_mb
            assert figures.committed_mb <= figures.gpu.capacity_mb  # I1


async def _run(steps: list[tuple[Any, ...]]) -> None:
    store, clock = MemoryStore(), Clock()
    c = _start(store, clock)
    for name in WORKERS:
        c.workers.register(name, [Gpu(index=i, total_mb=32768, worker=name) for i in range(2)])
    ids: list[str] = []
    highest_token = 0
    holders: dict[int, str] = {}
    for step in steps:
        if step[0] == "restart":
            before = _live(c)
            c.close()
            c = _start(store, clock)
            after = _live(c)
            for lease_id in before.keys() & after.keys():  # a lapsed TTL may end some
                assert after[lease_id][1:] == before[lease_id][1:]  # token, GPUs, size
        else:
            with contextlib.suppress(ArbiterError):  # a refusal must change nothing
                _apply(c, clock, ids, step)
        _check(c, store)
        granted = {r.id: r.token for r in c.leases.all() if r.token is not None}
        for lease_id, token in granted.items():
            if lease_id not in holders.values():  # granted in this step: above all before
                assert token > highest_token
            assert holders.setdefault(token, lease_id) == lease_id  # never reused
        highest_token = max([highest_token, *granted.values()])
    c.close()


@settings(
    max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.lists(op, min_size=1, max_size=40))
def test_store_always_matches_the_controller(steps: list[tuple[Any, ...]]) -> None:
    asyncio.run(_run(steps))
