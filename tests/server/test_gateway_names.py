"""Who holds each gateway name outlives the controller: the registry over the real
controller and store (``controller.names``), restarted on the same SQLite file; a name
whose token was revoked is free; a name that could not be stored is not taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_arbiter.controller import Controller, ServiceUnavailable
from gpu_arbiter.core import NotFound
from gpu_arbiter.server.auth import Forbidden, Principal
from gpu_arbiter.server.gateways import GatewayRegistry, Report
from gpu_arbiter.store import GatewayNameRecord, SqliteStore, Store
from tests.controller.support import Clock, FailingStore

ADMIN = Principal("admin", "admin")
ALICE = Principal("gateway-alice", "gateway", "box-1")
BOB = Principal("gateway-bob", "gateway", "box-2")


def report(worker: str) -> Report:
    return Report(url=f"http://{worker}:8080", host=worker, worker=worker, models=[])


def started(store: Store) -> tuple[Controller, GatewayRegistry]:
    controller = Controller(store, clock=Clock())
    controller.start()
    return controller, GatewayRegistry(controller.names)


def stopped(controller: Controller) -> None:
    controller.close()
    controller.store.close()


async def test_a_name_stays_its_tokens_across_a_restart_until_an_admin_forgets_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    controller, registry = started(SqliteStore(path))
    registry.report("gw-x", ALICE, report("box-1"))
    stopped(controller)

    controller, registry = started(SqliteStore(path))  # a restart: no report known yet
    assert registry.views() == []
    with pytest.raises(Forbidden, match=r"gw-x belongs to another token \(gateway-alice\)") as no:
        registry.report("gw-x", BOB, report("box-2"))
    assert no.value.details["owner"] == "gateway-alice"
    assert registry.views() == []  # nothing changed
    registry.report("gw-x", ALICE, report("box-1"))  # its own token reports on
    registry.forget("gw-x", ALICE)  # its goodbye keeps the name
    stopped(controller)

    controller, registry = started(SqliteStore(path))
    with pytest.raises(Forbidden):
        registry.report("gw-x", BOB, report("box-2"))
    registry.forget("gw-x", ADMIN)  # stored: free for good
    stopped(controller)

    controller, registry = started(SqliteStore(path))
    with pytest.raises(NotFound):
        registry.forget("gw-x", ADMIN)
    registry.report("gw-x", BOB, report("box-2"))
    assert [(r.name, r.owner, r.worker) for r in controller.store.load().gateway_names] == [
        ("gw-x", "gateway-bob", "box-2")
    ]
    stopped(controller)
    controller, registry = started(SqliteStore(path))
    with pytest.raises(Forbidden, match="gateway-bob"):
        registry.report("gw-x", ALICE, report("box-1"))
    stopped(controller)


async def test_taking_and_forgetting_a_name_are_events() -> None:
    controller, registry = started(FailingStore())
    registry.report("gw-x", ALICE, report("box-1"))
    registry.report("gw-x", ALICE, report("box-1"))  # held already: nothing written
    registry.forget("gw-x", ADMIN)
    events = [(e.kind, dict(e.data)) for e in controller.events.after(0, 100)]
    assert events[1:] == [
        ("gateway.name_taken", {"name": "gw-x", "owner": "gateway-alice"}),
        ("gateway.name_forgotten", {"name": "gw-x", "owner": "gateway-alice"}),
    ]


async def test_a_name_whose_token_was_revoked_is_free() -> None:
    controller, registry = started(FailingStore())
    revoked = {ALICE.id}
    registry.token_exists = lambda token_id: token_id not in revoked
    registry.report("gw-x", ALICE, report("box-1"))
    revoked.clear()
    with pytest.raises(Forbidden):
        registry.report("gw-x", BOB, report("box-2"))
    revoked.add(ALICE.id)
    registry.report("gw-x", BOB, report("box-2"))  # Alice's token is gone: Bob takes it
    held = controller.names.get("gw-x")
    assert held is not None
    assert (held.owner, held.worker) == ("gateway-bob", "box-2")
    assert registry.view("gw-x")["worker"] == "box-2"
    assert controller.store.load().gateway_names == (held,)
    kinds = [(e.kind, e.data.get("previous_owner")) for e in controller.events.after(0, 100)]
    assert kinds[-1] == ("gateway.name_taken", "gateway-alice")


async def test_a_name_that_cannot_be_stored_is_not_taken_and_a_failed_forget_frees_none() -> None:
    store = FailingStore()
    controller, registry = started(store)
    store.fail = True
    with pytest.raises(ServiceUnavailable, match="disk full"):
        registry.report("gw-x", ALICE, report("box-1"))
    assert controller.names.get("gw-x") is None
    assert registry.views() == []  # no report either
    store.fail = False
    registry.report("gw-x", BOB, report("box-2"))  # the name was never Alice's

    store.fail = True
    with pytest.raises(ServiceUnavailable):
        registry.forget("gw-x", ADMIN)
    assert controller.names.get("gw-x") == GatewayNameRecord(
        "gw-x", "gateway-bob", "box-2", controller.changes.clock()
    )
    assert [v["name"] for v in registry.views()] == ["gw-x"]  # the report stays too
    store.fail = False
    with pytest.raises(Forbidden):
        registry.report("gw-x", ALICE, report("box-1"))


async def test_a_standby_that_takes_over_refuses_the_name_to_another_token() -> None:
    store, clock = FailingStore(), Clock()
    leader = Controller(store, clock=clock)
    leader.start()
    GatewayRegistry(leader.names).report("gw-x", ALICE, report("box-1"))
    standby = Controller(store, clock=clock)
    standby.mirror("http://leader:7070")
    assert standby.names.get("gw-x") is not None  # its copy, read-only

    leader.demote(None)
    standby.start()  # the take-over loads what the leader stored
    registry = GatewayRegistry(standby.names)
    with pytest.raises(Forbidden, match="gateway-alice"):
        registry.report("gw-x", BOB, report("box-2"))
    registry.report("gw-x", ALICE, report("box-1"))
