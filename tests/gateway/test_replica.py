"""A replica's life on a virtual clock (fakes behind the gateway's interfaces): keep-warm
timers driven by requests, the grace of a revocation, one SIGTERM, the lease released
only once the process is gone, the ready path, a failed start's last output."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import pytest

from gpu_arbiter.gateway.base.scopes import CancelScope
from gpu_arbiter.gateway.servers.model import Refused
from gpu_arbiter.gateway.servers.replica import ReplicaState

from .fakes import World, settle

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    found = World(idle_after="0.5s", keep_alive="5m", grace="2s")
    yield found
    await found.close()


async def warm(world: World) -> None:
    await world.request()
    assert world.replica.state is ReplicaState.WARM


async def test_every_request_re_arms_idle_not_only_the_first(world: World) -> None:
    await warm(world)
    await world.clock.advance(0.6)
    assert world.leases.verbs()[-1] == "idle"
    for _ in range(3):  # the second request onwards was the bug: busy for keep_alive
        await world.request()
        assert world.leases.verbs()[-1] == "busy"
        await world.clock.advance(0.4)
        assert world.leases.verbs()[-1] == "busy"
        await world.clock.advance(0.2)
        assert world.leases.verbs()[-1] == "idle"
    assert world.replica.state is ReplicaState.WARM


async def test_back_to_back_requests_cost_no_controller_call(world: World) -> None:
    await warm(world)
    before = world.leases.verbs()
    for _ in range(5):
        await world.request()
        await world.clock.advance(0.1)
    assert world.leases.verbs() == before  # never idle between them: no idle, no busy


async def test_keep_alive_counts_from_when_the_last_request_left(world: World) -> None:
    await warm(world)
    await world.clock.advance(200)
    request = world.start(hold_s=50)  # in flight for 50 s: no keep_alive while busy
    await world.clock.advance(50)
    await request
    assert world.replica.state is ReplicaState.WARM
    await world.clock.advance(299)
    assert world.replica.ending is None
    assert world.process.signals == []
    await world.clock.advance(2)
    assert world.process.signals == [signal.SIGTERM]
    await settle()
    assert world.model.replicas == []
    assert world.leases.verbs()[-1] == "release"


async def test_a_request_in_flight_holds_off_idle_and_keep_alive(world: World) -> None:
    await warm(world)
    request = world.start(hold_s=1000)
    await world.clock.advance(600)
    assert world.replica.state is ReplicaState.BUSY
    assert world.replica.ending is None
    await world.clock.advance(400)
    await request
    assert world.replica.state is ReplicaState.WARM


async def test_keep_alive_left_is_shown_while_warm(world: World) -> None:
    await warm(world)
    await world.clock.advance(100)
    assert world.model.describe()["replicas"][0]["keep_alive_left_s"] == pytest.approx(200)


async def test_a_revoked_busy_replica_finishes_within_the_grace_then_one_sigterm(
    world: World,
) -> None:
    await warm(world)
    lease_id = world.replica.lease_id
    request = world.start(hold_s=1.5)
    await world.clock.advance(0.1)
    world.leases.revoke(lease_id)
    await world.clock.advance(0.5)
    assert world.process.signals == []  # its request still has the grace
    assert not world.replica.accepting
    await world.clock.advance(1.0)
    await request
    await settle()
    assert world.process.signals == [signal.SIGTERM]
    assert world.agent.stops == [lease_id]  # by the agent that supervises it: one SIGTERM
    assert world.leases.verbs()[-1] == "release"


async def relayed(world: World, hold_s: float, seen: list[list[int]]) -> None:
    """A request relayed as the gateway's app relays one: its slot, its cancel scope in
    the replica's relays while it runs (``seen``: the signals the server had got when it
    ended: its connection is closed by then)."""
    replica, _ = await world.model.acquire()
    scope = CancelScope()
    replica.relays.add(scope)
    try:
        async with scope:
            await world.clock.sleep(hold_s)
    finally:
        seen.append(list(world.process.signals))
        replica.relay_ended(scope)
        replica.leave()


async def test_requests_past_the_grace_are_cut_and_the_lease_waits_for_the_exit(
    world: World,
) -> None:
    world.launcher.obeys_term = False
    await warm(world)
    replica = world.replica
    seen: list[list[int]] = []
    request = asyncio.ensure_future(relayed(world, 100, seen))
    await world.clock.advance(0.1)
    world.leases.revoke(replica.lease_id)
    await world.clock.advance(2.0)
    await request
    assert replica.cut
    assert seen == [[]]  # cut, its connection closed, before the SIGTERM
    assert world.process.signals == [signal.SIGTERM]
    await world.clock.advance(6.9)
    assert world.process.signals == [signal.SIGTERM]
    await world.clock.advance(0.2)  # the grace (under stop_s) and the agent's margin
    assert world.process.signals == [signal.SIGTERM, signal.SIGKILL]
    await settle()
    assert world.leases.verbs()[-1] == "release"


async def test_a_cut_is_followed_by_the_engines_stop_time_not_a_second_grace() -> None:
    world = World(idle_after="0.5s", keep_alive="5m", grace="10s")
    world.launcher.obeys_term = False  # deaf to SIGTERM after a cancelled request
    world.agent.supervises = False
    stop_s = world.model.driver.stop_s
    assert stop_s < 10
    try:
        await warm(world)
        seen: list[list[int]] = []
        request = asyncio.ensure_future(relayed(world, 100, seen))
        await world.clock.advance(0.1)
        world.leases.revoke(world.replica.lease_id)
        await world.clock.advance(10.0)
        await request
        assert seen == [[]]
        assert world.process.signals == [signal.SIGTERM]
        await world.clock.advance(stop_s - 0.1)
        assert world.process.signals == [signal.SIGTERM]
        await world.clock.advance(0.2)  # the grace and stop_s: not twice the grace
        assert world.process.signals == [signal.SIGTERM, signal.SIGKILL]
        await settle()
        assert world.leases.verbs()[-1] == "release"
    finally:
        await world.close()


async def test_requests_done_early_leave_the_server_the_rest_of_the_grace_only() -> None:
    world = World(idle_after="0.5s", keep_alive="5m", grace="10s")
    world.launcher.obeys_term = False
    world.agent.supervises = False
    try:
        await warm(world)
        request = world.start(hold_s=4)
        await world.clock.advance(0.1)
        world.leases.revoke(world.replica.lease_id)
        await world.clock.advance(4.0)
        await request
        await settle()
        assert world.process.signals == [signal.SIGTERM]  # its request finished: SIGTERM
        await world.clock.advance(5.8)
        assert world.process.signals == [signal.SIGTERM]
        await world.clock.advance(0.2)  # the grace from the revocation, not from the SIGTERM
        assert world.process.signals == [signal.SIGTERM, signal.SIGKILL]
    finally:
        await world.close()


async def test_the_lease_is_released_only_after_the_process_exited(world: World) -> None:
    world.launcher.obeys_term = False
    world.agent.supervises = False
    await warm(world)
    world.replica.shutdown()
    await world.clock.advance(1.9)
    assert world.process.signals == [signal.SIGTERM]
    assert "release" not in world.leases.verbs()
    await world.clock.advance(0.2)  # no agent: SIGKILL at the grace
    assert world.process.signals == [signal.SIGTERM, signal.SIGKILL]
    assert world.leases.verbs()[-1] == "release"


async def test_a_release_is_retried_while_the_controller_is_unreachable(world: World) -> None:
    await warm(world)
    world.leases.unreachable = 3
    world.replica.shutdown()
    await world.clock.advance(5)
    assert world.leases.verbs()[-4:] == ["unreachable"] * 3 + ["release"]


async def test_default_ready_moves_from_a_404_health_to_v1_models(world: World) -> None:
    world.health.answers["/health"] = 404  # llama-cpp-python has no /health
    await world.request()
    assert world.health.asked[:2] == ["/health", "/v1/models"]


async def test_a_configured_ready_path_answering_404_fails_at_once() -> None:
    world = World(ready="/healthz", load_timeout="5m")
    world.health.answers["/healthz"] = 404
    with pytest.raises(Refused) as refused:
        await world.request()
    assert refused.value.status == 502
    assert "404 at ready = '/healthz'" in refused.value.reason
    assert world.clock.now() < 1000 + 1  # not the whole load_timeout
    await world.close()


async def test_a_server_that_exits_while_loading_is_a_502_with_its_last_output() -> None:
    world = World()
    world.health.loaded = False

    def crash(process: object) -> None:
        world.launcher.processes[-1].lines = ["loading model", "error: unknown model arch"]
        world.launcher.processes[-1].exit(1)

    world.launcher.on_start = crash
    with pytest.raises(Refused) as refused:
        await world.request()
    assert refused.value.status == 502
    assert "exited with code 1 while loading" in refused.value.reason
    assert "error: unknown model arch" in refused.value.reason
    assert world.leases.verbs()[-1] == "release"
    await world.close()


async def test_a_server_whose_port_was_taken_starts_again_on_another() -> None:
    world = World()

    def first_cannot_bind(process: object) -> None:
        if len(world.launcher.processes) == 1:
            world.launcher.processes[0].lines = ["error: bind: Address already in use"]
            world.launcher.processes[0].exit(1)

    world.launcher.on_start = first_cannot_bind
    await world.request()
    first, second = world.launcher.processes
    assert first.command[-1] != second.command[-1]
    assert world.replica.state is ReplicaState.WARM
    assert world.launcher.reserved == {int(second.command[-1])}  # the generic: no flags
    await world.close()


async def test_a_missing_program_is_a_502_naming_it() -> None:
    world = World()
    world.launcher.missing = True
    with pytest.raises(Refused) as refused:
        await world.request()
    assert "cannot start server: No such file or directory" in refused.value.reason
    await world.close()


async def test_a_crash_while_serving_ends_the_replica_and_releases(world: World) -> None:
    await warm(world)
    world.process.lines = ["segfault"]
    world.process.exit(139)
    await settle()
    assert world.model.replicas == []
    assert world.model.failure is not None
    assert "code 139" in world.model.failure
    assert world.leases.verbs()[-1] == "release"


async def test_a_queued_replica_nobody_waits_for_is_cancelled_and_released() -> None:
    world = World(queue_timeout="10s")
    world.leases.grant = False
    request = world.start()
    await world.clock.advance(1)
    assert world.replica.state is ReplicaState.QUEUED
    await world.clock.advance(10)
    with pytest.raises(Refused) as refused:
        await request
    assert refused.value.status == 503
    await settle()
    assert world.model.replicas == []
    assert world.leases.verbs() == ["create", "release"]
    await world.close()


async def test_a_queued_replica_starts_once_granted() -> None:
    world = World()
    world.leases.grant = False
    request = world.start()
    await world.clock.advance(1)
    world.leases.give("L1")
    await world.clock.advance(0)
    await request
    assert world.replica.state is ReplicaState.WARM
    assert world.process.env["FROM_AGENT"] == "1"  # type: ignore[attr-defined]
    assert world.process.env["CUDA_VISIBLE_DEVICES"] == "0"  # type: ignore[attr-defined]
    await world.close()


async def test_the_engine_gets_the_flags_the_lease_allows() -> None:
    """vLLM takes ``--gpu-memory-utilization`` x the GPU's total at start: the fraction
    comes from the lease (1 GiB of a 24 GiB GPU), and vLLM's own ready path is asked."""
    world = World(command=["vllm", "serve", "m", "--port", "{port}"], vram="1G")
    await world.request()
    command = world.process.command
    fraction = float(command[command.index("--gpu-memory-utilization") + 1])
    assert fraction == pytest.approx(1024 / 24576, abs=0.001)
    assert fraction * 24576 <= 1024
    assert world.health.asked == ["/health"]
    await world.close()


