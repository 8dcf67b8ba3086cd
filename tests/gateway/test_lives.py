"""Who owns the gateway's tasks: a model's life owns its replicas' (it ends once shut
down and every replica has ended, its lease released; nothing starts after), and the
cluster's life owns its loads (a refused load is its waiters' answer, not the end of
the cluster's life)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpu_arbiter.client import ApiError
from gpu_arbiter.gateway.cluster.cluster import DOWN_S, Cluster
from gpu_arbiter.gateway.servers.lease import Lease
from gpu_arbiter.gateway.servers.model import Refused
from gpu_arbiter.gateway.servers.replica import ReplicaState

from .fakes import FakeClock, World, settle

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    found = World(keep_alive="5m", grace="4s")
    yield found
    await found.close()


async def test_a_model_life_ends_only_once_its_replicas_have_released(world: World) -> None:
    [life] = world.tasks
    await world.request()
    replica = world.replica
    world.launcher.obeys_term = world.process.obeys_term = False  # it outlives SIGTERM
    world.model.shutdown()
    await world.clock.advance(2)
    assert replica.state is ReplicaState.STOPPING and not life.done()
    assert "release" not in world.leases.verbs()
    await world.clock.advance(10)  # the grace: SIGKILL, then the release
    assert life.done() and life.exception() is None
    assert world.leases.verbs()[-1] == "release" and replica.state is ReplicaState.ENDED
    assert not world.model.replicas


async def test_nothing_starts_after_the_model_was_shut_down() -> None:
    world = World(queue_timeout="10s")
    world.model.shutdown()
    await settle()
    granted = Lease.of({"id": "L9", "state": "loading", "worker": "box", "gpus": ["box:0"]})
    assert world.model.adopt(granted) is None
    waiting = asyncio.ensure_future(world.model.acquire())
    await world.clock.advance(11)  # its queue_timeout
    with pytest.raises(Refused, match="not ready after 10s"):
        await waiting
    assert not world.model.replicas and world.launcher.processes == []
    assert world.leases.calls == [] and not world.tasks  # its life ended


class _Controller:
    """The cluster's routes: no view comes; a load is refused (a 5xx)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def request(self, method: str, path: str, **keys: Any) -> Any:
        self.asked.append(path)
        if path.endswith("/cluster"):
            await asyncio.Event().wait()
        raise ApiError(500, "internal", "the store failed", {})


async def test_a_refused_load_is_its_waiters_answer_and_the_cluster_runs_on() -> None:
    controller = _Controller()
    cluster = Cluster(
        controller,  # type: ignore[arg-type]
        name="gw-1", worker="box-1", models={}, routes={}, clock=FakeClock(),
    )  # fmt: skip
    life = asyncio.ensure_future(cluster.run())
    await settle()
    with pytest.raises(Refused, match="the store failed") as refused:
        await cluster.load("chat", 500)
    assert refused.value.status == 503
    await settle()
    assert not life.done()  # the refusal did not end the cluster's life
    assert controller.asked == ["/v1/gateways/gw-1/cluster", "/v1/gateways/gw-1/loads"]
    life.cancel()
    with pytest.raises(asyncio.CancelledError):
        await life


class _Loads:
    """The cluster's routes: no view comes; a load is granted on box-3 at once; each
    load's body is kept."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def request(self, method: str, path: str, **keys: Any) -> Any:
        if path.endswith("/cluster"):
            await asyncio.Event().wait()
        self.bodies.append(dict(keys["json_body"]))
        return {"id": "l1", "state": "loading", "worker": "box-3", "gpus": ["box-3:0"],
                "vram_mb": 1024, "joined": False, "free_mb": {}}  # fmt: skip


async def test_a_load_names_the_peers_that_refused_a_connection_just_now() -> None:
    """A peer that refused a connection is out of the front door's reach: the load it asks
    for says so (the controller does not join a load held there, I4 keeps its memory)."""
    controller, clock = _Loads(), FakeClock()
    cluster = Cluster(
        controller,  # type: ignore[arg-type]
        name="gw-1", worker="box-1", models={}, routes={}, clock=clock,
    )  # fmt: skip
    life = asyncio.ensure_future(cluster.run())
    try:
        cluster.peer_down("gw-2")
        await cluster.load("chat", 500)
        assert controller.bodies[-1]["unreachable"] == ["gw-2"]
        clock.time += DOWN_S + 0.1  # its time is up: it is tried again
        cluster._loads.clear()
        await cluster.load("chat", 500)
        assert controller.bodies[-1]["unreachable"] == []
    finally:
        life.cancel()
        with pytest.raises(asyncio.CancelledError):
            await life


def _own(state: str) -> dict[str, Any]:
    return {"signature": state, "gateways": [
        {"name": "gw-1", "url": "http://127.0.0.1:1", "worker": "box", "worker_state": state,
         "routable": state == "online", "models": []},
    ]}  # fmt: skip


async def test_a_draining_host_takes_no_new_request_and_ends_its_replicas_once_idle() -> None:
    """While this host's worker drains, its own copy is not routable (a request goes
    elsewhere, or gets a 503 naming the drain when no other host has the model), the
    request in flight finishes, and then its replica ends (its lease released): the drain
    can complete. Online again, its copy is routable again."""
    world = World(keep_alive="5m", max_parallel=2)
    cluster = Cluster(
        _Controller(),  # type: ignore[arg-type]
        name="gw-1", worker="box", models={"chat": world.model}, routes={"chat": "chat"},
        clock=world.clock,
    )  # fmt: skip
    life = asyncio.ensure_future(cluster.run())
    try:
        busy = world.start(hold_s=30.0)  # a long answer in flight
        await world.clock.advance(5)
        replica = world.replica
        assert replica.in_flight == 1
        assert cluster.decide("chat").kind.value == "local"
        cluster.apply(_own("draining"))
        decided = cluster.decide("chat")
        assert decided.kind.value == "none" and "worker box is draining" in decided.why
        await world.clock.advance(10)
        assert replica.live and replica.ending is None  # its request still runs
        await world.clock.advance(25)
        assert busy.done() and busy.exception() is None  # it finished
        await world.clock.advance(30)
        assert world.model.replicas == []  # ended once idle: its lease given back
        assert ("release", replica.lease_id) in world.leases.calls  # its lease given back
        cluster.apply(_own("online"))
        assert cluster.decide("chat").kind.value == "local"  # cold, only this host: local
    finally:
        life.cancel()
        with pytest.raises(asyncio.CancelledError):
            await life
        await world.close()


def test_a_host_whose_worker_the_controller_does_not_know_keeps_its_own_copies() -> None:
    """A gateway beside a worker no agent registered (or under another name) still
    serves its own models; offline or draining, it does not."""
    world_clock = FakeClock()
    cluster = Cluster(
        None,  # type: ignore[arg-type]
        name="gw-1", worker="box", models={}, routes={}, clock=world_clock,
    )  # fmt: skip
    for state, why in (("unknown", ""), ("online", ""), ("offline", "worker box is offline")):
        cluster.apply(_own(state))
        assert cluster.own_why == why
