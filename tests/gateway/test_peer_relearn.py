"""A peer's credential this gateway does not know yet (a new leader's view reached the
peer first): the view is asked for again at once, at most once a second however many
such requests come, and the credential is trusted if that view has it; a credential no
view has stays refused (401)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gpu_arbiter.gateway.base.metrics import GatewayMetrics
from gpu_arbiter.gateway.cluster.cluster import Cluster
from gpu_arbiter.gateway.requests.access import Access
from gpu_arbiter.gateway.requests.app import GatewayApp

from .fakes import FakeClock

pytestmark = pytest.mark.timeout(20)


class _Controller:
    """The cluster view's route: the long-poll never answers (the new view is on its
    way); a view asked for at once (``wait`` 0) has ``key``."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.asked = 0

    async def request(self, method: str, path: str, **keys: Any) -> Any:
        assert path == "/v1/gateways/gw-3/cluster"
        if keys["params"]["wait"]:
            await asyncio.Event().wait()
        self.asked += 1
        return {"signature": f"s{self.asked}", "peer_key": self.key, "gateways": []}


async def _listing(app: GatewayApp, credential: str) -> int:
    """``GET /metrics`` with a peer's credential: 403 when it is trusted (a peer's word
    opens relayed model requests only), 401 when it is not."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"x-arbiter-peer", credential.encode())]
    await app(
        {"type": "http", "method": "GET", "path": "/metrics", "headers": headers}, receive, send
    )
    [head] = [m for m in sent if m["type"] == "http.response.start"]
    json.loads(b"".join(m.get("body", b"") for m in sent))
    return int(head["status"])


async def test_a_credential_a_new_view_brings_is_learned_at_once_and_a_bogus_one_refused() -> None:
    controller = _Controller("new-key")
    clock = FakeClock()
    cluster = Cluster(
        controller,  # type: ignore[arg-type]
        name="gw-3", worker="box-3", models={}, routes={}, clock=clock,
    )  # fmt: skip
    cluster.apply({"signature": "s0", "peer_key": "old-key", "gateways": []})
    app = GatewayApp({}, {}, GatewayMetrics(), Access((), "127.0.0.1", ()))
    app.name, app.cluster = "gw-3", cluster
    life = asyncio.ensure_future(cluster.run())
    try:
        assert await _listing(app, "new-key") == 403  # learned: trusted (and refused here)
        assert controller.asked == 1
        statuses = await asyncio.gather(*(_listing(app, "bogus") for _ in range(5)))
        assert statuses == [401] * 5
        assert controller.asked == 1  # within a second of the last: not asked again
        await clock.advance(1.0)
        assert await _listing(app, "bogus") == 401
        assert controller.asked == 2
    finally:
        life.cancel()
        await asyncio.gather(life, return_exceptions=True)
