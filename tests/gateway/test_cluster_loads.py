"""The cluster's load of a cold model as a front door asks for it, over a fake controller
on a virtual clock: asked at the model's own priority unless the caller's key is higher
(as a replica's lease is on one gateway)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gpu_arbiter.client import ApiError, ControllerUnreachable
from gpu_arbiter.gateway.base.metrics import GatewayMetrics
from gpu_arbiter.gateway.cluster.cluster import Cluster
from gpu_arbiter.gateway.requests.access import Access, ApiKey
from gpu_arbiter.gateway.requests.app import GatewayApp
from gpu_arbiter.gateway.requests.front_door import load_priority
from gpu_arbiter.gateway.servers.model import Refused
from gpu_arbiter.peer_identity import Identity

from .fakes import FakeClock, settle

pytestmark = pytest.mark.timeout(20)
Message = dict[str, Any]
KEYS = (
    ApiKey("batch", "batch-key-0123456789", priority=100),
    ApiKey("ui", "ui-key-0123456789", priority=800),
    ApiKey("plain", "plain-key-0123456789"),
)


class _Refusing:
    """The cluster's routes: no view comes; each load's body is kept, then refused."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def request(self, method: str, path: str, **keys: Any) -> Any:
        if path.endswith("/cluster"):
            await asyncio.Event().wait()
        self.bodies.append(dict(keys["json_body"]))
        raise ApiError(503, "unavailable", "no room", {})


def _view(priority: int) -> dict[str, Any]:
    """gw-2 on box-2 declares ``chat`` at ``priority``, with no replica: a cold load."""
    chat = {"id": "chat", "aliases": [], "max_parallel": 2, "in_flight": 0,
            "priority": priority, "replicas": []}  # fmt: skip
    return {"signature": "s", "gateways": [
        {"name": "gw-2", "url": "http://127.0.0.2:8082", "worker": "box-2",
         "worker_state": "online", "routable": True, "models": [chat]},
    ]}  # fmt: skip


async def _call(app: GatewayApp, key: str, body: bytes) -> tuple[int, Any]:
    sent: list[Message] = []
    given = False

    async def receive() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"authorization", f"Bearer {key}".encode()),
    ]
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    await app(scope, receive, send)
    [head] = [m for m in sent if m["type"] == "http.response.start"]
    return head["status"], json.loads(b"".join(m.get("body", b"") for m in sent))


def test_a_load_is_asked_at_the_models_priority_unless_the_callers_is_higher() -> None:
    assert load_priority(500, None) == 500
    assert load_priority(500, 100) == 500  # a batch key never lowers it
    assert load_priority(500, 800) == 800
    assert load_priority(300, 300) == 300


@pytest.mark.parametrize(
    ("key", "model", "asked"),
    [
        ("batch-key-0123456789", 500, 500),  # the model's own, not the batch key's 100
        ("ui-key-0123456789", 500, 800),  # a higher key raises it
        ("plain-key-0123456789", 300, 300),  # a key without a priority: the model's
        ("batch-key-0123456789", 50, 100),
    ],
)
async def test_a_key_asks_for_a_model_through_another_door_at_the_higher_priority(
    key: str, model: int, asked: int
) -> None:
    controller = _Refusing()
    app = GatewayApp({}, {}, GatewayMetrics(), Access(KEYS, "127.0.0.1", ()))
    cluster = Cluster(
        controller,  # type: ignore[arg-type]
        name="gw-1", worker="box-1", models={}, routes={}, clock=FakeClock(),
    )  # fmt: skip
    app.name, app.cluster = "gw-1", cluster
    cluster.apply(_view(model))
    life = asyncio.ensure_future(cluster.run())
    try:
        status, answer = await _call(app, key, b'{"model": "chat"}')
    finally:
        life.cancel()
        await asyncio.gather(life, return_exceptions=True)
    assert status == 503 and "no room" in answer["error"]["message"]
    [body] = controller.bodies
    assert (body["model"], body["priority"]) == ("chat", asked)


async def test_a_host_that_refuses_a_connection_is_named_in_the_callers_error() -> None:
    """gw-3 serves chat warm but nothing listens at its address any more (its host was
    killed): the front door leaves it out and the caller's 503 names gw-3 and box-3."""
    app = GatewayApp({}, {}, GatewayMetrics(), Access(KEYS, "127.0.0.1", ()))
    cluster = Cluster(
        _Refusing(),  # type: ignore[arg-type]
        name="gw-1", worker="box-1", models={}, routes={}, clock=FakeClock(),
    )  # fmt: skip
    app.name, app.cluster = "gw-1", cluster
    chat = {"id": "chat", "aliases": [], "max_parallel": 2, "in_flight": 0,
            "replicas": [{"state": "warm", "in_flight": 0}]}  # fmt: skip
    cluster.apply({"signature": "s", "gateways": [
        {"name": "gw-3", "url": "http://127.0.0.1:1", "worker": "box-3",
         "worker_state": "online", "routable": True, "models": [chat],
         "public_key": Identity("gw-3").public_key},
    ]})  # fmt: skip
    status, answer = await _call(app, "ui-key-0123456789", b'{"model": "chat"}')
    assert status == 503
    assert "gw-3: on box-3, refused a connection just now" in answer["error"]["message"]
    assert cluster.host_name("gw-3") == "gw-3 (box-3)"
    assert cluster.host_name("gw-9") == "gw-9"


