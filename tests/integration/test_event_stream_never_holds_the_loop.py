"""An event stream never holds the controller's loop, and a failed commit never puts the
event sequence ahead of the events a stream can be sent.

A commit fails; the controller counts none of its events, so a stream opened from before
it waits (it does not spin), ``/healthz`` still answers, the next stored change reaches
the stream with no gap, and SIGTERM ends the server within its shutdown budget while the
stream is open. (A controller that says it has events it cannot return, the mismatch
that once made streams spin, is provoked in ``tests/server/test_event_feed.py``.) The
server is a real process whose SQLite store fails every commit while the file
``fail-commit`` exists in its state directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import SRC, Server, wait_for

LAUNCHER = """
import sys
from pathlib import Path

from gpu_arbiter.store import SqliteStore, StoreError

flag = Path(sys.argv[sys.argv.index("--state-dir") + 1]) / "fail-commit"
commit = SqliteStore.commit


def failing_commit(self, batch):
    if flag.exists():
        raise StoreError("injected: the disk is full")
    commit(self, batch)


SqliteStore.commit = failing_commit
from gpu_arbiter.cli import main

sys.argv[0] = "gpu-arbiter"
main()
"""

SHUTDOWN_BUDGET_S = 10.0  # uvicorn's graceful 3 s, the lifespan's close, and slack for load


class FailingServer(Server):
    """``gpu-arbiter serve`` with a store whose commits fail on demand."""

    def start(self, timeout_s: float = 30.0, *, ready: bool = True) -> FailingServer:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        env.pop("GPU_ARBITER_CONFIG", None)
        command = [sys.executable, "-c", LAUNCHER, "serve", "--port", "0"]
        command += ["--state-dir", str(self.state_dir), *self.args]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=log, env=env)
        port = wait_for(self._port, timeout_s, "the server to listen")
        self.url = f"http://127.0.0.1:{port}"
        wait_for(lambda: self._answers("/readyz"), timeout_s, "ready")
        return self

    def fail_commits(self, fail: bool = True) -> None:
        flag = self.state_dir / "fail-commit"
        if fail:
            flag.touch()
        else:
            flag.unlink()


@pytest.fixture
def failing(tmp_path: Path) -> Iterator[FailingServer]:
    server = FailingServer(tmp_path / "state", "--simulate", "1x24G").start()
    yield server
    server.stop()


def follow(server: FailingServer, since: int, got: list[str], stop: threading.Event) -> None:
    with (
        server.client() as client,
        client.stream("GET", "/v1/events", params={"since": since}) as stream,
    ):
        for line in stream.iter_lines():
            got.append(line)
            if stop.is_set():
                return


def test_a_failed_commit_leaves_streams_waiting_not_spinning(failing: FailingServer) -> None:
    with failing.client() as admin:
        last = admin.get("/v1/status").json()["last_event"]
        failing.fail_commits()
        failed = admin.post("/v1/leases", json={"vram_mb": 1024, "holder": "lost"})
        assert failed.status_code == 503, failed.text
        assert admin.get("/v1/status").json()["last_event"] == last  # nothing counted
    got: list[str] = []
    stop = threading.Event()
    reader = threading.Thread(target=follow, args=(failing, last, got, stop), daemon=True)
    reader.start()
    wait_for(lambda: got, 10, "the stream to open")
    for _ in range(5):  # the stream is open and the server answers at once
        assert httpx.get(failing.url + "/healthz", timeout=2).status_code == 200
    assert reader.is_alive()
    failing.fail_commits(False)
    with failing.client() as admin:
        stored = admin.post("/v1/leases", json={"vram_mb": 1024, "holder": "kept"})
        assert stored.status_code == 201, stored.text
    wait_for(lambda: "event: lease.granted" in got, 10, "the next change to reach the stream")
    assert f"id: {last + 1}" in got  # the sequence went on where the store left it
    assert "event: stream.gap" not in got
    stop.set()
    assert failing.proc is not None
    began = time.monotonic()
    failing.proc.send_signal(signal.SIGTERM)
    failing.proc.wait(timeout=SHUTDOWN_BUDGET_S)  # raises if it ignored SIGTERM
    assert time.monotonic() - began < SHUTDOWN_BUDGET_S
    reader.join(timeout=10)
    assert not reader.is_alive()  # the stream ended with the server
