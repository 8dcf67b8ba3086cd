"""Collation with a bound: a model kept busy by a stream of requests keeps its GPU while
another model of the gateway waits, its own requests served first, but only for
``swap_after``: then its lease is marked idle although busy, so the waiting model may
reclaim it (the requests in flight get the grace)."""

from __future__ import annotations

import asyncio

import pytest

from gpu_arbiter.gateway.base.metrics import GatewayMetrics
from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.servers.model import ModelServer, Refused

from .fakes import World

pytestmark = pytest.mark.timeout(20)


def neighbour(world: World, name: str, **keys: object) -> ModelServer:
    spec = {"command": ["server", "--port", "{port}"], "vram": "1G", **keys}
    config = parse_config({"models": {name: spec}}).models[name]
    other = ModelServer(
        config, parts=world.model.parts, metrics=GatewayMetrics(), worker="box", vram_mb=1024
    )
    world.run(other)
    models = {"chat": world.model, name: other}
    world.model.neighbours = other.neighbours = models
    return other


async def test_a_busy_model_yields_after_another_waited_swap_after() -> None:
    world = World(idle_after="0.5s", swap_after="5s")
    other = neighbour(world, "other", queue_timeout="60s")
    await world.request()
    busy = world.start(hold_s=100)  # a long request keeps chat busy
    await world.clock.advance(1)
    world.leases.grant = False  # the GPU is full: other's lease waits
    other_wait = asyncio.ensure_future(other.acquire())
    await world.clock.advance(4)
    assert world.leases.verbs().count("idle") == 0  # other waited 4 s: chat keeps it
    more = world.start(hold_s=1)  # chat's requests that come meanwhile are served
    await world.clock.advance(1.5)
    await more
    assert world.leases.verbs()[-1] == "idle", world.leases.calls  # other waited 5 s
    assert world.replica.in_flight == 1  # while its long request still runs
    again = world.start(hold_s=1)
    await world.clock.advance(0.1)
    assert world.leases.verbs()[-1] == "idle"  # not marked busy while other waits
    await world.clock.advance(60)
    with pytest.raises(Refused):
        await other_wait
    await again
    late = world.start(hold_s=1)
    await world.clock.advance(0.1)
    assert world.leases.verbs()[-1] == "busy"  # nobody waits any more
    await world.clock.advance(40)
    await late
    await busy
    await world.close()


async def test_a_lower_priority_waiter_does_not_make_it_yield() -> None:
    world = World(idle_after="0.5s", swap_after="5s", priority="interactive")
    other = neighbour(world, "other", priority="batch", queue_timeout="60s")
    await world.request()
    busy = world.start(hold_s=30)
    await world.clock.advance(0.1)
    world.leases.grant = False
    other_wait = asyncio.ensure_future(other.acquire())
    await world.clock.advance(20)
    assert "idle" not in world.leases.verbs()[2:]  # batch cannot reclaim it: no yield
    await world.clock.advance(50)
    with pytest.raises(Refused):
        await other_wait
    await busy
    await world.close()
