"""A gateway killed (SIGKILL) while a cold start is queued leaves a lease request behind;
the gateway restarted on the same state directory cancels it before it serves, so its
first request waits behind nothing of its own (not a stranger's TTL)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .agents import AgentProcess
from .conftest import Server, wait_for
from .gateways import GatewayProcess, chat, model_entry


@pytest.fixture
def server(start_server: Callable[..., Server]) -> Server:
    return start_server()


@pytest.fixture
def admin(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture
def agent(server: Server, admin: httpx.Client, tmp_path: Path) -> Iterator[AgentProcess]:
    found = AgentProcess(server.url, server.admin_token, "box", tmp_path / "rt", "1x24G:sm_86")
    found.start()
    wait_for(lambda: admin.get("/v1/workers/box").status_code == 200, what="box registered")
    yield found
    found.stop()


def chat_leases(admin: httpx.Client) -> list[dict[str, Any]]:
    return [
        lease
        for lease in admin.get("/v1/leases").json()
        if (lease["metadata"] or {}).get("model") == "chat"
    ]


def post_in_background(url: str) -> threading.Thread:
    """A chat request to the gateway that waits (its answer, or its connection's end,
    is not looked at: the gateway is killed meanwhile)."""

    def post() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(url + "/v1/chat/completions", json=chat("chat"), timeout=120)

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def test_a_restarted_gateway_cancels_the_lease_request_its_killed_predecessor_queued(
    server: Server, admin: httpx.Client, agent: AgentProcess, tmp_path: Path
) -> None:
    record = tmp_path / "record"
    record.mkdir()
    models = model_entry("chat", record, mb=8000, vram="10G", queue_timeout="90s")
    big = admin.post("/v1/leases", json={"vram_mb": "20G", "holder": "big", "ttl_s": 3600})
    assert big.status_code == 201, big.text
    gateway = GatewayProcess(server.url, server.admin_token, tmp_path / "rt", models).start()
    waiting = post_in_background(gateway.url)
    [queued] = wait_for(
        lambda: [x for x in chat_leases(admin) if x["state"] == "pending"] or None,
        60,
        "the cold start's lease request",
    )
    state_dir = str((tmp_path / "rt" / "state").resolve())
    assert queued["metadata"]["gateway_dir"] == state_dir

    gateway.kill9()
    waiting.join(timeout=60)
    assert admin.get(f"/v1/leases/{queued['id']}").json()["state"] == "pending"
    restarted = GatewayProcess(server.url, server.admin_token, tmp_path / "rt", models)
    restarted.log = tmp_path / "rt" / "restarted.log"  # its own "gateway on" line
    restarted.start()  # it listens once it has ended what the last one asked for
    try:
        old = admin.get(f"/v1/leases/{queued['id']}").json()
        assert (old["state"], old["end_reason"]) == ("cancelled", "cancelled")
        assert old["granted_at"] is None  # never granted to nobody
        assert admin.delete(f"/v1/leases/{big.json()['id']}").status_code == 200
        with restarted.client() as client:
            answer = client.post("/v1/chat/completions", json=chat("chat"))
        assert answer.status_code == 200, answer.text
        [held] = [x for x in chat_leases(admin) if x["ended_at"] is None]
        assert held["id"] != queued["id"]
    finally:
        restarted.stop()
