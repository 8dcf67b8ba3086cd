"""What a gateway asks the controller for: a lease request that waits no longer than the
model's ``queue_timeout`` (nobody waits for it longer) and names the gateway that asked
(its state directory), so that the gateway restarted there can end what it left queued."""

from __future__ import annotations

import asyncio

import pytest

from .fakes import World, settle

pytestmark = pytest.mark.timeout(20)


async def test_a_lease_request_carries_the_queue_timeout_as_its_longest_wait() -> None:
    world = World(queue_timeout="45s")
    world.model.asker = {"gateway_dir": "/var/lib/gpu-arbiter"}
    request = world.model.lease_request(1)
    assert request["max_wait_s"] == 45.0
    assert request["metadata"]["gateway_dir"] == "/var/lib/gpu-arbiter"
    assert request["metadata"]["model"] == world.model.name
    await world.close()


async def test_a_request_the_controller_timed_out_is_no_failure_and_is_asked_again() -> None:
    """Its ``max_wait_s`` passed while callers still wait (one came later): the replica
    ends as cancelled, not failed (no back-off, no 502 to those waiting), and a new one
    asks again for them."""
    world = World(queue_timeout="60s")
    world.leases.grant = False
    caller = asyncio.ensure_future(world.model.acquire())
    await settle()
    assert list(world.leases.requests) == ["L1"]
    world.leases._set("L1", state="timed_out", end_reason="max_wait", ended_at=1.0)
    await settle()
    assert world.model.failures == 0
    assert list(world.leases.requests) == ["L1", "L2"]  # the caller still waits: asked again
    assert not caller.done()
    world.leases._set("L2", state="loading")
    await world.clock.advance(1)
    await settle()
    caller.cancel()
    await world.close()
