"""I8's dual in the controller (a fake clock, a memory store, restarts on the same store):
a request whose asker is gone ends ``abandoned``, a grant nobody takes up is given back
``unclaimed``, both stored with an event, and a restart gives each a whole bound."""

from __future__ import annotations

from typing import Any

from gpu_arbiter.controller import Controller, GpuProbeReport
from gpu_arbiter.core import Gpu, LeaseState
from gpu_arbiter.store import MemoryStore

from .support import Clock, request


def start(store: MemoryStore, clock: Clock) -> Controller:
    controller = Controller(store, clock=clock, heartbeat_timeout_s=1e9)
    controller.start()
    return controller


def ask(controller: Controller, vram_mb: int, **fields: Any) -> str:
    return controller.leases.submit("client-1", request(vram_mb, **fields)).record.id


def run_timers(controller: Controller) -> None:
    """What the controller's timer does when it rings: an empty change."""
    with controller.changes.change():
        pass


def events(controller: Controller, lease_id: str) -> list[tuple[str, Any]]:
    return [
        (e.kind, e.data.get("reason")) for e in controller.events.after(0) if e.lease_id == lease_id
    ]


def one_gpu(controller: Controller) -> None:
    controller.workers.register("box-1", [Gpu(index=0, total_mb=24_576, worker="box-1")])


async def test_a_request_nobody_asks_for_ends_abandoned_one_ttl_after_it_was_last_seen() -> None:
    store, clock = MemoryStore(), Clock()
    ctl = start(store, clock)
    one_gpu(ctl)
    ask(ctl, 20_000, ttl_s=None)  # holds the GPU
    waiting = ask(ctl, 20_000, ttl_s=30)
    with ctl.leases.watching(waiting):  # a long-poll open for 100 s: its asker is there
        clock.now += 100
        run_timers(ctl)
        assert ctl.leases.get(waiting).state is LeaseState.PENDING
    clock.now += 29.9
    run_timers(ctl)
    assert ctl.leases.get(waiting).state is LeaseState.PENDING
    clock.now += 0.1
    run_timers(ctl)
    ended = ctl.leases.get(waiting)
    assert (ended.state, ended.end_reason) == (LeaseState.CANCELLED, "abandoned")
    assert ("lease.cancelled", "abandoned") in events(ctl, waiting)
    stored = store.lease(waiting)
    assert stored is not None and stored.end_reason == "abandoned"


async def test_a_grant_nobody_took_up_is_given_back_and_the_next_request_granted() -> None:
    store, clock = MemoryStore(), Clock()
    ctl = start(store, clock)
    one_gpu(ctl)
    first = ask(ctl, 20_000, ttl_s=None)
    orphan = ask(ctl, 8_000, ttl_s=60)  # pending while first holds the GPU
    ctl.leases.release(first)  # granted now, while nobody waits for the answer
    assert ctl.leases.get(orphan).state is LeaseState.LOADING
    lease = store.lease(orphan)
    assert lease is not None and lease.lease is not None and not lease.lease.claimed
    nxt = ask(ctl, 20_000, ttl_s=60)
    assert ctl.leases.get(nxt).state is LeaseState.PENDING
    clock.now += 10  # min(claim_s 10, 60 / 3)
    with ctl.leases.watching(nxt):
        run_timers(ctl)
        ended = ctl.leases.get(orphan)
        assert (ended.state, ended.end_reason) == (LeaseState.RELEASED, "unclaimed")
        assert ("lease.released", "unclaimed") in events(ctl, orphan)
        granted = ctl.leases.get(nxt)
        assert granted.state is LeaseState.LOADING
        assert granted.lease is not None and granted.lease.claimed  # its long-poll's answer


async def test_a_grant_read_by_its_holder_is_kept() -> None:
    store, clock = MemoryStore(), Clock()
    ctl = start(store, clock)
    one_gpu(ctl)
    first = ask(ctl, 20_000, ttl_s=None)
    mine = ask(ctl, 8_000, ttl_s=60)
    ctl.leases.release(first)
    ctl.leases.claim(mine)
    stored = store.lease(mine)
    assert stored is not None and stored.lease is not None and stored.lease.claimed
    clock.now += 15
    run_timers(ctl)
    assert ctl.leases.get(mine).state is LeaseState.LOADING


async def test_a_restart_gives_pending_requests_and_unclaimed_grants_a_whole_bound() -> None:
    """Killed and restarted long after: nothing ends at the restart; each ends one bound
    after it unless its asker shows up."""
    store, clock = MemoryStore(), Clock()
    first = start(store, clock)
    one_gpu(first)
    big = ask(first, 16_000, ttl_s=None)
    waiting = ask(first, 16_000, ttl_s=30)
    first.leases.release(big)  # waiting is granted now, with nobody waiting for the answer
    first.close()
    clock.now += 500
    second = start(store, clock)
    restored = second.leases.get(waiting)
    assert restored.state.holds_memory and restored.lease is not None
    assert not restored.lease.claimed
    late = ask(second, 16_000, ttl_s=30)
    second.close()
    clock.now += 500
    third = start(store, clock)
    third.workers.heartbeat("box-1", [GpuProbeReport(0, 0)])  # its agent is back
    run_timers(third)
    assert third.leases.get(waiting).state.holds_memory
    assert third.leases.get(late).state is LeaseState.PENDING
    clock.now += 10  # min(claim_s 10, 30 / 3)
    run_timers(third)
    assert third.leases.get(waiting).end_reason == "unclaimed"
    assert third.leases.get(late).state is LeaseState.LOADING  # granted once it was freed
