"""An operator's hold on a model, on a virtual clock: a pinned model's lease stays marked
busy and its replica outlives keep_alive; unpin re-arms both timers from now;
``min_resident`` holds the idle mark back after a load; unload stops the replicas with
the grace of a revocation, cancels a queued one and releases the leases."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import pytest

from gpu_arbiter.gateway.servers.model import Refused
from gpu_arbiter.gateway.servers.replica import ReplicaState

from .fakes import World, settle

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    found = World(idle_after="0.5s", keep_alive="5s", grace="2s")
    yield found
    await found.close()


def stops(world: World, reason: str) -> float:
    return world.model.metrics.stops.labels("chat", reason)._value.get()


async def test_a_model_pinned_in_its_config_is_never_idle_nor_stopped() -> None:
    world = World(idle_after="0.5s", keep_alive="5s", pinned=True)
    await world.request()
    await world.clock.advance(600)
    assert "idle" not in world.leases.verbs()
    assert world.replica.state is ReplicaState.WARM
    assert world.process.signals == []
    found = world.model.describe()
    assert found["pinned"] is True
    assert found["preemptible_by"] == "priority above 500"
    assert "keep_alive_left_s" not in found["replicas"][0]
    await world.close()


async def test_pinning_a_model_marked_idle_marks_it_busy_at_once(world: World) -> None:
    await world.request()
    await world.clock.advance(0.6)
    assert world.leases.verbs()[-1] == "idle"
    await world.model.pin()
    assert world.leases.verbs()[-1] == "busy"
    assert world.replica.lease_idle is False
    await world.clock.advance(600)
    assert world.leases.verbs()[-1] == "busy"
    assert world.replica.ending is None
    await world.request()  # a request comes and goes: still never idle
    await world.clock.advance(600)
    assert world.leases.verbs()[-1] == "busy"
    assert world.replica.ending is None


async def test_unpin_re_arms_idle_and_keep_alive_from_now(world: World) -> None:
    await world.model.pin()
    await world.request()
    await world.clock.advance(100)
    world.model.unpin()
    await world.clock.advance(0.4)
    assert "idle" not in world.leases.verbs()
    await world.clock.advance(0.2)
    assert world.leases.verbs()[-1] == "idle"
    assert world.model.describe()["replicas"][0]["keep_alive_left_s"] == pytest.approx(4.4)
    await world.clock.advance(4.3)
    assert world.process.signals == []
    await world.clock.advance(0.2)
    assert world.process.signals == [signal.SIGTERM]
    await settle()
    assert world.model.replicas == []
    assert stops(world, "keep_alive") == 1


async def test_a_pinned_replica_taken_by_a_higher_priority_is_preempted_not_reclaimed(
    world: World,
) -> None:
    await world.model.pin()
    await world.request()
    await world.clock.advance(10)
    world.leases.revoke(world.replica.lease_id)
    await world.clock.advance(1)
    assert world.model.replicas == []
    assert stops(world, "preempted") == 1
    assert stops(world, "reclaimed") == 0


async def test_who_may_take_a_pinned_model_follows_its_priority_and_preemptible() -> None:
    cases = [
        ({"priority": "batch"}, "priority above 100"),
        ({"priority": "interactive"}, None),  # not preemptible by default
        ({"priority": "interactive", "preemptible": True}, "priority above 800"),
        ({"priority": 500, "preemptible": False}, None),
    ]
    for keys, expected in cases:
        world = World(**keys)
        assert world.model.preemptible_by() == expected, keys
        assert world.model.describe()["preemptible_by"] == expected
        await world.close()


async def test_min_resident_holds_the_idle_mark_back_after_a_load() -> None:
    world = World(idle_after="0.5s", keep_alive="5m", min_resident="10s")
    await world.request()
    await world.clock.advance(9.9)
    assert "idle" not in world.leases.verbs()
    await world.clock.advance(0.2)
    assert world.leases.verbs()[-1] == "idle"
    await world.request()  # resident long enough: idle_after alone counts now
    await world.clock.advance(0.6)
    assert world.leases.verbs()[-2:] == ["busy", "idle"]
    await world.close()


async def test_keep_alive_still_counts_from_the_last_request_under_min_resident() -> None:
    world = World(idle_after="0.5s", keep_alive="3s", min_resident="1m")
    await world.request()
    await world.clock.advance(2.9)
    assert world.process.signals == []
    await world.clock.advance(0.2)
    assert world.process.signals == [signal.SIGTERM]
    assert "idle" not in world.leases.verbs()
    await world.close()


async def test_unload_lets_requests_finish_within_the_grace_then_stops_and_releases(
    world: World,
) -> None:
    await world.request()
    lease_id = world.replica.lease_id
    request = world.start(hold_s=1.5)
    await world.clock.advance(0.1)
    unload = asyncio.ensure_future(world.model.unload())
    await world.clock.advance(0.5)
    assert world.process.signals == []  # its request still has the grace
    assert not world.replica.accepting
    assert not unload.done()
    await world.clock.advance(1.0)
    await request
    await settle()
    assert world.process.signals == [signal.SIGTERM]
    assert world.agent.stops == [lease_id]
    assert world.leases.verbs()[-1] == "release"
    assert await unload == {
        "id": "chat", "stopped": 1, "cancelled": 0, "still_stopping": 0, "state": "cold",
    }  # fmt: skip
    assert stops(world, "unloaded") == 1
    await world.request()  # a later request starts it again
    assert len(world.launcher.processes) == 2


async def test_unload_cancels_a_queued_replica_and_refuses_its_waiting_request(
    world: World,
) -> None:
    world.leases.grant = False
    request = world.start()
    await world.clock.advance(1)
    assert world.replica.state is ReplicaState.QUEUED
    answer = await world.model.unload()
    assert (answer["stopped"], answer["cancelled"], answer["state"]) == (0, 1, "cold")
    with pytest.raises(Refused) as refused:
        await request
    assert refused.value.status == 503
    assert "unloaded by an operator" in refused.value.reason
    assert world.leases.verbs() == ["create", "release"]  # the pending request withdrawn
    assert world.launcher.processes == []
    assert stops(world, "unloaded") == 0


async def test_an_unload_for_a_drain_says_so_to_the_request_it_refuses(world: World) -> None:
    world.leases.grant = False
    request = world.start()
    await world.clock.advance(1)
    await world.model.unload("for the drain: gateway gw-3's worker box-3 is draining")
    with pytest.raises(Refused) as refused:
        await request
    assert refused.value.status == 503
    assert refused.value.reason == (
        "model chat was unloaded for the drain: gateway gw-3's worker box-3 is draining"
    )


async def test_unloading_a_cold_model_stops_nothing(world: World) -> None:
    answer = await world.model.unload()
    assert (answer["stopped"], answer["cancelled"], answer["state"]) == (0, 0, "cold")
    assert world.leases.calls == []
