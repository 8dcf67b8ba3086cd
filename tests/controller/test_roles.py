"""Leader and standby on one store, without HTTP: a standby reads what the leader
committed and refuses changes; a demoted leader drops what it did not commit; a
promoted standby continues the tokens."""

from __future__ import annotations

import asyncio

import pytest

from gpu_arbiter.controller import Controller, GpuProbeReport, NotLeader
from gpu_arbiter.core import Conflict, LeaseState
from gpu_arbiter.store import MemoryStore

from .test_controller import Clock, ask, gpus, start


def standby(store: MemoryStore, clock: Clock, leader_url: str | None = None) -> Controller:
    controller = Controller(store, clock=clock, heartbeat_timeout_s=15.0)
    controller.mirror(leader_url)
    return controller


async def test_a_standby_reads_the_leaders_commits_and_refuses_changes() -> None:
    store, clock = MemoryStore(), Clock()
    leader = start(store, clock)
    leader.workers.register("box-1", gpus("box-1", count=1))
    held = leader.leases.get(ask(leader, 20_000))
    waiting = leader.leases.get(ask(leader, 20_000))  # no room left: it waits

    copy = standby(store, clock, "http://leader:7070")
    assert copy.leases.get(held.id).token == held.token
    assert copy.leases.get(waiting.id).state is LeaseState.PENDING
    assert [w.name for w in copy.workers.all()] == ["box-1"]
    assert copy.status()["role"] == "standby"
    assert copy.status()["leader"] == "http://leader:7070"
    with pytest.raises(NotLeader) as refused:
        ask(copy, 1_000)
    assert refused.value.details["leader"] == "http://leader:7070"
    with pytest.raises(NotLeader):
        copy.leases.release(held.id)
    assert copy.leases.get(held.id).state is LeaseState.LOADING  # nothing changed

    leader.leases.release(held.id)
    copy.mirror("http://leader:7070")  # the next reload sees it
    assert copy.leases.get(held.id).state is LeaseState.RELEASED
    assert copy.leases.get(waiting.id).state is LeaseState.LOADING


async def test_a_promoted_standby_continues_tokens_and_a_demoted_leader_refuses() -> None:
    store, clock = MemoryStore(), Clock()
    leader = start(store, clock)
    leader.workers.register("box-1", gpus("box-1"))
    first = leader.leases.get(ask(leader, 1_000))
    copy = standby(store, clock)

    leader.demote("http://other:7070")
    with pytest.raises(NotLeader):
        ask(leader, 1_000)
    assert leader.leases.get(first.id).token == first.token  # reads still answer

    copy.start()
    assert copy.status()["role"] == "leader"
    copy.workers.heartbeat("box-1", [GpuProbeReport(0, 1_000), GpuProbeReport(1, 0)])
    later = copy.leases.get(ask(copy, 1_000))
    assert later.token is not None and first.token is not None
    assert later.token > first.token
    assert copy.leases.get(first.id).state is LeaseState.LOADING


async def test_a_long_poll_on_a_demoted_leader_answers_from_the_new_leaders_commits() -> None:
    store, clock = MemoryStore(), Clock()
    old = start(store, clock)
    old.workers.register("box-1", gpus("box-1", count=1))
    held = old.leases.get(ask(old, 20_000))
    waiting = old.leases.get(ask(old, 20_000))
    poll = asyncio.create_task(old.events.wait_lease(waiting.id, LeaseState.PENDING, 30))
    await asyncio.sleep(0)
    old.demote()
    new = standby(store, clock)
    new.start()
    new.workers.heartbeat("box-1", [GpuProbeReport(0, 20_000)])
    new.leases.release(held.id)
    new.workers.heartbeat(
        "box-1", [GpuProbeReport(0, 0)]
    )  # the memory is back: the waiter is granted
    assert new.leases.get(waiting.id).state is LeaseState.LOADING
    assert not poll.done()
    old.mirror()  # the standby's next reload
    answered = await asyncio.wait_for(poll, 5)
    assert answered.state is LeaseState.LOADING
    assert answered.token == new.leases.get(waiting.id).token


async def test_a_lease_does_not_lapse_for_the_time_no_controller_led() -> None:
    store, clock = MemoryStore(), Clock()
    leader = start(store, clock)
    leader.workers.register("box-1", gpus("box-1"))
    held = leader.leases.get(ask(leader, 1_000, ttl_s=10))
    leader.close()  # the leader dies; its holder cannot renew with nobody leading

    clock.now += 60  # far past the lease's TTL
    successor = start(store, clock)
    kept = successor.leases.get(held.id)
    assert kept.state is LeaseState.LOADING  # its memory stays committed
    assert kept.lease is not None and kept.lease.expires_at == clock.now + 10
    # re-armed in the core, not written: the next start re-arms from its own time again
    assert store.lease(held.id).lease.expires_at == held.lease.expires_at  # type: ignore[union-attr]

    clock.now += 11  # a holder that is gone lapses one TTL after the take-over
    with pytest.raises(Conflict, match="expired"):
        successor.leases.renew(held.id)
    assert successor.leases.get(held.id).state is LeaseState.EXPIRED
