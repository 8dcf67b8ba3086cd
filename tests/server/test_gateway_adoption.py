"""The controller hands a gateway the cluster's leases granted beside it that it does not
hold yet (``adopt``), once, and again only while its reports still do not show them."""

from __future__ import annotations

import asyncio

from gpu_arbiter.server.auth import Principal
from gpu_arbiter.server.gateways import ADOPT_AGAIN_S, GatewayRegistry, Report

from .support import HeldNames

WHO = Principal("gateway-2", "gateway", "box-2")


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _report(*leases: str) -> Report:
    replicas = [{"state": "loading", "lease": lease} for lease in leases]
    return Report("http://127.0.0.2:8080", "host", "box-2", [{"id": "chat", "replicas": replicas}])


def test_a_lease_loading_beside_a_gateway_is_handed_to_it_until_its_report_shows_it() -> None:
    clock = _Clock()
    registry = GatewayRegistry(HeldNames(), clock=clock)
    loading = {"box-2": [("chat", "lease-1")]}
    registry.adoptable = lambda worker: loading.get(worker, [])
    assert registry.report("gw-2", WHO, _report()) == []  # new: nothing handed yet
    (first,) = registry.report("gw-2", WHO, _report())
    assert (first.verb, first.model, first.lease) == ("adopt", "chat", "lease-1")
    assert first.as_dict()["lease"] == "lease-1"
    assert registry.report("gw-2", WHO, _report()) == []  # handed just now
    clock.t += ADOPT_AGAIN_S
    (again,) = registry.report("gw-2", WHO, _report())
    assert again.lease == "lease-1"
    clock.t += ADOPT_AGAIN_S
    assert registry.report("gw-2", WHO, _report("lease-1")) == []  # it holds it now
    loading.clear()
    clock.t += ADOPT_AGAIN_S
    assert registry.report("gw-2", WHO, _report()) == []  # not loading any more


def test_a_long_poll_for_commands_ends_with_the_lease_to_adopt() -> None:
    async def main() -> None:
        registry = GatewayRegistry(HeldNames())
        loading: list[tuple[str, str]] = []
        registry.adoptable = lambda worker: loading if worker == "box-2" else []
        registry.report("gw-2", WHO, _report())
        waiting = asyncio.ensure_future(registry.commands("gw-2", WHO, 30.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        loading.append(("chat", "lease-7"))
        (command,) = await asyncio.wait_for(waiting, 5.0)
        assert (command.verb, command.lease) == ("adopt", "lease-7")

    asyncio.run(main())
