"""What a gateway asks the controller for: a lease request that waits no longer than the
model's ``queue_timeout`` (nobody waits for it longer) and names the gateway that asked
(its state directory), so that the gateway restarted there can end what it left queued."""

from __future__ import annotations

import pytest

from .fakes import World

pytestmark = pytest.mark.timeout(20)


async def test_a_lease_request_carries_the_queue_timeout_as_its_longest_wait() -> None:
    world = World(queue_timeout="45s")
    world.model.asker = {"gateway_dir": "/var/lib/gpu-arbiter"}
    request = world.model.lease_request(1)
    assert request["max_wait_s"] == 45.0
    assert request["metadata"]["gateway_dir"] == "/var/lib/gpu-arbiter"
    assert request["metadata"]["model"] == world.model.name
    await world.close()
