"""Update orchestration with a real agent and a real update command on its host."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .agents import AgentProcess, RunProcess, worker_state
from .conftest import Server, events, wait_for

pytestmark = pytest.mark.timeout(180)

UPDATE = """
import sys
from pathlib import Path
Path(sys.argv[1]).write_text("2.0\\n")
print("installed 2.0")
"""


@pytest.fixture
def admin(start_server: Callable[..., Server]) -> Iterator[tuple[Server, httpx.Client]]:
    server = start_server()
    with server.client() as client:
        yield server, client


def _agent(server: Server, tmp_path: Path, command: str) -> AgentProcess:
    version = tmp_path / "version.txt"
    version.write_text("1.0\n")
    token = server.token("worker", "box-a")
    extra = ("--update-command", command, "--version-file", str(version))
    return AgentProcess(server.url, token, "box-a", tmp_path / "rt", "1x24G:sm_86", *extra)


def _operation(client: httpx.Client, operation_id: str) -> dict[str, Any]:
    answer = client.get(f"/v1/operations/{operation_id}")
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


def test_update_drains_runs_the_local_command_restarts_and_comes_back(
    admin: tuple[Server, httpx.Client], tmp_path: Path
) -> None:
    server, client = admin
    script = tmp_path / "update.py"
    script.write_text(UPDATE)
    agent = _agent(server, tmp_path, f"{sys.executable} {script} {tmp_path / 'version.txt'}")
    agent.start()
    run = RunProcess(server.url, server.admin_token, tmp_path / "rt", "job", "--vram", "1G", mb=0)
    try:
        wait_for(lambda: worker_state(client, "box-a") == "online", what="box-a online")
        assert client.get("/v1/workers/box-a").json()["agent_version"] == "1.0"
        run.start()
        run.wait_child()

        started = client.post("/v1/workers/box-a/update")
        assert started.status_code == 202, started.text
        operation_id = started.json()["id"]
        wait_for(lambda: worker_state(client, "box-a") == "draining", what="draining")
        assert _operation(client, operation_id)["state"] == "running"
        assert _operation(client, operation_id)["steps"][-1]["name"] == "drain"
        run.go()  # the lease finishes: the worker drains, then the update runs
        assert run.wait() == 0

        wait_for(lambda: _operation(client, operation_id)["state"] != "running", what="update")
        done = _operation(client, operation_id)
        assert done["state"] == "succeeded", done
        steps = [(s["name"], s["outcome"]) for s in done["steps"]]
        assert steps == [
            ("drain", "started"),
            ("drain", "ok"),
            ("update_command", "started"),
            ("update_command", "ok"),
            ("restart", "started"),
            ("restart", "ok"),
            ("cancel_drain", "ok"),
        ]
        times = [s["at"] for s in done["steps"]]
        assert times == sorted(times)
        assert (done["from_version"], done["to_version"]) == ("1.0", "2.0")
        worker = client.get("/v1/workers/box-a").json()
        assert (worker["state"], worker["agent_version"]) == ("online", "2.0")
        assert agent.proc is not None
        assert agent.proc.poll() is None  # the same process, re-executed
        assert client.post("/v1/workers/box-a/update").status_code == 202  # not stuck
    finally:
        run.kill()
        agent.stop()


def test_a_failing_update_leaves_the_worker_drained_and_says_why(
    admin: tuple[Server, httpx.Client], tmp_path: Path
) -> None:
    server, client = admin
    failing = f"{sys.executable} -c \"print('disk full'); raise SystemExit(3)\""
    agent = _agent(server, tmp_path, failing)
    agent.start()
    try:
        wait_for(lambda: worker_state(client, "box-a") == "online", what="box-a online")
        operation_id = client.post("/v1/workers/box-a/update").json()["id"]
        wait_for(lambda: _operation(client, operation_id)["state"] != "running", what="the update")
        failed = _operation(client, operation_id)
        assert failed["state"] == "failed"
        assert "exited with 3" in failed["reason"]
        assert "disk full" in failed["reason"]
        assert failed["steps"][-1]["name"] == "update_command"
        assert failed["steps"][-1]["outcome"] == "failed"
        assert worker_state(client, "box-a") == "drained"
        assert client.get("/v1/workers/box-a").json()["agent_version"] == "1.0"
        assert [e["data"]["operation"] for e in events(client, "operation.failed")] == [
            operation_id
        ]
        # a report for another worker's operation is refused
        other = server.token("worker", "box-b")
        answer = httpx.post(
            f"{server.url}/v1/operations/{operation_id}/report",
            json={"step": "update_command", "outcome": "ok"},
            headers={"Authorization": f"Bearer {other}"},
        )
        assert answer.status_code == 403
    finally:
        agent.stop()


def test_an_update_whose_command_hangs_fails_at_its_timeout(
    admin: tuple[Server, httpx.Client], tmp_path: Path
) -> None:
    server, client = admin
    marks = tmp_path / "runs"
    marks.mkdir()
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, sys, time\n"
        "open(os.path.join(sys.argv[1], str(time.time_ns())), 'w').close()\n"
        "time.sleep(40)\n"
    )
    agent = _agent(server, tmp_path, f"{sys.executable} {script} {marks}")
    agent.start()
    try:
        wait_for(lambda: worker_state(client, "box-a") == "online", what="box-a online")
        started = client.post("/v1/workers/box-a/update", json={"timeout_s": 6})
        assert started.status_code == 202, started.text
        operation_id = started.json()["id"]
        wait_for(lambda: _operation(client, operation_id)["state"] != "running", what="update")
        failed = _operation(client, operation_id)
        assert failed["reason"] == (
            "update_command failed: the update command was not run to its end within 6 s"
        )
        assert [(s["name"], s["outcome"]) for s in failed["steps"]][-2:] == [
            ("update_command", "started"),
            ("update_command", "failed"),
        ]
        wait_for(lambda: len(list(marks.iterdir())) == 1, what="the command to have run")
        assert worker_state(client, "box-a") == "drained"  # and stays so, still heartbeating
        assert client.get("/v1/workers/box-a").json()["agent_version"] == "1.0"

        again = client.post("/v1/workers/box-a/update", json={"timeout_s": 600})
        assert again.status_code == 202, again.text

        # while the first command still runs, the agent starts no second one beside it
        def beat() -> float:
            return float(client.get("/v1/workers/box-a").json()["last_heartbeat_at"])

        first_beat = beat()
        wait_for(lambda: beat() > first_beat + 1.0, what="heartbeats answered with the update")
        assert _operation(client, again.json()["id"])["state"] == "running"
        assert len(list(marks.iterdir())) == 1
        assert agent.proc is not None and agent.proc.poll() is None
    finally:
        agent.stop()