async def test_comfyui_work_after_its_answer_keeps_the_lease_busy() -> None:
    """ComfyUI runs a prompt after answering ``POST /prompt``: its queue, not a request in
    flight, says it is busy; the lease is marked busy again, and keep_alive waits."""
    world = World(
        command=["comfyui", "--port", "{port}"], engine="comfyui", idle_after="1s",
        keep_alive="10s",
    )  # fmt: skip
    await world.request()
    world.engine.queue_busy = True
    await world.clock.advance(5)
    assert "idle" not in world.leases.verbs()  # its queue runs: never idle
    world.engine.queue_busy = False
    await world.clock.advance(1.6)
    assert world.leases.verbs()[-1] == "idle"
    world.engine.queue_busy = True  # a job queued by a request that has left
    await world.clock.advance(0.6)
    assert world.leases.verbs()[-1] == "busy"
    await world.clock.advance(20)
    assert world.replica.ending is None  # busy: keep_alive counts from when it is not
    world.engine.queue_busy = False
    await world.clock.advance(11)
    assert world.model.replicas == []
    await world.close()


async def test_a_reclaim_seen_before_the_idle_mark_answered_is_a_reclaim(world: World) -> None:
    """The controller reclaims the lease in the very cycle that marks it idle: the
    watcher may learn it before the idle call's answer comes back."""
    leases = world.leases
    marked = leases.idle

    async def idle_then_reclaimed(lease_id: str) -> dict[str, object]:
        answer = await marked(lease_id)
        leases.revoke(lease_id)  # in the same cycle
        await settle()  # the watcher's long-poll answers first
        return answer

    leases.idle = idle_then_reclaimed  # type: ignore[method-assign]
    await warm(world)
    await world.clock.advance(0.6)
    await settle()
    stops = world.model.metrics.stops.labels("chat", "reclaimed")._value.get()
    assert stops == 1


