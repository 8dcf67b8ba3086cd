"""A relay signed by a peer this gateway's view does not show yet (it just started, or
restarted with a new key): the view is asked for again at once, at most once a second
however many such requests come, and the relay is taken if that view shows the sender's
key; a relay signed with a key no view shows stays refused (403 ``invalid_peer``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gpu_arbiter.gateway.base.metrics import GatewayMetrics
from gpu_arbiter.gateway.cluster.cluster import Cluster
from gpu_arbiter.gateway.requests.access import Access
from gpu_arbiter.gateway.requests.app import GatewayApp
from gpu_arbiter.peer_identity import Identity, Relayed, decode_key

from .fakes import FakeClock

pytestmark = pytest.mark.timeout(20)


class _Controller:
    """The cluster view's route: the long-poll never answers (the new view is on its
    way); a view asked for at once (``wait`` 0) shows gw-2 with ``key``."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.asked = 0

    async def request(self, method: str, path: str, **keys: Any) -> Any:
        assert path == "/v1/gateways/gw-3/cluster"
        if keys["params"]["wait"]:
            await asyncio.Event().wait()
        self.asked += 1
        gw2 = {"name": "gw-2", "url": "http://127.0.0.2:8002", "public_key": self.key}
        return {"signature": f"s{self.asked}", "gateways": [gw2]}


async def _listing(app: GatewayApp, by: Identity) -> str:
    """``GET /metrics`` signed by ``by``: ``permission_denied`` when the relay is taken (a
    peer's word opens relayed model requests only), ``invalid_peer`` when it is not."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    assert app.cluster is not None
    gw3 = decode_key(app.cluster.identity.public_key)
    signed = by.sign("gw-3", gw3, Relayed("GET", b"/metrics"))
    headers = [(b"x-arbiter-peer", signed.encode())]
    await app(
        {"type": "http", "method": "GET", "path": "/metrics", "headers": headers}, receive, send
    )
    [head] = [m for m in sent if m["type"] == "http.response.start"]
    assert head["status"] == 403
    return str(json.loads(b"".join(m.get("body", b"") for m in sent))["error"]["code"])


async def test_a_key_a_new_view_brings_is_learned_at_once_and_a_bogus_one_refused() -> None:
    restarted, impostor = Identity("gw-2"), Identity("gw-2")
    controller = _Controller(restarted.public_key)
    clock = FakeClock()
    cluster = Cluster(
        controller,  # type: ignore[arg-type]
        name="gw-3", worker="box-3", models={}, routes={}, clock=clock,
    )  # fmt: skip
    old = Identity("gw-2")
    cluster.apply({"signature": "s0", "gateways": [{"name": "gw-2", "public_key": old.public_key}]})
    app = GatewayApp({}, {}, GatewayMetrics(), Access((), "127.0.0.1", ()))
    app.name, app.cluster = "gw-3", cluster
    life = asyncio.ensure_future(cluster.run())
    try:
        assert await _listing(app, old) == "permission_denied"  # known: taken, not asked
        assert controller.asked == 0
        assert await _listing(app, restarted) == "permission_denied"  # learned: taken
        assert controller.asked == 1
        assert await _listing(app, old) == "invalid_peer"  # its key replaced: refused
        statuses = await asyncio.gather(*(_listing(app, impostor) for _ in range(5)))
        assert statuses == ["invalid_peer"] * 5
        assert controller.asked == 1  # within a second of the last: not asked again
        await clock.advance(1.0)
        assert await _listing(app, impostor) == "invalid_peer"
        assert controller.asked == 2
    finally:
        life.cancel()
        await asyncio.gather(life, return_exceptions=True)