class _Pending:
    """The cluster's routes: no view comes; a load is pending (its long-poll answers
    only once ``grant`` is set, then granted on box-3); each call is kept, and each
    long-poll that was cut off (its asker stopped asking)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.cut = 0
        self.grant = asyncio.Event()

    async def request(self, method: str, path: str, **keys: Any) -> Any:
        if path.endswith("/cluster"):
            await asyncio.Event().wait()
        self.calls.append((method, path, keys.get("params")))
        if method == "DELETE":
            return {"model": "chat", "ended": ["l1"], "kept": []}
        try:
            await self.grant.wait()
        except asyncio.CancelledError:
            self.cut += 1
            raise
        return {"id": "l1", "state": "loading", "worker": "box-3", "gpus": ["box-3:0"],
                "vram_mb": 1024, "joined": False, "free_mb": {}}  # fmt: skip

    def withdrawn(self) -> list[Any]:
        return [params for method, _, params in self.calls if method == "DELETE"]


async def _cluster(controller: object) -> tuple[Cluster, asyncio.Task[None]]:
    cluster = Cluster(
        controller,  # type: ignore[arg-type]
        name="gw-1", worker="box-1", models={}, routes={}, clock=FakeClock(),
    )  # fmt: skip
    life = asyncio.ensure_future(cluster.run())
    await settle()
    return cluster, life


async def _end(life: asyncio.Task[None]) -> None:
    life.cancel()
    await asyncio.gather(life, return_exceptions=True)


async def test_a_pending_load_whose_last_waiter_goes_away_is_withdrawn_at_once() -> None:
    """No clock advances: the long-poll is cut off and the controller told at once, not
    after LOAD_WAIT_S; another waiter keeps it asked for until it goes away too."""
    controller = _Pending()
    cluster, life = await _cluster(controller)
    try:
        first = asyncio.ensure_future(cluster.load("chat", 500))
        second = asyncio.ensure_future(cluster.load("chat", 500))
        await settle()
        first.cancel()
        await settle()
        assert controller.withdrawn() == [] and controller.cut == 0  # one still waits
        second.cancel()
        await settle()
        assert controller.cut == 1
        assert controller.withdrawn() == [{"model": "chat"}]
        assert controller.calls[-1][1] == "/v1/gateways/gw-1/loads"
        assert cluster.load_waiting("chat") == "asking the arbiter where to load it"  # gone
        controller.grant.set()  # a new waiter asks anew
        again = await cluster.load("chat", 500)
        assert again.id == "l1" and len(controller.withdrawn()) == 1
    finally:
        await _end(life)


async def test_a_load_asked_while_the_last_one_is_withdrawn_is_asked_after() -> None:
    """Never joined to the load being withdrawn (the withdrawal would end it)."""
    controller = _Pending()
    cluster, life = await _cluster(controller)
    try:
        first = asyncio.ensure_future(cluster.load("chat", 500))
        await settle()
        first.cancel()
        await asyncio.sleep(0)
        controller.grant.set()
        again = await cluster.load("chat", 500)  # asked at once, before the withdrawal
        assert again.id == "l1"
        assert [method for method, _, _ in controller.calls] == ["POST", "DELETE", "POST"]
    finally:
        await _end(life)


async def test_a_grant_its_last_waiter_left_before_taking_is_withdrawn_one_taken_is_not() -> None:
    controller = _Pending()
    cluster, life = await _cluster(controller)
    try:
        taken = await asyncio.gather(cluster.load("chat", 500), _granting(controller))
        assert taken[0].id == "l1"
        await settle()
        assert controller.withdrawn() == []  # taken: its host serves it
        cluster._loads.clear()
        controller.grant.clear()
        waiter = asyncio.ensure_future(cluster.load("chat", 500))
        await settle()
        load = cluster._loads["chat"]
        controller.grant.set()
        while not load.task.done():  # the grant is in, its waiter not woken yet
            await asyncio.sleep(0)
        waiter.cancel()
        await settle()
        assert waiter.cancelled() and load.task.result().id == "l1"
        assert controller.withdrawn() == [{"model": "chat"}]
    finally:
        await _end(life)


async def _granting(controller: _Pending) -> None:
    await settle()
    controller.grant.set()


class _BetweenLeaders:
    """The cluster's routes while a standby takes over: each load's ask fails as the
    next of ``failures`` says (an exception), then it is granted on box-3."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.calls: list[str] = []

    async def request(self, method: str, path: str, **keys: Any) -> Any:
        if path.endswith("/cluster"):
            await asyncio.Event().wait()
        self.calls.append(method)
        if method == "POST" and self.failures:
            raise self.failures.pop(0)
        return {"id": "l1", "state": "loading", "worker": "box-3", "gpus": ["box-3:0"],
                "vram_mb": 1024, "joined": True, "free_mb": {}}  # fmt: skip


