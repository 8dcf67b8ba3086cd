"""A model's state as ``GET /v1/models`` lists it, as the gateway reports it to the
controller and as ``gpu-arbiter models`` prints it: a model whose start failed is
``failed``, with the failure and when a request may start it again, until a start loads;
at a front door, an entry's ``state`` is the cluster's (the most advanced of the
routable hosts'), each host's copy beside it, while the report keeps this gateway's own."""

from __future__ import annotations

import io
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from rich.console import Console

from gpu_arbiter.cli.models import Answer, models_view
from gpu_arbiter.gateway.base.metrics import GatewayMetrics
from gpu_arbiter.gateway.cluster.cluster import Cluster
from gpu_arbiter.gateway.cluster.report import model_report
from gpu_arbiter.gateway.requests.app import GatewayApp
from gpu_arbiter.gateway.servers.model import Refused
from gpu_arbiter.gateway.servers.replica import ReplicaState
from gpu_arbiter.gateway.servers.states import MODEL_STATES, most_advanced
from gpu_arbiter.server.schemas import GatewayModelIn

from .fakes import World, settle
from .test_app_routes import _call

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    found = World(idle_after="0.5s", keep_alive="5m", grace="2s", aliases=["gpt"])
    yield found
    await found.close()


async def _fail_a_start(world: World) -> None:
    world.launcher.on_start = lambda process: process.exit(3)
    with pytest.raises(Refused) as failed:
        await world.request()
    assert failed.value.status == 502
    await settle()


def _printed_state(model: dict[str, Any]) -> str:
    out = io.StringIO()
    table = models_view([Answer("http://gw:8080", 200, {"data": [model]})])
    Console(file=out, width=400, color_system=None).print(table)
    [header] = [line for line in out.getvalue().splitlines() if "┃" in line]
    [cells] = [line for line in out.getvalue().splitlines() if "│" in line]
    names = [part.strip() for part in header.split("┃")[1:-1]]
    values = [part.strip() for part in cells.split("│")[1:-1]]
    return dict(zip(names, values, strict=True))["state"]


def _app(world: World, cluster: Cluster | None = None) -> GatewayApp:
    app = GatewayApp({"chat": world.model}, {"chat": "chat", "gpt": "chat"}, GatewayMetrics())
    app.name = "gw-1"
    app.cluster = cluster
    return app


async def test_a_failed_start_is_failed_with_its_failure_and_when_it_may_start_again(
    world: World,
) -> None:
    await _fail_a_start(world)
    described = world.model.describe()
    assert described["state"] == "failed"
    assert "exited with code 3" in described["failure"]
    assert described["retry_in_s"] == 1.0  # the first back-off
    assert described["retry_at"] == pytest.approx(time.time() + 1.0, abs=2.0)
    assert "next start in 1.0s" in _printed_state(described)

    await world.clock.advance(0.6)
    status, listed = await _call(_app(world), "GET", "/v1/models")
    assert status == 200
    entry, alias = listed["data"]
    assert (entry["state"], entry["retry_in_s"], alias["state"]) == ("failed", 0.4, "failed")
    reported = model_report(world.model)
    assert {k: reported[k] for k in ("state", "retry_in_s")} == {
        "state": "failed",
        "retry_in_s": 0.4,
    }
    GatewayModelIn.model_validate(reported)  # the controller takes it as it is

    await world.clock.advance(0.5)  # the back-off over: still failed, startable now
    described = world.model.describe()
    assert (described["state"], described["retry_in_s"]) == ("failed", 0.0)
    assert _printed_state(described).endswith("; may start now")
    GatewayModelIn.model_validate(model_report(world.model))

    world.launcher.on_start = None
    await world.request()  # a request starts it again, and it loads
    assert world.replica.state is ReplicaState.WARM
    described = world.model.describe()
    assert described["state"] == "warm"
    assert not {"failure", "retry_at", "retry_in_s"} & set(described)


async def test_a_second_failure_in_a_row_doubles_the_time_it_says(world: World) -> None:
    await _fail_a_start(world)
    await world.clock.advance(1.0)
    await _fail_a_start(world)
    assert world.model.describe()["retry_in_s"] == 2.0
    assert world.model.state() == "failed"


async def test_a_model_that_never_failed_is_cold(world: World) -> None:
    described = world.model.describe()
    assert described["state"] == "cold"
    assert "retry_in_s" not in described


def test_the_order_of_the_states() -> None:
    assert MODEL_STATES[:3] == ("busy", "warm", "waking")
    assert most_advanced(["cold", "loading", "asleep"]) == "asleep"
    assert most_advanced(["failed", "cold"]) == "cold"  # one host may start it
    assert most_advanced(["failed", "backoff"]) == "failed"  # a word it does not know: last
    assert most_advanced([]) is None


