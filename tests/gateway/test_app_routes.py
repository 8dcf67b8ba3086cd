"""``GET /admin/routes`` shows each routing decision with the gateway's own diagnosis
(every candidate's filter or scores, the weights, the totals, the pick), and the
report to the controller carries the decisions without it; over a cluster view on a
virtual clock and no network (the routes asked for end here: none, or a local cold)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gpu_arbiter.gateway.base.metrics import GatewayMetrics
from gpu_arbiter.gateway.cluster.cluster import Cluster
from gpu_arbiter.gateway.cluster.report import Reporter
from gpu_arbiter.gateway.requests.app import GatewayApp
from gpu_arbiter.peer_identity import Identity, Relayed, decode_key

from .fakes import FakeClock
from .test_report import FakeController

pytestmark = pytest.mark.timeout(20)
Message = dict[str, Any]
GW_2 = Identity("gw-2")


def _gateway(name: str, model: str, state: str, routable: bool = True) -> dict[str, Any]:
    replicas = [{"state": state, "in_flight": 1}]
    return {
        "name": name, "url": f"http://127.0.0.2:80{name[-1]}", "worker": f"box-{name[-1]}",
        "worker_state": "online" if routable else "draining", "routable": routable,
        "models": [{"id": model, "aliases": [], "max_parallel": 2, "in_flight": 1,
                    "replicas": replicas}],
    }  # fmt: skip


async def _call(
    app: GatewayApp,
    method: str,
    path: str,
    body: bytes = b"",
    more: tuple[tuple[bytes, bytes], ...] = (),
) -> tuple[int, Any]:
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

    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    headers += more
    await app({"type": "http", "method": method, "path": path, "headers": headers}, receive, send)
    [head] = [m for m in sent if m["type"] == "http.response.start"]
    text = b"".join(m.get("body", b"") for m in sent)
    return head["status"], json.loads(text) if text.startswith(b"{") else text


def _front_door() -> tuple[GatewayApp, Cluster]:
    app = GatewayApp({}, {}, GatewayMetrics())
    cluster = Cluster(None, name="gw-1", worker="box-1", models={}, routes={}, clock=FakeClock())  # type: ignore[arg-type]
    app.name = "gw-1"
    app.cluster = cluster
    cluster.apply(
        {"signature": "s",
         "gateways": [_gateway("gw-2", "chat", "warm", routable=False)
                      | {"public_key": GW_2.public_key},
                      _gateway("gw-3", "other", "busy"), _gateway("gw-4", "other", "warm")]}
    )  # fmt: skip
    return app, cluster


async def test_admin_routes_shows_each_decision_with_its_diagnosis() -> None:
    app, cluster = _front_door()
    status, answer = await _call(app, "POST", "/v1/chat/completions", b'{"model": "chat"}')
    assert status == 503 and "worker box-2 is draining" in answer["error"]["message"]
    cluster.record("other", cluster.decide("other"))  # a warm peer, scored
    status, shown = await _call(app, "GET", "/admin/routes")
    assert status == 200
    newest, first = shown["routes"]
    assert set(first) == {"at", "model", "outcome", "to", "why", "diagnosis"}
    assert (first["model"], first["outcome"], first["to"]) == ("chat", "none", None)
    [warm] = first["diagnosis"]
    assert warm["picked"] is None
    assert warm["candidates"][0]["dropped"] == {
        "filter": "routable",
        "why": "worker box-2 is draining",
    }
    assert (newest["outcome"], newest["to"]) == ("peer", "gw-3")
    [warm] = newest["diagnosis"]
    assert warm["profile"] == "warm" and warm["picked"] == "gw-3"
    assert warm["weights"] == {"free_slot": 4.0, "fewest_in_flight": 1.0}
    scored = {c["name"]: (c["scores"], c["total"]) for c in warm["candidates"]}
    assert scored == {
        "gw-3": ({"free_slot": 1.0, "fewest_in_flight": 0.5}, 4.5),
        "gw-4": ({"free_slot": 1.0, "fewest_in_flight": 0.5}, 4.5),  # equal: by name
    }


async def test_the_report_carries_the_decisions_without_the_diagnosis() -> None:
    _, cluster = _front_door()
    cluster.record("other", cluster.decide("other"))
    controller = FakeController()
    reporter = Reporter(
        controller,  # type: ignore[arg-type]  # the routes it calls
        name="gw-1", url="http://127.0.0.1:8080", host="box", worker="box-1", models={},
        administer=lambda *_: asyncio.sleep(0), routes=lambda: cluster.routed,
    )  # fmt: skip
    running = asyncio.ensure_future(reporter.run())
    try:
        [route] = (await controller.next_report())["routes"]
    finally:
        running.cancel()
    assert set(route) == {"at", "model", "outcome", "to", "why"}
    assert "diagnosis" in cluster.routed[-1]


@pytest.mark.parametrize(
    ("name", "status", "says"),
    [("other@gw-9", 404, "other@gw-9: no live gateway 'gw-9' in this cluster"),
     ("chat@gw-3", 404, "chat@gw-3: gateway gw-3 does not serve 'chat'"),
     ("chat@gw-2", 503, "chat@gw-2: gateway gw-2 takes no new request: worker box-2 is draining"),
     ("other@gw-4", 503, "other@gw-4: gateway gw-4 takes no new request: refused a connection"),
     ("other@gw-1", 404, "other@gw-1: gateway gw-1 does not serve 'other'")],
)  # fmt: skip
async def test_a_named_copy_not_to_be_had_says_which_gateway_and_why(
    name: str, status: int, says: str
) -> None:
    """``MODEL@GATEWAY``: a gateway no live one is called, or one that does not serve the
    model, is a 404; one live but draining or down just now a 503 naming it and why."""
    app, cluster = _front_door()
    cluster.peer_down("gw-4")
    found, answer = await _call(
        app, "POST", "/v1/chat/completions", b'{"model": "%s"}' % name.encode()
    )
    assert found == status
    assert answer["error"]["message"].startswith(says), answer


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/metrics"),
        ("GET", "/admin/routes"),
        ("POST", "/admin/models/chat/pin"),
        ("POST", "/admin/models/chat/unpin"),
        ("POST", "/admin/models/chat/unload"),
        ("GET", "/v1/models"),
    ],
)
async def test_a_peers_word_opens_no_route_but_a_models(method: str, path: str) -> None:
    """With API keys here and none sent, a peer's verified header is refused (403
    ``permission_denied``) everywhere but a relayed model request; one signed with
    another key is refused (403 ``invalid_peer``, saying why). The serving gateway's
    route records name the relay's sender, verified."""
    from gpu_arbiter.gateway.requests.access import Access, ApiKey

    app, cluster = _front_door()
    admin = "ui-key-0123456789"
    app.access = Access((ApiKey("ui", admin, "admin"),), "127.0.0.1", ())

    def signed(by: Identity, method: str, path: str) -> tuple[tuple[bytes, bytes], ...]:
        gw1 = decode_key(cluster.identity.public_key)
        header = by.sign("gw-1", gw1, Relayed(method, path.encode()))
        return ((b"x-arbiter-peer", header.encode()),)

    status, answer = await _call(app, method, path, b"{}", signed(GW_2, method, path))
    assert status == 403, answer
    assert "relayed model requests only" in answer["error"]["message"]
    status, answer = await _call(app, method, path, b"{}", signed(Identity("gw-2"), method, path))
    assert status == 403 and answer["error"]["code"] == "invalid_peer", answer
    message = answer["error"]["message"]
    assert "does not verify with the key this gateway shares with gateway gw-2's" in message
    chat = "/v1/chat/completions"
    status, answer = await _call(
        app, "POST", chat, b'{"model": "chat"}', signed(GW_2, "POST", chat)
    )
    assert status == 404 and answer["error"]["code"] == "model_not_found"  # served: no copy here
    bearer = ((b"authorization", f"Bearer {admin}".encode()),)
    status, shown = await _call(app, "GET", "/admin/routes", b"", bearer)
    relayed = shown["routes"][0]
    assert (relayed["outcome"], relayed["from"], relayed["verified"]) == ("relayed", "gw-2", True)