async def test_a_crash_backs_off_before_the_next_start_doubling_in_a_row(world: World) -> None:
    """No restart loop: after a crash the model refuses (503, retry-after) for 1 s, then
    starts again; a start that fails too, in a row, doubles the back-off (2 s); a start
    that loads ends the streak. Exactly, on the virtual clock."""

    async def refused_until(backoff_s: float) -> None:
        await world.clock.advance(backoff_s - 0.1)
        with pytest.raises(Refused) as refused:
            await world.request()
        assert refused.value.status == 503
        assert "next start in 0.1s" in refused.value.reason
        assert refused.value.retry_after_s == pytest.approx(0.1)
        await world.clock.advance(0.1)

    await warm(world)
    world.process.exit(3)
    await settle()
    assert world.model.replicas == []
    await refused_until(1.0)
    world.launcher.on_start = lambda process: world.launcher.processes[-1].exit(3)
    with pytest.raises(Refused) as failed:
        await world.request()  # the back-off over: a new server, which fails to load
    assert failed.value.status == 502
    assert len(world.launcher.processes) == 2
    await refused_until(2.0)
    assert len(world.launcher.processes) == 2  # nothing started while backing off
    world.launcher.on_start = None
    await world.request()
    assert world.replica.state is ReplicaState.WARM
    assert len(world.launcher.processes) == 3
    assert world.model.backoff_left_s() == 0.0