def _peer(name: str, state: str, routable: bool = True, **model: Any) -> dict[str, Any]:
    replicas = [] if state in ("cold", "failed") else [{"state": state, "in_flight": 1}]
    return {
        "name": name, "url": f"http://127.0.0.2:80{name[-1]}", "worker": f"box-{name[-1]}",
        "worker_state": "online" if routable else "draining", "routable": routable,
        "models": [{"id": "chat", "aliases": ["gpt"], "max_parallel": 2, "state": state,
                    "in_flight": len(replicas), "replicas": replicas, **model}],
    }  # fmt: skip


def _front_door(world: World, *peers: dict[str, Any]) -> GatewayApp:
    cluster = Cluster(
        None,  # type: ignore[arg-type]
        name="gw-1", worker="box-1", models={"chat": world.model},
        routes={"chat": "chat", "gpt": "chat"}, clock=world.clock,
    )  # fmt: skip
    cluster.apply({"signature": "s", "gateways": list(peers)})
    return _app(world, cluster)


async def test_a_front_door_lists_the_clusters_state_and_each_hosts_beside_it(
    world: World,
) -> None:
    """Cold here, warm on gw-2, busy on gw-3 whose worker drains (not routable): warm,
    the entry's OpenAI fields as before, the report to the controller still cold."""
    app = _front_door(world, _peer("gw-2", "warm"), _peer("gw-3", "busy", routable=False))
    status, listed = await _call(app, "GET", "/v1/models")
    assert status == 200
    entry, alias = listed["data"]
    assert {k: entry[k] for k in ("id", "object", "owned_by", "created")} == {
        "id": "chat", "object": "model", "owned_by": "gpu-arbiter", "created": app.created,
    }  # fmt: skip
    assert (entry["state"], alias["id"], alias["state"]) == ("warm", "gpt", "warm")
    assert entry["hosts"] == [
        {"gateway": "gw-1", "worker": "box-1", "state": "cold", "ready": 0, "in_flight": 0,
         "routable": True},
        {"gateway": "gw-2", "worker": "box-2", "state": "warm", "ready": 1, "in_flight": 1,
         "routable": True},
        {"gateway": "gw-3", "worker": "box-3", "state": "busy", "ready": 1, "in_flight": 1,
         "routable": False, "why_not": "worker box-3 is draining"},
    ]  # fmt: skip
    for path in ("/v1/models/chat", "/v1/models/gpt"):
        status, one = await _call(app, "GET", path)
        assert (status, one["state"]) == (200, "warm")
    assert model_report(world.model)["state"] == "cold"  # its own, never the cluster's


async def test_a_failed_copy_shows_its_failure_and_a_cold_host_keeps_the_model_cold(
    world: World,
) -> None:
    await _fail_a_start(world)
    retry_at = time.time() + 30.0
    failed_there = _peer("gw-2", "failed", failure="not ready", retry_at=retry_at, retry_in_s=30)
    _, listed = await _call(_front_door(world, failed_there), "GET", "/v1/models/chat")
    assert listed["state"] == "failed"
    here, there = listed["hosts"]
    assert (here["state"], here["retry_in_s"]) == ("failed", 1.0)
    assert "exited with code 3" in here["failure"]
    assert (there["failure"], there["retry_at"]) == ("not ready", retry_at)
    assert there["retry_in_s"] == pytest.approx(30.0, abs=2.0)  # counted from now

    _, listed = await _call(_front_door(world, _peer("gw-2", "cold")), "GET", "/v1/models/chat")
    assert listed["state"] == "cold"  # gw-2 may start it
    _, listed = await _call(
        _front_door(world, _peer("gw-2", "warm", routable=False)), "GET", "/v1/models/chat"
    )
    assert listed["state"] == "failed"  # gw-2's warm copy is out of reach


async def test_a_model_no_host_can_serve_is_unavailable(world: World) -> None:
    app = _front_door(world, _peer("gw-2", "warm", routable=False))
    cluster = app.cluster
    assert cluster is not None
    cluster.own_state = "draining"
    _, listed = await _call(app, "GET", "/v1/models/chat")
    assert listed["state"] == "unavailable"
    assert [h["why_not"] for h in listed["hosts"]] == [
        "worker box-1 is draining", "worker box-2 is draining",
    ]  # fmt: skip


def test_the_time_left_shown_is_zero_only_once_none_is_left() -> None:
    """A back-off shown over (0) while a moment of it remains would have a request that
    waited for 0 refused: what is left is rounded up to a tenth."""
    from gpu_arbiter.gateway.servers.model import tenths_up

    assert tenths_up(0.0) == 0.0 and tenths_up(-1.0) == 0.0
    assert tenths_up(0.001) == 0.1 and tenths_up(0.04) == 0.1
    assert tenths_up(0.1) == 0.1 and tenths_up(0.3 - 0.2) == 0.1  # float noise is not a tenth
    assert tenths_up(1.01) == 1.1
