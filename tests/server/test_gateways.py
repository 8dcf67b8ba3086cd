"""The controller's registry of gateways (``server/gateways.py``) on a fake clock:
ownership of a name (live or stale, until an admin forgets it), staleness and
forgetting, which token holds the cluster's leases, commands handed over once, and the
long-poll that wakes when a command is queued."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from gpu_arbiter.core import Conflict, NotFound
from gpu_arbiter.server.auth import Forbidden, Principal
from gpu_arbiter.server.gateways import GatewayRegistry, Report
from gpu_arbiter.server.schemas import GatewayReportIn

from .support import HeldNames

ADMIN = Principal("admin", "admin")
ALICE = Principal("gateway-alice", "gateway", "box")
BOB = Principal("gateway-bob", "gateway", "box")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def report(*models: str, **more: Any) -> Report:
    found = [{"id": name, "state": "cold", "aliases": [f"{name}-alias"]} for name in models]
    return Report(url="http://box:8080", host="box", worker="box", models=found, **more)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> GatewayRegistry:
    return GatewayRegistry(HeldNames(), clock=clock, ttl_s=15.0, forget_s=600.0)


def test_the_first_reporter_owns_the_name_live_or_stale_until_an_admin_forgets_it(
    registry: GatewayRegistry, clock: FakeClock
) -> None:
    registry.report("box-8080", ALICE, report("chat"))
    with pytest.raises(Forbidden, match="only the token that first reported it"):
        registry.report("box-8080", BOB, report("other"))
    assert [m["id"] for m in registry.view("box-8080")["models"]] == ["chat"]  # unchanged
    registry.report("box-8080", ADMIN, report("chat", "embed"))  # an admin may
    with pytest.raises(Forbidden):
        registry.report("box-8080", BOB, report("other"))  # still Alice's
    with pytest.raises(Forbidden):
        registry.forget("box-8080", BOB)
    clock.now += 15.0  # stale: still Alice's
    with pytest.raises(Forbidden, match="gateways forget box-8080"):
        registry.report("box-8080", BOB, report("other"))
    clock.now += 601.0  # forgotten as a report: the name is still Alice's
    assert registry.views() == []
    with pytest.raises(Forbidden):
        registry.report("box-8080", BOB, report("other"))
    registry.report("box-8080", ALICE, report("chat"))  # Alice's reports go on
    registry.forget("box-8080", ALICE)  # her goodbye: the name stays hers
    with pytest.raises(Forbidden):
        registry.report("box-8080", BOB, report("other"))
    registry.forget("box-8080", ADMIN)  # an admin forgets it: free again
    with pytest.raises(NotFound):
        registry.forget("box-8080", ADMIN)
    registry.report("box-8080", BOB, report("other"))
    with pytest.raises(Forbidden):
        registry.report("box-8080", ALICE, report("chat"))


def test_names_held_are_bounded_stale_or_not(clock: FakeClock) -> None:
    from gpu_arbiter.controller import TooManyRequests

    registry = GatewayRegistry(HeldNames(), clock=clock, ttl_s=15.0, forget_s=1.0, max_gateways=1)
    registry.report("box-8080", ALICE, report("chat"))
    clock.now += 100.0  # its report forgotten, its name held
    with pytest.raises(TooManyRequests, match="max_gateways"):
        registry.report("box-9090", BOB, report("chat"))
    registry.forget("box-8080", ADMIN)
    registry.report("box-9090", BOB, report("chat"))


def test_only_the_gateway_token_of_a_leases_worker_holds_the_clusters_lease() -> None:
    holds = GatewayRegistry.holds_lease
    assert holds(Principal("gateway-3", "gateway", "box-3"), "box-3")
    assert not holds(Principal("gateway-2", "gateway", "box-2"), "box-3")
    assert not holds(Principal("worker-3", "worker", "box-3"), "box-3")  # its agent: no
    assert not holds(Principal("client-1", "client"), "box-3")
    assert not holds(Principal("gateway-3", "gateway", "box-3"), None)  # not granted yet


def test_a_gateway_turns_stale_after_its_ttl_and_is_forgotten_later(
    registry: GatewayRegistry, clock: FakeClock
) -> None:
    registry.report("box-8080", ALICE, report("chat"))
    clock.now += 14.9
    [view] = registry.views()
    assert view["stale"] is False and view["reported_ago_s"] == 14.9
    clock.now += 0.1
    assert registry.views()[0]["stale"] is True
    with pytest.raises(Conflict, match="nobody would take"):
        registry.queue("box-8080", "chat", "pin")
    clock.now += 599.0
    assert [v["name"] for v in registry.views()] == ["box-8080"]
    clock.now += 1.5
    assert registry.views() == []
    with pytest.raises(NotFound):
        registry.view("box-8080")


def test_a_command_is_handed_over_once_in_the_next_report(registry: GatewayRegistry) -> None:
    registry.report("box-8080", ALICE, report("chat"))
    command = registry.queue("box-8080", "chat-alias", "pin")  # an alias names its model
    assert (command.model, command.verb) == ("chat", "pin")
    assert registry.views()[0]["commands_queued"] == 1
    assert registry.report("box-8080", ALICE, report("chat")) == [command]
    assert registry.report("box-8080", ALICE, report("chat")) == []


def test_an_unknown_gateway_or_model_is_not_found_and_queues_nothing(
    registry: GatewayRegistry,
) -> None:
    with pytest.raises(NotFound, match="no gateway"):
        registry.queue("nowhere", "chat", "pin")
    registry.report("box-8080", ALICE, report("chat"))
    with pytest.raises(NotFound, match="its models: chat"):
        registry.queue("box-8080", "embed", "unload")
    assert registry.views()[0]["commands_queued"] == 0


def test_commands_are_bounded_per_gateway(clock: FakeClock) -> None:
    registry = GatewayRegistry(HeldNames(), clock=clock, max_commands=2)
    registry.report("box-8080", ALICE, report("chat"))
    registry.queue("box-8080", "chat", "pin")
    registry.queue("box-8080", "chat", "unpin")
    with pytest.raises(Conflict, match="max_commands"):
        registry.queue("box-8080", "chat", "unload")


async def test_a_long_poll_wakes_as_soon_as_a_command_is_queued(
    registry: GatewayRegistry,
) -> None:
    registry.report("box-8080", ALICE, report("chat"))
    poll = asyncio.ensure_future(registry.commands("box-8080", ALICE, 60.0))
    await asyncio.sleep(0)
    assert not poll.done()
    command = registry.queue("box-8080", "chat", "unload")
    assert await asyncio.wait_for(poll, 10.0) == [command]
    assert registry.report("box-8080", ALICE, report("chat")) == []  # handed over once


async def test_a_long_poll_ends_empty_at_its_wait_and_at_a_goodbye(
    registry: GatewayRegistry,
) -> None:
    registry.report("box-8080", ALICE, report("chat"))
    assert await registry.commands("box-8080", ALICE, 0.05) == []
    with pytest.raises(Forbidden):
        await registry.commands("box-8080", BOB, 0.0)
    poll = asyncio.ensure_future(registry.commands("box-8080", ALICE, 60.0))
    await asyncio.sleep(0)
    registry.forget("box-8080", ALICE)
    assert await asyncio.wait_for(poll, 10.0) == []
    with pytest.raises(NotFound):
        await registry.commands("box-8080", ALICE, 0.0)


def test_a_report_keeps_the_name_clashes_of_the_gateways_two_sources(
    registry: GatewayRegistry,
) -> None:
    clash = {"model": "chat", "kept": "own file", "over": "catalogue revision 3"}
    registry.report("box-8080", ALICE, report("chat", conflicts=[clash]))
    assert registry.view("box-8080")["conflicts"] == [clash]
    registry.report("box-8080", ALICE, report("chat"))
    assert registry.view("box-8080")["conflicts"] == []


def test_a_report_keeps_the_catalogue_models_its_host_does_not_serve_and_why(
    registry: GatewayRegistry,
) -> None:
    left = {"model": "big", "why": 'vram = "auto" cannot be estimated on this host: ...'}
    registry.report("box-8080", ALICE, report("chat", left_out=[left]))
    assert registry.view("box-8080")["left_out"] == [left]
    registry.report("box-8080", ALICE, report("chat"))
    assert registry.view("box-8080")["left_out"] == []
    assert GatewayReportIn.model_validate({"left_out": [left]}).left_out[0].model == "big"
    for wrong in ([left] * 257, [{**left, "more": 1}], [{"model": "big"}]):
        with pytest.raises(ValidationError):
            GatewayReportIn.model_validate({"left_out": wrong})


def test_the_report_takes_conflicts_of_three_short_fields_and_256_at_most() -> None:
    clash = {"model": "chat", "kept": "own file", "over": "catalogue revision 3"}
    assert GatewayReportIn.model_validate({"conflicts": [clash]}).conflicts[0].model == "chat"
    for wrong in ([clash] * 257, [{**clash, "more": 1}], [{**clash, "model": ""}]):
        with pytest.raises(ValidationError):
            GatewayReportIn.model_validate({"conflicts": wrong})
