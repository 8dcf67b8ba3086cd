"""The request as one value (``requests/request.py``): a peer's signed header verified
once at the entry, over the request as it came, the caller's key and priority found
there; and the dispatch table of ``requests/app.py``: which handler answers a method and
path, and which routes go to a model (those a stopping gateway refuses)."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_arbiter.gateway.requests import app
from gpu_arbiter.gateway.requests.access import Access, ApiKey
from gpu_arbiter.gateway.requests.app import GatewayApp
from gpu_arbiter.gateway.requests.request import Request
from gpu_arbiter.peer_identity import Refusal, Relayed

KEYS = (ApiKey("batch", "batch-key-0123456789", priority=200), ApiKey("ui", "ui-key-0123456789"))


async def _receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


async def _send(message: Any) -> None:
    pass


def _request(headers: dict[str, str], access: Access, trusts: set[str]) -> Request:
    """The request, its peer header (if any) verified by a fake: taken (as gw-2's) when
    it is one of ``trusts``."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "query_string": b"stream=1",
        "headers": [(name.encode(), value.encode()) for name, value in headers.items()],
    }
    asked: list[tuple[str, Relayed]] = []

    def verify(signed: str, relayed: Relayed) -> str | Refusal:
        asked.append((signed, relayed))
        return "gw-2" if signed in trusts else Refusal("forged")

    request = Request.build(scope, _receive, _send, access, verify)
    assert len(asked) == (1 if "X-Arbiter-Peer" in headers else 0)  # asked once, if at all
    for _, relayed in asked:  # what it checks the signature of: the request as it came
        assert relayed.method == "POST" and relayed.target == b"/v1/chat/completions?stream=1"
        assert relayed.priority == headers.get("X-Arbiter-Priority", "")
        assert relayed.lease == headers.get("X-Arbiter-Lease", "")
    return request


def test_a_request_without_a_peer_credential_carries_its_keys_priority() -> None:
    access = Access(KEYS, "127.0.0.1", ())
    request = _request({"Authorization": "Bearer batch-key-0123456789"}, access, set())
    assert request.peer is None and request.peer_refused is None
    assert request.key is KEYS[0] and request.priority == 200
    assert request.headers[b"authorization"] == "Bearer batch-key-0123456789"
    assert request.raw_headers == [(b"Authorization", b"Bearer batch-key-0123456789")]
    request = _request({"Authorization": "Bearer ui-key-0123456789"}, access, set())
    assert request.key is KEYS[1] and request.priority is None  # the model's


def test_a_peer_gives_its_front_doors_priority_capped_at_the_highest_key_here() -> None:
    access = Access((*KEYS, ApiKey("ui", "chat-key-0123456789", priority=700)), "x", ())
    assert access.max_priority == 700
    headers = {"X-Arbiter-Peer": "secret", "X-Arbiter-Priority": "300", "X-Arbiter-Lease": "l1"}
    request = _request(headers, access, {"secret"})
    assert request.peer == "gw-2" and request.priority == 300
    headers["X-Arbiter-Priority"] = "1000"  # above every key here: capped
    assert _request(headers, access, {"secret"}).priority == 700
    headers["X-Arbiter-Priority"] = "1001"  # beyond the scale: the model's
    assert _request(headers, access, {"secret"}).priority is None
    request = _request(headers | {"X-Arbiter-Peer": "forged"}, access, {"secret"})
    assert request.peer is None and request.priority is None
    assert request.peer_refused == Refusal("forged")
    for keys in ((), (KEYS[1],)):  # no key here gives a priority: a peer's gives none
        assert Access(keys, "x", ()).max_priority is None
        headers["X-Arbiter-Priority"] = "1000"
        assert _request(headers, Access(keys, "x", ()), {"secret"}).priority is None


def test_without_keys_no_priority_comes_from_a_bearer_header() -> None:
    request = _request({"Authorization": "Bearer batch-key-0123456789"}, Access((), "x", ()), set())
    assert request.key is None and request.priority is None


@pytest.mark.parametrize(
    ("method", "path", "handler", "to_a_model"),
    [
        ("POST", "/v1/chat/completions", GatewayApp._openai, True),
        ("POST", "/v1/models", GatewayApp._openai, True),
        ("GET", "/models/comfy/prompt", GatewayApp._prefix, True),
        ("PUT", "/models/comfy/upload", GatewayApp._prefix, True),
        ("GET", "/v1/models", GatewayApp._listing, False),
        ("GET", "/v1/models/chat", GatewayApp._listing, False),
        ("POST", "/admin/models/chat/unload", GatewayApp._admin, False),
        ("POST", "/admin/models/chat/bogus", GatewayApp._admin, False),  # its 404 there
        ("GET", "/admin/routes", GatewayApp._routed, False),
        ("GET", "/metrics", app._metrics, False),
        ("POST", "/healthz", app._healthz, False),
        ("GET", "/v1/chat/completions", app._not_found, False),
        ("DELETE", "/v1/models", app._not_found, False),
        ("POST", "/admin/routes", app._not_found, False),
        ("GET", "/nowhere", app._not_found, False),
    ],
)
def test_one_table_says_which_handler_answers(
    method: str, path: str, handler: Any, to_a_model: bool
) -> None:
    assert app._route_of(method, path) == (handler, to_a_model)
