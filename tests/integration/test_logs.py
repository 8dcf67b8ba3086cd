"""``--log-format json`` on a real server and a real agent: every line of their stderr is
one JSON object, uvicorn's included, and no token appears anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .agents import AgentProcess, worker_state
from .conftest import SRC, Server, wait_for


def json_lines(path: Path) -> list[dict[str, Any]]:
    found = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)  # fails the test on any line that is not JSON
        assert isinstance(entry, dict), line
        assert {"ts", "level", "logger", "message"} <= entry.keys(), line
        found.append(entry)
    return found


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.stop()


def test_json_logs_carry_no_token(
    start_server: Callable[..., Server], agents: list[AgentProcess], tmp_path: Path
) -> None:
    server = start_server("--log-format", "json", "--log-level", "debug")
    admin_token = server.admin_token
    worker_token = server.token("worker", "w1")
    agent = AgentProcess(
        server.url, worker_token, "w1", tmp_path / "rt", "1x8G", "--log-format", "json"
    )
    agents.append(agent.start())
    with server.client() as admin:
        wait_for(lambda: worker_state(admin, "w1") == "online", what="the agent")
        assert admin.post("/v1/leases", json={"vram_mb": "1G", "holder": "x"}).status_code == 201
        assert admin.get(f"/v1/leases/{admin_token}").status_code == 404
        answer = admin.post("/v1/leases", json={"vram_mb": "1G", "holder": worker_token})
        assert answer.status_code == 202  # behind the first one's load
        assert admin.post("/v1/leases", json={"vram_mb": admin_token}).status_code == 422
    as_worker = {"Authorization": f"Bearer {worker_token}"}
    assert httpx.get(server.url + "/v1/status", headers=as_worker).status_code == 200
    assert httpx.post(server.url + "/v1/pause", headers=as_worker).status_code == 403
    for token in (admin_token + "x", worker_token[:-1], "gat_not-a-real-token"):
        answer = httpx.get(server.url + "/v1/status", headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 401
    agent.stop()
    server.stop()

    server_lines = json_lines(server.log)
    agent_lines = json_lines(agent.log)
    messages = [(e["logger"], e["message"]) for e in server_lines + agent_lines]
    assert any(logger.startswith("uvicorn") and "Uvicorn running" in m for logger, m in messages)
    assert any(m.startswith("admin token created in") for _, m in messages)
    assert any(logger == "gpu_arbiter.agent" and "registered w1" in m for logger, m in messages)
    for path in (server.log, agent.log):
        text = path.read_text()
        assert admin_token not in text, path
        assert worker_token not in text, path
        assert "gat_" not in text, path  # nothing shaped like a token either


def test_bad_log_format_is_refused_by_name(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("GPU_ARBITER_CONFIG", None)
    commands = {
        "log_format": ["serve", "--state-dir", str(tmp_path)],
        "--log-format": ["agent", "--simulate", "1x8G"],
    }
    for name, command in commands.items():
        done = subprocess.run(
            [sys.executable, "-m", "gpu_arbiter", *command, "--log-format", "xml"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert name in done.stderr
    assert not (tmp_path / "state.db").exists()


def test_config_file_sets_json(start_server: Callable[..., Server], tmp_path: Path) -> None:
    config = tmp_path / "arbiter.toml"
    config.write_text('[serve]\nlog_format = "json"\n')
    server = start_server("--config", str(config), "--simulate", "1x8G")
    server.stop()
    assert any(e["logger"] == "uvicorn.error" for e in json_lines(server.log))
