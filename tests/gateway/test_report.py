"""The gateway's reporter (``gateway/report.py``) over a fake controller client: it
reports at start and soon after a model's state changes (not only every ``report_s``),
runs the commands it is handed through the gateway's own admin code, and waits through
a controller that is down with one log line when it goes and one when it is back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpu_arbiter.client import ControllerUnreachable
from gpu_arbiter.core import InvalidInput
from gpu_arbiter.gateway.base.metrics import GatewayMetrics
from gpu_arbiter.gateway.cluster.report import Reporter, default_name, listen_url
from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.requests.app import GatewayApp

from .fakes import World

pytestmark = pytest.mark.timeout(30)
WAIT_S = 10.0


class FakeController:
    """The controller's gateway routes: the reports it took, commands to hand over,
    and ``down`` reports it answers as unreachable first."""

    def __init__(self, down: int = 0) -> None:
        self.reports: list[dict[str, Any]] = []
        self.reported = asyncio.Event()
        self.down = down
        self.commands: asyncio.Queue[list[dict[str, Any]]] = asyncio.Queue()
        self.forgotten: list[str] = []

    async def report_gateway(self, name: str, report: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            self.down -= 1
            raise ControllerUnreachable("no controller answered (refused)")
        self.reports.append(report)
        self.reported.set()
        return {"name": name, "ttl_s": 15.0, "commands": []}

    async def gateway_commands(self, name: str, *, wait_s: float = 0.0) -> list[dict[str, Any]]:
        return await self.commands.get()

    async def forget_gateway(self, name: str) -> dict[str, Any]:
        self.forgotten.append(name)
        return {"name": name, "forgotten": True}

    async def next_report(self) -> dict[str, Any]:
        self.reported.clear()
        await asyncio.wait_for(self.reported.wait(), WAIT_S)
        return self.reports[-1]


@pytest.fixture
async def world() -> AsyncIterator[World]:
    found = World(idle_after="0.5s", keep_alive="5m", aliases=["gpt"])
    yield found
    await found.close()


def reporter(world: World, controller: FakeController) -> Reporter:
    models = {"chat": world.model}
    app = GatewayApp(models, {"chat": "chat", "gpt": "chat"}, GatewayMetrics())
    return Reporter(
        controller,  # type: ignore[arg-type]  # the three routes it calls
        name="box-8080", url="http://127.0.0.1:8080", host="box", worker="box",
        models=models, administer=app.administer, report_s=60.0, debounce_s=0.01,
        backoff_s=0.01,
    )  # fmt: skip


async def test_it_reports_at_start_and_soon_after_a_change_not_only_on_its_period(
    world: World,
) -> None:
    controller = FakeController()
    running = asyncio.ensure_future(reporter(world, controller).run())
    try:
        first = await controller.next_report()
        assert (first["url"], first["host"], first["worker"]) == (
            "http://127.0.0.1:8080",
            "box",
            "box",
        )
        [model] = first["models"]
        assert model["id"] == "chat" and model["aliases"] == ["gpt"]
        assert model["pinned"] is False and model["state"] == "cold"
        await world.model.pin()  # report_s is 60 s: only the change can bring it now
        assert (await controller.next_report())["models"][0]["pinned"] is True
    finally:
        running.cancel()


async def test_a_command_runs_through_the_gateways_own_admin_code(world: World) -> None:
    controller = FakeController()
    running = asyncio.ensure_future(reporter(world, controller).run())
    try:
        await controller.next_report()
        controller.commands.put_nowait([{"id": "cmd-1", "model": "gpt", "verb": "pin"}])
        assert (await controller.next_report())["models"][0]["pinned"] is True
        assert world.model.pinned is True
        controller.commands.put_nowait([{"id": "cmd-2", "model": "chat", "verb": "unpin"}])
        assert (await controller.next_report())["models"][0]["pinned"] is False
    finally:
        running.cancel()


async def test_an_unknown_verb_is_refused_by_the_admin_code_and_changes_nothing(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """The verbs are the admin code's to check, for the routes and the commands alike: a
    command of a verb it does not know is a warning, and the model stays as it was."""
    app = GatewayApp({"chat": world.model}, {"chat": "chat"}, GatewayMetrics())
    with pytest.raises(ValueError, match="verb must be one of unload, pin, unpin"):
        await app.administer("chat", "evict", "a test")
    controller = FakeController()
    running = asyncio.ensure_future(reporter(world, controller).run())
    try:
        await controller.next_report()
        controller.commands.put_nowait([{"id": "cmd-1", "model": "chat", "verb": "evict"}])
        controller.commands.put_nowait([{"id": "cmd-2", "model": "chat", "verb": "pin"}])
        assert (await controller.next_report())["models"][0]["pinned"] is True
        assert "command ignored: verb must be one of" in caplog.text
    finally:
        running.cancel()


async def test_a_controller_that_is_down_is_waited_through_with_one_line_each_way(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "gpu_arbiter.gateway")
    controller = FakeController(down=5)
    found = reporter(world, controller)
    running = asyncio.ensure_future(found.run())
    try:
        await controller.next_report()
    finally:
        running.cancel()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in line for line in lines) == 1
    assert sum("answers again" in line for line in lines) == 1
    await found.goodbye()
    assert controller.forgotten == ["box-8080"]


def test_a_name_is_a_worker_name_and_defaults_to_host_and_port() -> None:
    assert default_name(8080, "GPU-Box.example.com") == "gpu-box.example.com-8080"
    assert default_name(8080, "x" * 100) == "x" * 58 + "-8080"
    assert listen_url("127.0.0.1", 8080) == "http://127.0.0.1:8080"
    assert listen_url("::1", 8080) == "http://[::1]:8080"
    spec = {"models": {"chat": {"command": ["s", "{port}"], "vram": "1G"}}}
    assert parse_config({**spec, "gateway": {"name": "Box-1"}}).name == "box-1"
    assert parse_config(spec).name is None
    with pytest.raises(InvalidInput, match=r"gateway\.name"):
        parse_config({**spec, "gateway": {"name": "box:8080"}})
