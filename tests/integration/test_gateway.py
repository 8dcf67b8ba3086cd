"""The gateway as a real process between callers and real model server processes,
with a real controller and agent (fake probe: the servers' memory follows them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from .agents import AgentProcess, worker_state
from .conftest import Server, wait_for
from .gateways import GatewayProcess, chat, model_entry, records

pytestmark = pytest.mark.timeout(120)


class Setup:
    def __init__(self, server: Server, runtime: Path, record: Path) -> None:
        self.server = server
        self.runtime = runtime
        self.record = record
        self.admin = server.client()
        self.started: list[GatewayProcess | AgentProcess] = []

    def agent(self, spec: str = "1x24G:sm_86") -> AgentProcess:
        agent = AgentProcess(self.server.url, self.server.admin_token, "box", self.runtime, spec)
        self.started.append(agent.start())
        wait_for(lambda: worker_state(self.admin, "box") == "online", what="box online")
        return agent

    def gateway(self, models: str) -> GatewayProcess:
        gateway = GatewayProcess(self.server.url, self.server.admin_token, self.runtime, models)
        self.started.append(gateway.start())
        return gateway

    def held(self, model: str) -> list[dict[str, object]]:
        leases = self.admin.get("/v1/leases").json()
        return [
            lease
            for lease in leases
            if lease["holder"].startswith(f"gateway {model} ") and lease["ended_at"] is None
        ]


@pytest.fixture
def setup(start_server: Callable[..., Server], tmp_path: Path) -> Iterator[Setup]:
    record = tmp_path / "record"
    record.mkdir()
    found = Setup(start_server(), tmp_path / "rt", record)
    yield found
    for process in reversed(found.started):
        process.stop()
    found.admin.close()


def test_cold_start_warm_reuse_and_keep_alive(setup: Setup) -> None:
    setup.agent()
    models = model_entry(
        "chat", setup.record, mb=8000, vram="10G", priority="interactive",
        keep_alive="2s", aliases=["gpt-4o-mini"],
    )  # fmt: skip
    gateway = setup.gateway(models)
    assert gateway.model_state("chat")["state"] == "cold"
    with gateway.client() as client:
        first = client.post("/v1/chat/completions", json=chat("gpt-4o-mini"))
        assert first.status_code == 200, first.text
        assert first.json()["model"] == "chat"
        [lease] = setup.held("chat")
        assert lease["vram_mb"] == 10240 and lease["priority"] == 800
        second = client.post("/v1/chat/completions", json=chat("chat"))
        assert second.status_code == 200
    [process] = records(setup.record, "chat")  # warm: the same server answered both
    assert "ready_at" in process
    # keep-alive: idle 2 s -> stopped and released, and cold again
    wait_for(lambda: "term_at" in records(setup.record, "chat")[0], 20, "keep-alive stop")
    wait_for(lambda: not setup.held("chat"), 10, "the lease released")
    assert gateway.model_state("chat")["state"] == "cold"
    unknown = httpx.post(gateway.url + "/v1/completions", json={"model": "nope"})
    assert unknown.status_code == 404
    assert "chat" in unknown.json()["error"]["message"]
