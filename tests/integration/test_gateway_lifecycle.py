"""Stopping or killing ``serve --local --models`` leaves nothing behind.

SIGTERM and SIGINT stop every model server (one SIGTERM) and release its lease while
the controller still serves, then exit 0; a second signal kills the servers at once;
after ``kill -9`` the gateway's watchdog stops the servers within their grace; a
restart on the same state directory stops what is still left before it serves and
releases the previous run's leases. Each model's output is in its own log, which
``gpu-arbiter logs`` prints. Real processes throughout: the controller with its agent
and gateway, the test model server (tests/integration/model_server.py) and a real
llama.cpp server where one is installed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gpu_arbiter.gateway.servers.watchdog import group_alive

from .agents import env_for
from .conftest import SRC, Server, wait_for
from .gateways import LISTENING, MODEL_SERVER, GatewayProcess, chat, records

pytestmark = pytest.mark.timeout(180)

STARTED = re.compile(r"\] pid (\d+) started \(lease ")


def alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def model(name: str, record: Path, *, ignore_term: bool = False, **keys: str) -> str:
    """A ``[models.NAME]`` table running the test model server."""
    command = [sys.executable, str(MODEL_SERVER), "--port", "{port}", "--name", name]
    command += ["--mb", "1000", "--record", str(record)]
    command += ["--ignore-term"] if ignore_term else []
    keys = {"vram": "4G", "grace": "1s", "idle_after": "0.1s", **keys}
    lines = [f"[models.{name}]", f"command = {json.dumps(command)}"]
    return "\n".join(lines + [f"{key} = {json.dumps(value)}" for key, value in keys.items()])


class Local:
    """``serve --local --models`` on one state directory, started as often as needed."""

    def __init__(self, start_server: Callable[..., Server], tmp_path: Path, models: str) -> None:
        self.start_server = start_server
        self.state_dir = tmp_path / "state"
        self.models = tmp_path / "models.toml"
        self.models.write_text("[gateway]\nport = 0\n" + models + "\n")
        self.runs = 0

    def start(self) -> tuple[Server, str]:
        """A run, and its gateway's URL once it serves."""
        server: Server = self.start_server(
            "--local", "--simulate", "1x24G", "--models", str(self.models),
            state_dir=self.state_dir,
        )  # fmt: skip
        self.runs += 1
        found = wait_for(
            lambda: len(ports := LISTENING.findall(server.log.read_text())) >= self.runs and ports,
            60,
            "the gateway to serve",
        )
        return server, f"http://127.0.0.1:{found[-1]}"

    @staticmethod
    def held(server: Server) -> str:
        """The id of the one lease the gateway holds for model ``chat``."""
        with server.client() as admin:
            [lease] = [
                x for x in admin.get("/v1/leases").json() if x["holder"].startswith("gateway chat ")
            ]
        return str(lease["id"])

    @staticmethod
    def state(server: Server, lease_id: str) -> str:
        with server.client() as admin:
            return str(admin.get(f"/v1/leases/{lease_id}").json()["state"])


def _cold_start(url: str) -> None:
    answer = httpx.post(f"{url}/v1/completions", json=chat("chat"), timeout=60)
    assert answer.status_code == 200, answer.text


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The agent's socket directory, and where the test model servers record."""
    monkeypatch.setenv("GPU_ARBITER_RUNTIME_DIR", str(tmp_path / "rt"))
    record = tmp_path / "record"
    record.mkdir()
    return record


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_each_server_once_releases_its_lease_and_exits_0(
    start_server: Callable[..., Server], tmp_path: Path, runtime: Path, signum: int
) -> None:
    local = Local(start_server, tmp_path, model("chat", runtime))
    server, url = local.start()
    _cold_start(url)
    [started] = records(runtime, "chat")
    lease_id = local.held(server)
    assert server.proc is not None

    server.proc.send_signal(signum)

    assert server.proc.wait(timeout=60) == 0
    [stopped] = records(runtime, "chat")
    assert stopped["terms"] == 1 and "exit_at" in stopped  # it drained on its one SIGTERM
    assert not group_alive(started["pid"])
    text = server.log.read_text()
    assert "Traceback" not in text and "unreachable" not in text, text
    restarted, _ = local.start()
    assert local.state(restarted, lease_id) == "released"  # before the controller stopped
    assert "left running by the previous gateway" not in restarted.log.read_text()


def test_plain_serve_exits_0_on_sigterm(start_server: Callable[..., Server]) -> None:
    server = start_server("--simulate", "1x8G")
    assert server.proc is not None

    server.proc.send_signal(signal.SIGTERM)

    assert server.proc.wait(timeout=60) == 0  # uvicorn would raise the signal again: -15
    assert "Traceback" not in server.log.read_text()


