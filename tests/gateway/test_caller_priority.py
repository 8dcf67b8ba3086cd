"""Callers of different importance share one model, on a virtual clock: a replica's lease
is asked for at the model's priority raised to the highest caller waiting (never
lowered by a batch caller, so never made preemptible by one); a replica still queued
at a lower priority is asked for again when a higher caller comes; a granted lease
keeps its priority and serves every caller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpu_arbiter.gateway.servers.replica import Replica, ReplicaState

from .fakes import World, settle

pytestmark = pytest.mark.timeout(20)
BATCH, NORMAL, INTERACTIVE = 100, 500, 800


@pytest.fixture
async def queued() -> AsyncIterator[World]:
    """A batch model whose leases stay pending until the test grants them."""
    found = World(priority="batch", idle_after="0.5s", keep_alive="5m")
    found.leases.grant = False
    yield found
    await found.close()


def asked(world: World) -> list[tuple[str, Any, Any]]:
    """Each lease asked for: its id, priority and preemptible, in order."""
    return [
        (lease_id, request["priority"], request["preemptible"])
        for lease_id, request in world.leases.requests.items()
    ]


def call(world: World, priority: int | None, hold_s: float = 0.0) -> asyncio.Task[Replica]:
    """A caller of ``priority`` (None: no key priority) holding its slot ``hold_s``."""

    async def request() -> Replica:
        replica, _ = await world.model.acquire(priority=priority)
        try:
            if hold_s:
                await world.clock.sleep(hold_s)
        finally:
            replica.leave()
        return replica

    return asyncio.ensure_future(request())


async def test_a_cold_start_is_asked_at_the_waiting_callers_higher_priority() -> None:
    world = World(priority="batch")
    replica = await call(world, INTERACTIVE)
    assert asked(world) == [("L1", INTERACTIVE, None)]  # preemptible: the controller's
    assert replica.priority == INTERACTIVE
    found = world.model.describe()
    assert found["replicas"][0]["priority"] == INTERACTIVE
    assert found["preemptible_by"] is None  # 800: not preemptible, as the controller sees it
    await world.close()


async def test_a_caller_without_a_key_priority_gets_the_models() -> None:
    world = World(priority="background")
    await call(world, None)
    assert asked(world) == [("L1", 300, None)]
    await world.close()


@pytest.mark.parametrize(("preemptible", "sent"), [(None, None), (True, True)])
async def test_a_batch_caller_never_lowers_an_interactive_models_lease(
    preemptible: bool | None, sent: bool | None
) -> None:
    """So a batch key never makes an interactive model preemptible: ``preemptible`` is
    the controller's default for 800 (false) unless the model itself sets it."""
    keys = {} if preemptible is None else {"preemptible": preemptible}
    world = World(priority="interactive", **keys)
    await call(world, BATCH)
    assert asked(world) == [("L1", INTERACTIVE, sent)]
    await world.close()


async def test_a_queued_replica_is_asked_again_when_a_higher_caller_comes(
    queued: World,
) -> None:
    batch = call(queued, BATCH)
    await settle()
    assert asked(queued) == [("L1", BATCH, None)]
    [replica] = queued.model.replicas
    assert replica.state is ReplicaState.QUEUED
    chat = call(queued, INTERACTIVE)
    await settle()
    assert asked(queued) == [("L1", BATCH, None), ("L2", INTERACTIVE, None)]
    assert queued.leases.leases["L1"]["state"] == "released"  # no batch lease left behind
    assert queued.model.replicas == [replica]  # the same replica, moved up a class
    assert replica.priority == INTERACTIVE and replica.lease_id == "L2"
    queued.leases.give("L2")
    assert await chat is replica and await batch is replica  # both served by it
    assert queued.leases.verbs() == ["create", "release", "create", "ready"]


async def test_a_lower_or_equal_caller_leaves_a_queued_replica_where_it_is(
    queued: World,
) -> None:
    first = call(queued, None)  # the model's own priority
    await settle()
    for priority in (BATCH, 50, None):
        call(queued, priority)
        await settle()
    assert asked(queued) == [("L1", BATCH, None)]
    assert queued.leases.verbs() == ["create"]
    queued.leases.give("L1")
    await first


async def test_a_queued_replica_moved_up_is_not_moved_down_again(queued: World) -> None:
    """The interactive caller gives up (its client went away): the replica still queued
    keeps the lease it was asked again for; nothing is asked twice."""
    batch = call(queued, BATCH)
    await settle()
    chat = call(queued, INTERACTIVE)
    await settle()
    chat.cancel()
    await settle()
    assert asked(queued) == [("L1", BATCH, None), ("L2", INTERACTIVE, None)]
    queued.leases.give("L2")
    replica = await batch
    assert replica.priority == INTERACTIVE


async def test_a_granted_lease_keeps_its_priority_and_the_next_replica_follows() -> None:
    """A warm batch replica serves an interactive caller while it has a slot (the
    controller has no verb to raise a granted lease); once it is full, the replica asked
    for next is at the interactive caller's priority."""
    world = World(priority="batch", max_parallel=1, replicas=2, keep_alive="5m")
    first = await call(world, BATCH)
    assert await call(world, INTERACTIVE) is first  # shared: no lease asked for it
    assert asked(world) == [("L1", BATCH, None)]
    long = call(world, BATCH, hold_s=100)
    await settle()
    second = await call(world, INTERACTIVE)  # the first is full: a second replica
    assert second is not first
    assert asked(world) == [("L1", BATCH, None), ("L2", INTERACTIVE, None)]
    assert first.priority == BATCH and second.priority == INTERACTIVE
    assert world.model.describe()["preemptible_by"] == "priority above 100"  # the first's
    await world.clock.advance(100)
    await long
    await world.close()


async def test_a_replica_that_wakes_asks_back_at_the_waiting_callers_priority() -> None:
    """What a sleeping replica gave back is asked for again like any lease: at the
    priority of the caller who wakes it, if higher."""
    world = World(
        priority="batch", command=["vllm", "serve", "m", "--port", "{port}"], vram="1000M",
        idle_after="0.5s", sleep_after="10s", keep_alive="5m",
    )  # fmt: skip
    world.model.vram_mb = 1000
    world.agent.used = 1000
    await call(world, BATCH)
    await world.clock.advance(10.1)
    await world.clock.advance(3)
    assert world.replica.state is ReplicaState.ASLEEP
    woken = call(world, INTERACTIVE)
    await world.clock.advance(0)
    await woken
    assert asked(world) == [("L1", BATCH, None), ("L2", INTERACTIVE, None)]
    assert world.leases.requests["L2"]["vram_mb"] == 700  # the wake's: the difference
    await world.close()
