"""The auth matrix: every route with every role, no token and a wrong token."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import Server, register

ROLES = ("none", "wrong", "admin", "client", "other_client", "worker", "other_worker")


@dataclass
class World:
    server: Server
    tokens: dict[str, str | None]

    def client(self, role: str) -> httpx.Client:
        return self.server.client(self.tokens[role])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    server = Server(
        tmp_path_factory.mktemp("auth") / "state",
        "--simulate",
        "2x24G",
        "--heartbeat-timeout-s",
        "3600",
    ).start()
    try:
        tokens: dict[str, str | None] = {
            "none": None,
            "wrong": "gat_not-a-real-token",
            "admin": server.admin_token,
            "client": server.token("client"),
            "other_client": server.token("client"),
            "worker": server.token("worker", "box-1"),
            "other_worker": server.token("worker", "box-2"),
        }
        world = World(server, tokens)
        with world.client("admin") as admin:
            register(admin, "box-1")
        yield world
    finally:
        server.stop()


def _lease(world: World) -> str:
    """A fresh lease owned by ``client``."""
    with world.client("client") as client:
        answer = client.post("/v1/leases", json={"vram_mb": 1, "constraints": {"worker": "local"}})
        assert answer.status_code in (201, 202), answer.text
        return str(answer.json()["id"])


Call = Callable[[httpx.Client, World], httpx.Response]
READ = {"admin", "client", "other_client", "worker", "other_worker"}
OWNER = {"admin", "client"}
ADMIN = {"admin"}
AS_WORKER = {"admin", "worker"}
REGISTER_BODY: dict[str, Any] = {"name": "box-1", "gpus": [{"index": 0, "total_mb": 24576}]}

ROUTES: dict[str, tuple[Call, set[str]]] = {
    "create lease": (
        lambda c, w: c.post("/v1/leases", json={"vram_mb": 1}),
        OWNER | {"other_client"},
    ),
    "list leases": (lambda c, w: c.get("/v1/leases"), READ),
    "get lease": (lambda c, w: c.get(f"/v1/leases/{_lease(w)}"), READ),
    "renew": (lambda c, w: c.post(f"/v1/leases/{_lease(w)}/renew"), OWNER),
    "ready": (lambda c, w: c.post(f"/v1/leases/{_lease(w)}/ready"), OWNER),
    "idle": (lambda c, w: c.post(f"/v1/leases/{_lease(w)}/idle"), OWNER),
    "busy": (lambda c, w: c.post(f"/v1/leases/{_lease(w)}/busy"), OWNER),
    "release": (lambda c, w: c.delete(f"/v1/leases/{_lease(w)}"), OWNER),
    "revoke": (lambda c, w: c.post(f"/v1/leases/{_lease(w)}/revoke"), ADMIN),
    "register": (lambda c, w: c.post("/v1/workers", json=REGISTER_BODY), AS_WORKER),
    "heartbeat": (lambda c, w: c.post("/v1/workers/box-1/heartbeat", json={}), AS_WORKER),
    "list workers": (lambda c, w: c.get("/v1/workers"), READ),
    "get worker": (lambda c, w: c.get("/v1/workers/box-1"), READ),
    "drain": (lambda c, w: c.post("/v1/workers/box-1/drain", json={}), ADMIN),
    "cancel drain": (lambda c, w: c.post("/v1/workers/box-1/cancel-drain"), ADMIN),
    "remove": (lambda c, w: c.delete("/v1/workers/box-9"), ADMIN),
    "pause": (lambda c, w: c.post("/v1/pause"), ADMIN),
    "resume": (lambda c, w: c.post("/v1/resume"), ADMIN),
    "status": (lambda c, w: c.get("/v1/status"), READ),
    "queue": (lambda c, w: c.get("/v1/queue"), READ),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_route_with_every_role(world: World, route: str) -> None:
    call, allowed = ROUTES[route]
    for role in ROLES:
        with world.client(role) as client:
            answer = call(client, world)
        if role in ("none", "wrong"):
            expected = 401
        elif role not in allowed:
            expected = 403
        else:
            assert answer.status_code not in (401, 403), (route, role, answer.text)
            continue
        assert answer.status_code == expected, (route, role, answer.text)
        error = answer.json()["error"]
        assert set(error) == {"code", "message", "details"}
    with world.client("admin") as admin:
        admin.post("/v1/resume")
        admin.post("/v1/workers/box-1/cancel-drain")


def test_events_need_a_token(world: World) -> None:
    with world.client("none") as client:
        assert client.get("/v1/events").status_code == 401
    with world.client("wrong") as client:
        assert client.get("/v1/events").status_code == 401


def test_health_needs_no_token(world: World) -> None:
    with world.client("none") as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200


INVALID_BODIES: list[dict[str, Any]] = [
    {"json": {"vram_mb": "lots", "gpus": -1}},  # a field of the wrong type
    {"json": {"vram_mb": 1, "surprise": True}},  # an unknown field
    {"content": b"{not json", "headers": {"Content-Type": "application/json"}},
]


@pytest.mark.parametrize("body", INVALID_BODIES)
def test_without_a_token_an_invalid_body_is_401_not_its_validation_error(
    world: World, body: dict[str, Any]
) -> None:
    """Authentication comes before the body is read or validated: a caller without a
    (valid) token learns nothing of the API from its 422; with a token it gets it."""
    for role in ("none", "wrong"):
        with world.client(role) as anyone:
            answer = anyone.post("/v1/leases", **body)
            assert answer.status_code == 401, (role, answer.text)
            assert answer.json()["error"]["code"] == "unauthorized"
            assert answer.headers["WWW-Authenticate"] == "Bearer"
            assert anyone.get("/v1/queue", params={"limit": "x"}).status_code == 401
    with world.client("client") as client:
        assert client.post("/v1/leases", **body).status_code in (400, 422)


def test_a_client_token_with_an_invalid_lease_request_gets_422(world: World) -> None:
    with world.client("client") as client:
        answer = client.post("/v1/leases", json={"vram_mb": "lots"})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_input"
    assert "vram_mb" in answer.json()["error"]["message"]


def test_malformed_authorization_header_is_401(world: World) -> None:
    for header in ("Basic abc", "Bearer", "Bearer " + "x" * 300, world.tokens["admin"] or ""):
        answer = httpx.get(world.server.url + "/v1/status", headers={"Authorization": header})
        assert answer.status_code == 401, header
        assert answer.headers["www-authenticate"] == "Bearer"


def test_tokens_never_appear_in_the_log(world: World) -> None:
    log = world.server.log.read_text()
    for token in world.tokens.values():
        if token and token.startswith("gat_") and "not-a-real" not in token:
            assert token not in log


def test_admin_token_file_is_private(world: World) -> None:
    mode = (world.server.state_dir / "admin.token").stat().st_mode & 0o777
    assert mode == 0o600


def test_without_auth_only_loopback_is_allowed(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from .conftest import SRC

    command = [sys.executable, "-m", "gpu_arbiter", "serve", "--no-auth", "--host", "0.0.0.0"]
    command += ["--state-dir", str(tmp_path), "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0
    assert "refusing" in done.stderr


def test_without_auth_loopback_serves_everyone(start_server: Callable[..., Server]) -> None:
    server = start_server("--no-auth", "--simulate", "1x8G")
    with server.client(None) as anyone:
        assert anyone.post("/v1/leases", json={"vram_mb": 1}).status_code == 201
        assert anyone.post("/v1/pause", json={}).status_code == 200


def test_openapi_and_docs_are_published(world: World) -> None:
    with world.client("none") as client:
        spec = client.get("/openapi.json").json()
        assert "/v1/leases" in spec["paths"]
        assert "/v1/workers/{name}/drain" in spec["paths"]
        assert client.get("/docs").status_code == 200
