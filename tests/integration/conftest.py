"""A real controller process on a free loopback port, and HTTP clients for it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
_LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
TEST_MARK = "GPU_ARBITER_TEST_MARK"


@pytest.fixture(autouse=True)
def _nothing_left_running(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every process a test starts (servers, agents, gateways, and what they start in
    turn: model servers, watchdogs) inherits a mark in its environment; whatever carries
    it at the end of the test is SIGKILLed with its whole group, so that no test leaves
    a process running (one that ignores SIGTERM, say)."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(TEST_MARK, mark)
    yield
    kill_marked(mark)


def kill_marked(mark: str) -> None:
    needle = f"{TEST_MARK}={mark}".encode()
    own_group = os.getpgrp()
    with os.scandir("/proc") as entries:
        pids = [int(e.name) for e in entries if e.name.isdigit() and int(e.name) != os.getpid()]
    for pid in pids:
        try:
            marked = needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            group = os.getpgid(pid)
        except OSError:
            continue  # gone, or not ours to read
        if marked:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if group == own_group:
                    os.kill(pid, signal.SIGKILL)  # started without a group of its own
                else:
                    os.killpg(group, signal.SIGKILL)


def wait_for(predicate: Callable[[], Any], timeout_s: float = 20.0, what: str = "") -> Any:
    """Polls ``predicate`` until it returns something truthy; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)


def burst_while_stopped(pid: int, url: str, count: int = 200, files: int = 128) -> list[bytes]:
    """``count`` connections to ``url`` made while process ``pid`` is stopped (SIGSTOP,
    as a loop busy elsewhere: each waits in the listen queue to be accepted) under a limit
    of ``files`` open files; the status line each one got before it was closed (b""
    for none)."""
    return [status for status, _ in burst_answers(pid, url, count, files)]


def burst_answers(
    pid: int, url: str, count: int = 200, files: int = 128, request: bytes = b""
) -> list[tuple[bytes, bool]]:
    """As :func:`burst_while_stopped`, each connection sending ``request`` as it is
    made (its bytes wait unread in the stopped process's socket): the status line each
    one got, and whether it ended in a reset rather than a close."""
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (files, files))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        opened = [socket.create_connection((host, int(port)), timeout=30) for _ in range(count)]
        for sock in opened:
            sock.sendall(request)
    finally:
        os.kill(pid, signal.SIGCONT)
    answers = []
    try:
        for sock in opened:
            received, reset = b"", False
            try:
                while chunk := sock.recv(65536):
                    received += chunk
            except ConnectionResetError:
                reset = True
            answers.append((received[:13], reset))
    finally:
        for sock in opened:
            sock.close()
    return answers


class ManagedProcess:
    """A child process a test started: SIGKILL it, or stop it (SIGTERM, then SIGKILL)."""

    proc: subprocess.Popen[bytes] | None = None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def end(self) -> None:
        """SIGKILL it if it still runs, and reap it (a Popen dropped unreaped warns)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)


class Server(ManagedProcess):
    def __init__(self, state_dir: Path, *args: str) -> None:
        self.state_dir = state_dir
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.log = state_dir / "server.log"
        self._log_from = 0

    def start(self, timeout_s: float = 30.0, *, ready: bool = True) -> Server:
        """Starts the process and waits until it listens and, with ``ready``, until it
        accepts changes (a standby never does: it waits for ``/healthz`` then)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        env.pop("GPU_ARBITER_CONFIG", None)
        command = [sys.executable, "-m", "gpu_arbiter", "serve", "--port", "0"]
        command += ["--state-dir", str(self.state_dir), *self.args]
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=log, env=env)
        try:
            port = wait_for(self._port, timeout_s, "the server to listen")
            self.url = f"http://127.0.0.1:{port}"
            wait_for(lambda: self._answers("/readyz" if ready else "/healthz"), timeout_s, "ready")
        except BaseException:
            self.end()  # a start that failed leaves no process running, nor one unreaped
            raise
        return self

    def _port(self) -> str | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited: {self.log.read_text()}")
        found = _LISTENING.findall(self.log.read_bytes()[self._log_from :].decode())
        return found[-1] if found else None

    def _answers(self, path: str) -> bool:
        try:
            return httpx.get(self.url + path, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def admin_token(self) -> str:
        return (self.state_dir / "admin.token").read_text().strip()

    def client(self, token: str | None = "admin", **kwargs: Any) -> httpx.Client:
        headers = {}
        if token == "admin":
            token = self.admin_token
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, **kwargs)

    def async_client(self, token: str | None = "admin", **kwargs: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.admin_token if token == 'admin' else token}"}
        kwargs.setdefault("timeout", 60)
        return httpx.AsyncClient(base_url=self.url, headers=headers, **kwargs)

    def token(self, role: str, worker: str | None = None) -> str:
        command = [sys.executable, "-m", "gpu_arbiter", "token", "create", "--role", role]
        command += ["--state-dir", str(self.state_dir)]
        if "--store" in self.args:  # a shared database: the token goes there
            command += ["--store", self.args[self.args.index("--store") + 1]]
        if worker is not None:
            command += ["--worker", worker]
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(*args: str, state_dir: Path | None = None) -> Server:
        server = Server(state_dir or tmp_path / f"state-{len(started)}", *args)
        started.append(server)  # stopped at the end even if its start fails
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def server(start_server: Callable[..., Server]) -> Server:
    """A controller with one simulated worker ``local`` of two 24 GiB GPUs."""
    return start_server("--simulate", "2x24G:sm_86")


@pytest.fixture
def admin(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def gpu_figures(client: httpx.Client) -> dict[str, dict[str, Any]]:
    answer = client.get("/v1/workers")
    assert answer.status_code == 200
    return {gpu["id"]: gpu for worker in answer.json() for gpu in worker["gpus"]}


def register(client: httpx.Client, name: str, gpus: int = 2, total_mb: int = 24576) -> None:
    body = {
        "name": name,
        "gpus": [
            {"index": i, "total_mb": total_mb, "arch": "sm_86", "headroom_mb": 0}
            for i in range(gpus)
        ],
    }
    answer = client.post("/v1/workers", json=body)
    assert answer.status_code in (200, 201), answer.text


def events(client: httpx.Client, kind: str | None = None) -> list[dict[str, Any]]:
    """Every retained event so far, read from the SSE stream up to the current last one."""
    last = client.get("/v1/status").json()["last_event"]
    found: list[dict[str, Any]] = []
    if last > 0:
        with client.stream("GET", "/v1/events", params={"since": 0}, timeout=30) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                found.append(event)
                if event["seq"] >= last:
                    break
    return [e for e in found if kind is None or e["kind"] == kind]


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    """Agents, ``run`` wrappers and clients a test started, ended last first when it ends:
    a wrapper killed, an agent stopped, a client closed."""
    from .agents import AgentProcess, RunProcess

    started: list[Any] = []
    yield started
    for item in reversed(started):
        if isinstance(item, RunProcess):
            item.kill()
        elif isinstance(item, AgentProcess):
            item.stop()
        else:
            item.close()