def test_a_second_signal_kills_the_servers_without_waiting_for_their_grace(
    start_server: Callable[..., Server], tmp_path: Path, runtime: Path
) -> None:
    local = Local(start_server, tmp_path, model("chat", runtime, ignore_term=True, grace="600s"))
    server, url = local.start()
    _cold_start(url)
    [started] = records(runtime, "chat")
    lease_id = local.held(server)
    assert server.proc is not None

    server.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: records(runtime, "chat")[0].get("terms"), 30, "its SIGTERM")
    server.proc.send_signal(signal.SIGTERM)

    assert server.proc.wait(timeout=120) == 0  # not the 600 s grace
    assert not group_alive(started["pid"])
    [stopped] = records(runtime, "chat")
    assert stopped["terms"] == 1 and "exit_at" not in stopped  # SIGKILLed
    restarted, _ = local.start()
    assert local.state(restarted, lease_id) == "released"


def test_after_kill_9_the_watchdog_stops_the_server_and_a_restart_releases_its_lease(
    start_server: Callable[..., Server], tmp_path: Path, runtime: Path
) -> None:
    local = Local(start_server, tmp_path, model("chat", runtime, ignore_term=True, grace="1s"))
    server, url = local.start()
    _cold_start(url)
    [started] = records(runtime, "chat")
    lease_id = local.held(server)

    server.kill9()

    wait_for(lambda: not group_alive(started["pid"]), 1 + 30, "the watchdog to stop it")
    [stopped] = records(runtime, "chat")
    assert stopped["terms"] == 1 and "exit_at" not in stopped  # SIGKILL after its grace
    restarted, _ = local.start()
    assert local.state(restarted, lease_id) == "released"  # before the gateway served


def _watchdog_of(pid: int) -> int:
    """The gateway's watchdog: the child of ``pid`` that runs watchdog.py."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"watchdog.py" in command:
            return int(entry.name)
    raise AssertionError(f"no watchdog under pid {pid}")


def test_a_restart_stops_what_the_last_run_left_before_it_serves_and_releases_its_lease(
    start_server: Callable[..., Server], tmp_path: Path, runtime: Path
) -> None:
    local = Local(start_server, tmp_path, model("chat", runtime))
    server, url = local.start()
    _cold_start(url)
    [started] = records(runtime, "chat")
    lease_id = local.held(server)
    assert server.proc is not None
    os.kill(_watchdog_of(server.proc.pid), signal.SIGKILL)  # nothing stops it, then
    server.kill9()
    assert alive(started["pid"])  # left running, its lease active

    restarted, url = local.start()

    assert not alive(started["pid"])  # stopped before the gateway served
    [stopped] = records(runtime, "chat")
    assert stopped["terms"] == 1
    assert "left running by the previous gateway: stopping it" in restarted.log.read_text()
    assert local.state(restarted, lease_id) == "released"
    _cold_start(url)  # and it serves again: a new server under a new lease


def _logs(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    command = [sys.executable, "-m", "gpu_arbiter", "logs", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_sigterm_stops_a_real_llama_server_whose_output_logs_prints(
    start_server: Callable[..., Server],
    tmp_path: Path,
    runtime: Path,
    llama_server: Path,
    tiny_models: Path,
) -> None:
    command = f"{llama_server} -m {tiny_models / 'tiny-chat.gguf'} -c 512 --port {{port}}"
    local = Local(
        start_server, tmp_path, f'[models.chat]\ncommand = "{command}"\nvram = "1G"\ngrace = "10s"'
    )
    server, url = local.start()
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    log = local.state_dir / "gateway" / "logs" / "chat.log"
    pid = int(STARTED.findall(log.read_text())[-1])
    assert server.proc is not None

    server.proc.send_signal(signal.SIGTERM)

    assert server.proc.wait(timeout=60) == 0
    assert not group_alive(pid)
    text = server.log.read_text()
    assert "Traceback" not in text and "llama_server" not in text  # its output is elsewhere
    shown = _logs("chat", "--state-dir", str(local.state_dir), "--lines", "3")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert len(lines) == 3 and lines[-1].endswith(f"pid {pid} exited with code 0")
    everything = _logs("chat", "--state-dir", str(local.state_dir), "--lines", "1000")
    assert "llama_server: model loaded" in everything.stdout
    unknown = _logs("nope", "--state-dir", str(local.state_dir))
    assert unknown.returncode == 1
    assert (
        unknown.stderr.strip() == "gpu-arbiter logs: no log of model nope (models with logs: chat)"
    )


def test_a_second_gateway_on_the_same_state_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    runtime = tmp_path / "rt"
    first = GatewayProcess("http://127.0.0.1:9", "unused", runtime, model("chat", tmp_path))
    try:
        first.start()
        assert first.proc is not None
        second = subprocess.run(  # the same command: the same --state-dir
            first.command, capture_output=True, text=True, env=env_for(runtime), timeout=60
        )
        assert second.returncode == 73
        used = f"a gateway (pid {first.proc.pid}) already uses {runtime / 'state'}"
        assert second.stderr.strip().splitlines() == [f"gpu-arbiter gateway: {used}"]
    finally:
        first.stop()