def _unreachable() -> ControllerUnreachable:
    return ControllerUnreachable("no controller answered (a: ConnectError; b: a standby)")


async def test_a_load_is_asked_again_while_the_controller_is_between_leaders() -> None:
    """None answers, then the new leader does not know this gateway yet (404 naming it,
    then 409 until its report is fresh): asked again after 0.5, 1 and 2 s, and joined."""
    unknown = ApiError(404, "not_found", "no gateway 'gw-1' reports here", {"gateway": "gw-1"})
    stale = ApiError(409, "conflict", "gateway gw-1 has not reported", {"gateway": "gw-1"})
    controller = _BetweenLeaders(_unreachable(), unknown, stale)
    cluster, life = await _cluster(controller)
    clock = cluster.clock
    assert isinstance(clock, FakeClock)
    try:
        waiter = asyncio.ensure_future(cluster.load("chat", 500))
        await settle()
        assert controller.calls == ["POST"]
        assert "the controller is unreachable" in cluster.load_waiting("chat")
        await clock.advance(0.5)
        assert controller.calls == ["POST"] * 2
        assert "does not know this gateway yet" in cluster.load_waiting("chat")
        await clock.advance(1.0)
        assert controller.calls == ["POST"] * 3 and not waiter.done()
        await clock.advance(2.0)
        assert (await waiter).id == "l1"
    finally:
        await _end(life)


async def test_a_load_the_controller_cannot_be_asked_for_ends_with_its_wait() -> None:
    """Asked again until its ``max_wait_s`` (300 s without a model here) is over, then
    its waiter is refused with the cause."""
    controller = _BetweenLeaders(*(_unreachable() for _ in range(100)))
    cluster, life = await _cluster(controller)
    clock = cluster.clock
    assert isinstance(clock, FakeClock)
    try:
        waiter = asyncio.ensure_future(cluster.load("chat", 500))
        await clock.advance(290.0)
        assert not waiter.done()
        await clock.advance(10.0)
        with pytest.raises(Refused) as refused:
            await waiter
        assert refused.value.status == 503
        assert "chat: the controller is unreachable (no controller answered" in refused.value.reason
        assert 60 < len(controller.calls) < 70  # at most every 5 s
    finally:
        await _end(life)


async def test_a_load_refused_for_another_cause_ends_at_once() -> None:
    """A 404 that does not name this gateway (no gateway declares the model) is the
    caller's answer, not a leader changing."""
    nowhere = ApiError(404, "not_found", "no gateway declares model 'chat'", {"model": "chat"})
    controller = _BetweenLeaders(nowhere)
    cluster, life = await _cluster(controller)
    try:
        with pytest.raises(Refused) as refused:
            await cluster.load("chat", 500)
        assert refused.value.status == 404 and "no gateway declares" in refused.value.reason
        assert controller.calls == ["POST"]
    finally:
        await _end(life)


async def test_a_load_asked_again_is_left_when_its_last_waiter_goes() -> None:
    controller = _BetweenLeaders(*(_unreachable() for _ in range(100)))
    cluster, life = await _cluster(controller)
    clock = cluster.clock
    assert isinstance(clock, FakeClock)
    try:
        waiter = asyncio.ensure_future(cluster.load("chat", 500))
        await clock.advance(1.0)
        waiter.cancel()
        await clock.advance(60.0)
        assert controller.calls == ["POST"] * 2 + ["DELETE"]  # withdrawn, asked no more
    finally:
        await _end(life)


async def test_a_load_granted_on_a_host_not_yet_in_the_view_waits_for_its_report() -> None:
    """A new leader knows the gateways only from their next reports: the host a load was
    granted on is waited for until a view shows its gateway, or for the bound only."""
    clock = FakeClock()
    cluster = Cluster(
        None,  # type: ignore[arg-type]
        name="gw-1", worker="box-1", models={}, routes={}, clock=clock,
    )  # fmt: skip
    cluster.apply({"signature": "s0", "gateways": []})
    waiting = asyncio.ensure_future(cluster.peer_on_within("box-3", 10.0))
    await clock.advance(3.0)
    assert not waiting.done()
    cluster.apply({"signature": "s1", "gateways": [
        {"name": "gw-3", "url": "http://127.0.0.3:1", "worker": "box-3",
         "worker_state": "online", "routable": True, "models": []},
    ]})  # fmt: skip
    found = await asyncio.wait_for(waiting, 5)
    assert found is not None and found.name == "gw-3"
    never = asyncio.ensure_future(cluster.peer_on_within("box-9", 10.0))
    await clock.advance(9.9)
    assert not never.done()
    await clock.advance(0.2)
    assert await asyncio.wait_for(never, 5) is None
