"""A request waiting for a model whose lease waits behind another model of the same
gateway is told which model is in the way and when it gives way: a busy one after
``swap_after`` (the gateway's rule), an idle one by the controller's rule and countdown
(I5: ``idle_reclaim_s``); a request whose replica was never granted its lease is refused
as still queued, never as "not ready". On a virtual clock, over the fakes; the
controller's reason is what it would answer (``blockers``, as the core names them)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from gpu_arbiter.gateway.servers.model import ModelServer, Refused
from gpu_arbiter.gateway.servers.replica import Replica, ReplicaState

from .fakes import World, settle
from .test_collation import neighbour

pytestmark = pytest.mark.timeout(20)


async def _queued(other: ModelServer, blocker: dict[str, Any]) -> tuple[Replica, Any]:
    """``other`` asked for a lease that stays pending; the controller names ``blocker``."""
    waiting = asyncio.ensure_future(other.acquire())
    await settle()
    [replica] = other.replicas
    assert replica.state is ReplicaState.QUEUED
    reason = {"code": "insufficient_vram", "blockers": [blocker]}
    # the controller's clock differs from ours
    replica.lease = replace(replica.holding, submitted_at=5000.0, reason=reason)
    return replica, waiting


async def test_a_busy_model_in_the_way_is_named_with_its_swap_after_countdown() -> None:
    world = World(idle_after="0.5s", swap_after="30s")
    other = neighbour(world, "other", queue_timeout="60s")
    busy = world.start(hold_s=100)  # chat is busy for 100 s
    await world.clock.advance(1)
    world.leases.grant = False
    chat_lease = world.replica.lease_id
    blocker = {"id": chat_lease, "state": "busy", "until": None, "rule": "not_preemptible"}
    replica, waiting = await _queued(other, blocker)
    replica.pending_reason = "position 1: 0/1 GPUs fit"
    assert other.waiting_for() == (
        "queued, 'chat' is busy: swapped after 30s more (swap_after); position 1: 0/1 GPUs fit"
    )
    await world.clock.advance(5)
    assert other.waiting_for().startswith("queued, 'chat' is busy: swapped after 25s more")
    described = other.describe()["pending_reason"]  # gpu-arbiter models shows the same
    assert described.startswith("'chat' is busy: swapped after 25s more (swap_after)")
    await world.clock.advance(60)  # other's queue_timeout: still queued, said so
    with pytest.raises(Refused) as refused:
        await waiting
    assert "not ready" not in refused.value.reason
    assert refused.value.reason.startswith("model other still queued for its lease after 60s: ")
    assert "position 1: 0/1 GPUs fit" in refused.value.reason
    await world.clock.advance(40)
    await busy
    await world.close()


async def test_an_idle_model_in_the_way_is_named_with_the_controllers_countdown() -> None:
    world = World(idle_after="0.5s", priority="interactive")
    other = neighbour(world, "other", priority="batch", queue_timeout="60s")
    await world.request()
    await world.clock.advance(1)  # chat's lease marked idle: warm
    assert world.replica.lease_idle
    world.leases.grant = False
    blocker = {
        "id": world.replica.lease_id, "state": "idle", "since": 4995.0, "until": 5055.0,
        "rule": "idle_reclaim_s",
    }  # fmt: skip
    await _queued(other, blocker)
    assert other.waiting_for().startswith(
        "queued, waiting for idle 'chat' (interactive): reclaimable by batch in 55s "
        "(idle_reclaim_s); "
    )
    await world.clock.advance(10)
    assert "reclaimable by batch in 45s (idle_reclaim_s)" in other.waiting_for()
    await world.close()


async def test_a_lease_of_no_model_of_this_gateway_leaves_the_controllers_words() -> None:
    world = World()
    world.leases.grant = False
    replica, _ = await _queued(world.model, {"id": "L77", "state": "busy", "until": None})
    replica.pending_reason = "position 1: waiting for busy lease L77"
    assert world.model.waiting_for() == "queued, position 1: waiting for busy lease L77"
    await world.close()
