"""``gpu-arbiter models`` as an operator reads it, from what a gateway's model describes of
itself (a model over the gateway's virtual-clock fakes): an asleep model says how long
until keep_alive stops it, a busy one that it is in use now."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator

import pytest
from rich.console import Console

from gpu_arbiter.cli.models import Answer, conflict_lines, models_view
from gpu_arbiter.gateway.servers.replica import ReplicaState
from tests.gateway.fakes import World, settle

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


def row(world: World) -> dict[str, str]:
    """The model's row of the table, by column header, as printed."""
    table = models_view([Answer("http://gw:8080", 200, {"data": [world.model.describe()]})])
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(table)
    lines = out.getvalue().splitlines()
    [header] = [line for line in lines if "┃" in line]
    [cells] = [line for line in lines if "│" in line]
    names = [part.strip() for part in header.split("┃")[1:-1]]
    values = [part.strip() for part in cells.split("│")[1:-1]]
    return dict(zip(names, values, strict=True))


async def test_an_asleep_model_shows_how_long_until_keep_alive_stops_it(world: World) -> None:
    await world.request()
    await world.clock.advance(10.1)  # sleep_after: the engine is asked to sleep
    await world.clock.advance(3)  # the probe's figure steady: measured, asleep
    assert world.replica.state is ReplicaState.ASLEEP
    left_s = world.model.describe()["replicas"][0]["keep_alive_left_s"]
    assert left_s == pytest.approx(300 - 13.1, abs=0.2)
    shown = row(world)
    assert shown["state"] == "asleep"
    assert shown["keep-alive left"] == "5m (asleep)"
    assert shown["last used"] == "13s ago"

    await world.clock.advance(left_s - 1)  # what it said: it still sleeps a second before
    assert world.replica.state is ReplicaState.ASLEEP
    assert row(world)["keep-alive left"] == "1.0s (asleep)"
    await world.clock.advance(1.1)
    await settle()
    assert world.model.replicas == []  # and keep_alive stopped it


async def test_a_busy_model_is_in_use_now_not_last_used_long_ago(world: World) -> None:
    requests = [world.start(hold_s=60), world.start(hold_s=60)]
    await world.clock.advance(13)
    assert world.replica.state is ReplicaState.BUSY
    assert world.model.describe()["last_used_ago_s"] == 0.0
    shown = row(world)
    assert shown["last used"] == "now (2 in flight)"
    assert shown["in flight"] == "2"
    assert shown["keep-alive left"] == "-"  # it does not run while requests are served

    await world.clock.advance(50)  # they left at 60 s
    for request in requests:
        await request
    shown = row(world)
    assert shown["last used"] == "3.0s ago"
    assert shown["keep-alive left"] == "5m"
    await world.clock.advance(11)  # asleep: its last use is still when they left
    assert world.model.describe()["state"] == "asleep"
    assert row(world)["last used"] == "14s ago"


def test_a_conflict_or_a_model_left_out_a_gateway_reported_is_one_line_below_the_table() -> None:
    conflict = {"model": "chat", "kept": "own file", "over": "catalogue revision 3"}
    left = {"model": "big", "why": "no model file here"}
    reported = {"data": [], "conflicts": [conflict], "left_out": [left]}
    answers = [
        Answer("gw-2 (http://gw2:8080)", 200, reported),
        Answer("gw-3 (http://gw3:8080)", 200, {"data": [], "conflicts": []}),
        Answer("gw-4 (http://gw4:8080)", 409, {"error": {"code": "stale"}}),
    ]
    assert conflict_lines(answers) == [
        "conflict: gw-2 (http://gw2:8080): chat: own file kept over catalogue revision 3",
        "left out: gw-2 (http://gw2:8080): big: no model file here",
    ]
