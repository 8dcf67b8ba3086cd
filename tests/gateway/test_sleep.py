"""The asleep tier on a virtual clock: idle ``sleep_after``, a server that can sleep gives
its memory back and its lease shrinks to what the probe shows it keeps; a request asks
for the difference again (on the same GPUs, through the queue) before the wake; nobody
waiting any more, the wake is given up; ``keep_alive`` still stops it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gpu_arbiter.gateway.servers.model import Refused
from gpu_arbiter.gateway.servers.replica import ReplicaState

from .fakes import World, settle

pytestmark = pytest.mark.timeout(20)
VLLM = ["vllm", "serve", "m", "--port", "{port}"]


@pytest.fixture
async def world() -> AsyncIterator[World]:
    found = World(
        command=VLLM, vram="1000M", idle_after="0.5s", sleep_after="10s", keep_alive="5m",
        grace="2s",
    )  # fmt: skip
    found.model.vram_mb = 1000
    found.agent.used = 1000  # the probe's figure for the server's group
    yield found
    await found.close()


async def asleep(world: World) -> None:
    await world.request()
    await world.clock.advance(10.1)  # sleep_after: the engine is asked to sleep
    await world.clock.advance(3)  # the probe's figure steady for 2 s: measured
    assert world.replica.state is ReplicaState.ASLEEP


async def test_an_idle_server_sleeps_and_its_lease_shrinks_to_what_it_keeps(
    world: World,
) -> None:
    await asleep(world)
    assert world.engine.calls[-1] == "/sleep"
    assert world.leases.leases["L1"]["vram_mb"] == 300  # what the probe shows it keeps
    assert world.process.signals == []  # the process is kept
    assert world.model.describe()["state"] == "asleep"
    assert world.model.metrics.sleeps.labels("chat")._value.get() == 1


async def test_a_request_takes_the_memory_back_on_the_same_gpus_then_wakes_it(
    world: World,
) -> None:
    await asleep(world)
    request = world.start()
    await world.clock.advance(0)
    await request
    extra = world.leases.requests["L2"]
    assert extra["vram_mb"] == 700  # the difference, asked for again
    # on its own GPUs, and never taking the sleeping lease it extends
    assert extra["constraints"] == {"gpu_ids": ["box:0"], "never_preempt": ["L1"]}
    assert world.engine.calls[-1] == "/wake_up"
    assert world.leases.leases["L2"]["state"] == "active"
    assert world.replica.state is ReplicaState.WARM
    assert len(world.launcher.processes) == 1  # no cold start
    assert world.model.metrics.wakes.labels("chat")._value.get() == 1


async def test_asleep_again_the_lease_taken_back_is_released(world: World) -> None:
    await asleep(world)
    await world.request()
    await world.clock.advance(10.1)
    await world.clock.advance(3)
    assert world.replica.state is ReplicaState.ASLEEP
    assert world.leases.leases["L2"]["state"] == "released"
    assert world.leases.leases["L1"]["vram_mb"] == 300


async def test_a_wake_that_is_not_granted_is_given_up_when_nobody_waits() -> None:
    world = World(
        command=VLLM, vram="1000M", idle_after="0.5s", sleep_after="10s",
        queue_timeout="30s",
    )  # fmt: skip
    world.agent.used = 1000
    await asleep(world)
    world.leases.grant = False  # the GPU is taken meanwhile
    request = world.start()
    await world.clock.advance(1)
    assert world.replica.state is ReplicaState.WAKING
    assert world.leases.leases["L1"]["idle"] is False  # not reclaimed for its own wake
    await world.clock.advance(30)
    with pytest.raises(Refused):
        await request
    await settle()
    assert world.replica.state is ReplicaState.ASLEEP
    assert world.leases.leases["L1"]["idle"] is True  # a cache again
    assert world.leases.leases["L2"]["state"] == "released"  # the pending one cancelled
    assert "/wake_up" not in world.engine.calls
    await world.close()


async def test_keep_alive_ends_the_sleep_with_a_stop(world: World) -> None:
    await asleep(world)
    await world.clock.advance(300)
    await settle()
    assert world.model.replicas == []
    assert world.leases.verbs()[-1] == "release"


async def test_a_server_whose_figure_the_probe_cannot_give_keeps_its_lease(world: World) -> None:
    world.agent.used = None
    world.engine.resident_mb = None  # type: ignore[assignment]
    await world.request()
    await world.clock.advance(10.1)
    await world.clock.advance(70)  # the measurement gives up
    assert world.replica.state is ReplicaState.ASLEEP
    assert world.leases.leases["L1"]["vram_mb"] == 1000  # nothing shown free: kept


async def test_a_generic_server_is_not_put_to_sleep() -> None:
    world = World(idle_after="0.5s", keep_alive="20s")
    await world.request()
    await world.clock.advance(15)
    assert world.replica.state is ReplicaState.WARM
    assert world.engine.calls == []
    await world.close()


async def test_a_request_that_comes_while_it_falls_asleep_wakes_it(world: World) -> None:
    await world.request()
    await world.clock.advance(10.1)  # asked to sleep; measuring what it keeps
    assert world.replica.state is ReplicaState.ASLEEP
    request = world.start()
    await world.clock.advance(5)
    await request
    assert world.replica.state is ReplicaState.WARM
    assert world.engine.calls[-1] == "/wake_up"


async def test_llama_cpp_sleeps_by_itself_and_a_request_during_the_measure_wakes_it() -> None:
    world = World(
        command=["llama-server", "-m", "x.gguf", "--port", "{port}"], vram="1000M",
        idle_after="0.2s", sleep_after="1s", model_file="x.gguf",
    )  # fmt: skip
    world.model.vram_mb = 1000
    world.agent.used = 1000
    world.engine.resident_mb = 0
    await world.request()
    await world.clock.advance(1.1)
    assert world.replica.state is ReplicaState.ASLEEP
    request = world.start()
    await world.clock.advance(0.5)
    await request
    assert world.replica.state is ReplicaState.WARM
    assert world.engine.calls[-1] == "/completion"  # the wake: one token
    assert world.leases.leases["L1"]["vram_mb"] == 1000  # woken before it was measured
    assert world.model.metrics.wakes.labels("chat")._value.get() == 1
    await world.close()
