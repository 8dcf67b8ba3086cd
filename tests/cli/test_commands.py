"""The ``gpu-arbiter`` commands: ``--help`` lists every one, each is looked up by its
name alone, and a command imports only what it needs (a controller starts without the
agent, the gateway, the simulator or asyncpg; a report without the server). What a
command imports is read from the real process, started as its entry point starts it,
at its exit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from gpu_arbiter.cli import app, models, ops

pytestmark = pytest.mark.timeout(120)

SRC = Path(__file__).resolve().parents[2] / "src"
LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
SINGLE_COMMANDS = {"demo", "simulate", "serve", "agent", "run", "gateway", "logs", "top"}
NOT_FOR_SERVE = ("gpu_arbiter.agent", "gpu_arbiter.gateway", "gpu_arbiter.sim", "asyncpg")
NOT_FOR_STATUS = ("gpu_arbiter.server", "gpu_arbiter.controller", "fastapi", "uvicorn")

# `python -m gpu_arbiter ARGS...` that writes the names of the modules it imported, as
# JSON, to its first argument when it exits.
_REPORTING = """
import atexit, json, runpy, sys
report = sys.argv.pop(1)
atexit.register(lambda: open(report, "w").write(json.dumps(sorted(sys.modules))))
runpy.run_module("gpu_arbiter", run_name="__main__", alter_sys=True)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_ARBITER_")}
    return {**env, "PYTHONPATH": str(SRC)}


def _reporting(report: Path, *args: str, **popen: Any) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", _REPORTING, str(report), *args]
    return subprocess.Popen(command, env=_env(), text=True, **popen)


def _imported(report: Path) -> set[str]:
    return set(json.loads(report.read_text()))


def _within(modules: set[str], packages: tuple[str, ...]) -> set[str]:
    return {m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)}


def _wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_help_lists_every_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpu_arbiter", "--help"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    listing = done.stdout.split("\nCommands:\n", 1)[1]
    listed = [line.split()[0] for line in listing.splitlines() if line.startswith("  ")]
    every = SINGLE_COMMANDS | set(ops.COMMANDS) | set(models.MODEL_COMMANDS)
    every |= {"token", "gateways", "tls", "catalogue"}
    assert sorted(listed) == sorted(every)


@pytest.mark.parametrize(
    "name", [*sorted(SINGLE_COMMANDS), *ops.COMMANDS, *models.MODEL_COMMANDS, "token", "tls"]
)
def test_a_command_is_found_by_its_name_alone(name: str) -> None:
    done = CliRunner().invoke(app, [name, "--help"])
    assert done.exit_code == 0, done.output
    assert done.output.startswith(f"Usage: gpu-arbiter {name} [OPTIONS]")


def test_a_mistyped_command_is_named_with_the_nearest() -> None:
    done = CliRunner().invoke(app, ["statu"])
    assert done.exit_code == 2
    assert "No such command 'statu'. Did you mean 'status'?" in done.output


def test_serve_imports_neither_the_agent_the_gateway_the_simulator_nor_asyncpg(
    tmp_path: Path,
) -> None:
    report, log = tmp_path / "modules.json", tmp_path / "server.log"
    args = ["serve", "--port", "0", "--state-dir", str(tmp_path / "state")]
    with log.open("w") as out:
        server = _reporting(report, *args, "--simulate", "1x24G", stdout=out, stderr=out)
    try:
        port = _wait_for(lambda: LISTENING.findall(log.read_text()), "the server to listen")
        _wait_for(lambda: _ready(f"http://127.0.0.1:{port[-1]}"), "the server to be ready")
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0, log.read_text()
    finally:
        server.kill()
        server.wait()
    modules = _imported(report)
    assert "gpu_arbiter.server.app" in modules and "gpu_arbiter.store.sqlite" in modules
    assert _within(modules, NOT_FOR_SERVE) == set()


def test_status_imports_no_server(tmp_path: Path) -> None:
    report = tmp_path / "modules.json"
    nobody = "http://127.0.0.1:9"  # nothing listens: the report ends as it begins
    status = _reporting(
        report, "status", "--controller", nobody, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    _, err = status.communicate(timeout=60)
    assert status.returncode == 69, err
    modules = _imported(report)
    assert "gpu_arbiter.client" in modules
    assert _within(modules, NOT_FOR_STATUS + NOT_FOR_SERVE) == set()
