"""The operator commands against a real controller: output, exit status, ``-o json``."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from .conftest import SRC, Server, register

OPERATOR_COMMANDS = [
    "status",
    "queue",
    "leases",
    "events",
    "drain",
    "cancel-drain",
    "update",
    "operation",
    "remove",
    "pause",
    "resume",
    "release",
]


def cli(
    server: Server | None, *args: str, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    env.pop("GPU_ARBITER_CONFIG", None)
    env["GPU_ARBITER_URL"] = server.url if server else "http://127.0.0.1:1"
    env["GPU_ARBITER_TOKEN"] = (
        token if token is not None else (server.admin_token if server else "x")
    )
    command = [sys.executable, "-m", "gpu_arbiter", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def ok(server: Server, *args: str) -> str:
    done = cli(server, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def ok_json(server: Server, *args: str) -> Any:
    return json.loads(ok(server, *args, "-o", "json"))


def ask(admin: httpx.Client, vram: str, holder: str = "alice") -> dict[str, Any]:
    answer = admin.post("/v1/leases", json={"vram_mb": vram, "holder": holder, "ttl_s": 300})
    assert answer.status_code in (201, 202), answer.text
    lease: dict[str, Any] = answer.json()
    return lease


def test_status_queue_and_leases_show_what_the_api_says(
    server: Server, admin: httpx.Client
) -> None:
    held = [ask(admin, "20G"), ask(admin, "20G")]
    waiting = ask(admin, "20G", holder="bob")
    assert [lease["state"] for lease in held] != ["pending", "pending"]
    assert waiting["state"] == "pending"

    text = ok(server, "status")
    assert "local" in text and "local:0" in text and "local:1" in text
    assert "committed 20.0 GiB" in text and "free 4.0 GiB / 24.0 GiB" in text
    assert "total: 1 workers, 2 GPUs; committed 40.0 GiB" in text
    assert "pending: 1" in text
    both = ok_json(server, "status")
    assert both["workers"] == admin.get("/v1/workers").json()
    api_status = admin.get("/v1/status").json()
    for key in ("pending", "paused", "leases_by_state", "workers_by_state", "gpus"):
        assert both["status"][key] == api_status[key]

    text = ok(server, "queue")
    assert waiting["id"] in text and "bob" in text and "0/2 GPUs fit" in text
    assert "insufficient_vram" not in text.split("0/2 GPUs fit", 1)[0]
    verbose = ok(server, "queue", "-v")
    assert "local:0" in verbose and "insufficient_vram: need 20.0 GiB" in verbose
    assert ok_json(server, "queue") == admin.get("/v1/queue").json()

    text = ok(server, "leases")
    for lease in [*held, waiting]:
        assert lease["id"] in text
    listed = ok_json(server, "leases", "--state", "pending")
    assert listed == admin.get("/v1/leases", params={"state": "pending"}).json()
    assert [lease["id"] for lease in listed] == [waiting["id"]]
    by_holder = ok_json(server, "leases", "--holder", "alice", "--worker", "local")
    assert {lease["id"] for lease in by_holder} == {lease["id"] for lease in held}
    assert ok(server, "leases", "--holder", "nobody").strip() == "no leases"


def test_actions_change_the_state_seen_through_the_api(server: Server, admin: httpx.Client) -> None:
    assert ok(server, "pause").strip() == "paused: nothing is granted until resume"
    assert admin.get("/v1/status").json()["paused"] is True
    assert (
        ok(server, "status")
        .rstrip()
        .endswith("paused: nothing is granted until `gpu-arbiter resume`")
    )
    assert ok_json(server, "resume") == {"paused": False}
    assert admin.get("/v1/status").json()["paused"] is False

    lease = ask(admin, "8G")
    answer = ok_json(server, "drain", "local", "--deadline", "10m")
    assert answer["worker"] == "local" and answer["previous_state"] == "online"
    assert admin.get("/v1/workers/local").json()["state"] == answer["state"] == "draining"
    assert admin.get("/v1/workers/local").json()["drain_deadline"] is not None
    text = ok(server, "cancel-drain", "local")
    assert text.startswith("cancel-drain local: draining -> online;")
    assert admin.get("/v1/workers/local").json()["state"] == "online"

    text = ok(server, "release", lease["id"])
    assert text.startswith(f"release {lease['id']}: released")
    assert admin.get(f"/v1/leases/{lease['id']}").json()["state"] == "released"

    text = ok(server, "drain", "local", "--force")
    assert "online -> drained; revoked 0" in text
    answer = ok_json(server, "remove", "local")
    assert answer["worker"] == "local"
    assert admin.get("/v1/workers/local").status_code == 404


def test_an_update_is_followed_step_by_step_until_it_ends(
    start_server: Callable[..., Server],
) -> None:
    # box-1 has no agent: registered once, it never heartbeats. The default heartbeat
    # timeout (15 s) would send it offline mid-test on a loaded machine (a dozen CLI
    # processes take longer there), so the server's outlasts the test.
    server = start_server("--simulate", "2x24G:sm_86", "--heartbeat-timeout-s", "3600")
    with server.client() as admin:
        _follow_an_update(server, admin)


def _follow_an_update(server: Server, admin: httpx.Client) -> None:
    register(admin, "box-1")  # no agent: the update waits for its command
    started = ok_json(server, "update", "box-1", "--timeout", "1h", "--drain-deadline", "10m")
    assert (started["worker"], started["state"]) == ("box-1", "running")
    assert started["deadline"] - started["created_at"] == 3600.0
    assert "deadline 600 s" in started["steps"][0]["detail"]
    text = ok(server, "operation", started["id"])
    assert f"update of box-1, operation {started['id']}: running" in text
    assert "drain" in text and "started" in text
    (box,) = [w for w in ok_json(server, "status")["workers"] if w["name"] == "box-1"]
    assert box["update"] == {
        "operation": started["id"],
        "waiting_on": "update_command",  # drained at once: no lease there
        "deadline": started["deadline"],
    }
    assert f"updating: {started['id']} waits on update_command" in ok(server, "status")

    ok(server, "cancel-drain", "box-1")  # its command has not run: the update ends
    waited = cli(server, "operation", started["id"], "--wait", "-o", "json")
    assert waited.returncode == 1  # it failed
    cancelled = json.loads(waited.stdout)
    assert cancelled == admin.get(f"/v1/operations/{started['id']}").json()
    assert cancelled["reason"] == "update_command failed: cancelled by cancel-drain"
    assert admin.get("/v1/workers/box-1").json()["state"] == "online"
    assert admin.get("/v1/workers/box-1").json()["update"] is None

    timed_out = cli(server, "update", "box-1", "--timeout", "1s", "--wait")
    assert timed_out.returncode == 1
    assert ": failed: update_command failed: the update command was not run to its end " in (
        timed_out.stdout.replace("\n", "")
    )
    assert admin.get("/v1/workers/box-1").json()["state"] == "drained"  # it stays drained


def test_events_follows_the_stream(server: Server, admin: httpx.Client) -> None:
    since = admin.get("/v1/status").json()["last_event"]
    lease = ask(admin, "4G")
    follow = ["events", "--since", str(since), "--lease", lease["id"], "--count", "1"]
    event = json.loads(ok(server, *follow, "-o", "json"))
    assert event["lease_id"] == lease["id"] and event["seq"] > since
    line = ok(server, *follow).strip()
    assert f"#{event['seq']} {event['kind']} lease={lease['id']}" in line
    assert len(line.splitlines()) == 1


def test_events_stops_cleanly_on_ctrl_c(server: Server) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "GPU_ARBITER_URL": server.url}
    env["GPU_ARBITER_TOKEN"] = server.admin_token
    command = [sys.executable, "-m", "gpu_arbiter", "events", "--since", "0"]
    follower = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert follower.stdout is not None
        assert b"worker.registered" in follower.stdout.readline()  # it is following
        follower.send_signal(signal.SIGINT)
        _out, err = follower.communicate(timeout=20)
    finally:
        follower.kill()
    assert follower.returncode == 130 and err == b"", err


def test_errors_are_one_line_with_an_exit_code(server: Server) -> None:
    refused = cli(server, "status", token="not-a-token")
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: 401 ") and len(refused.stderr.splitlines()) == 1
    simulated = cli(server, "update", "local")  # no agent runs the update command
    assert simulated.returncode == 1 and simulated.stderr.startswith("error: 409 conflict: ")
    missing = cli(server, "cancel-drain", "nowhere")
    assert missing.returncode == 1 and missing.stderr.startswith("error: 404 ")
    client_token = server.token("client")
    forbidden = cli(server, "pause", token=client_token)
    assert forbidden.returncode == 1 and forbidden.stderr.startswith("error: 403 ")

    nobody = cli(None, "queue")
    assert nobody.returncode == 69
    assert len(nobody.stderr.splitlines()) == 1 and "gpu-arbiter serve --local" in nobody.stderr

    bad = cli(server, "drain", "local", "--deadline", "soon")
    assert bad.returncode == 2 and "not a duration" in bad.stderr
    bad = cli(server, "update", "local", "--timeout", "soon")
    assert bad.returncode == 2 and "not a duration" in bad.stderr
    zero = cli(server, "update", "local", "--timeout", "0s")
    assert zero.returncode == 1 and "timeout_s" in zero.stderr
    unknown = cli(server, "operation", "op-nothing")
    assert unknown.returncode == 1 and unknown.stderr.startswith("error: 404 ")


@pytest.mark.parametrize("command", OPERATOR_COMMANDS)
def test_help(command: str) -> None:
    done = cli(None, command, "--help")
    assert done.returncode == 0 and "--controller" in done.stdout and "--output" in done.stdout


# ---------------------------------------------------------------- top


def test_top_once_shows_gpus_leases_and_the_queue_with_reasons(
    server: Server, admin: httpx.Client
) -> None:
    held = [ask(admin, "20G"), ask(admin, "20G")]
    waiting = ask(admin, "20G", holder="bob")
    assert waiting["state"] == "pending"
    text = ok(server, "top", "--once")
    assert "local:0" in text and "local:1" in text and "committed 20.0 GiB" in text
    for lease in held:
        assert lease["id"] in text
    queued = next(line for line in text.splitlines() if waiting["id"] in line)
    assert "bob" in queued and "0/2 GPUs fit: 2 insufficient_vram" in queued
    assert "lease.requested" in text  # the latest events
    assert "\x1b[" not in text  # not a terminal: no screen control


class Terminal:
    """``gpu-arbiter top`` in a real pseudo-terminal of 200x60."""

    def __init__(self, server: Server, *args: str) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 200, 0, 0))
        env = {**os.environ, "PYTHONPATH": str(SRC), "GPU_ARBITER_URL": server.url}
        env.update(GPU_ARBITER_TOKEN=server.admin_token, TERM="xterm-256color")
        for name in ("COLUMNS", "LINES", "GPU_ARBITER_CONFIG"):
            env.pop(name, None)
        command = [sys.executable, "-m", "gpu_arbiter", "top", *args]
        self.proc = subprocess.Popen(
            command, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
        os.close(slave)
        self.screen = b""

    def read_until(self, text: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text.encode() not in self.screen:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} never appeared; the screen so far: {self.screen[-2000:]!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    self.screen += os.read(self.master, 65536)
                except OSError:  # the process closed the terminal
                    assert self.proc.poll() is not None
                    raise AssertionError(f"top exited: {self.screen[-2000:]!r}") from None

    def finish(self) -> int:
        code = self.proc.wait(timeout=20)
        with contextlib.suppress(OSError):
            while select.select([self.master], [], [], 0.5)[0]:
                chunk = os.read(self.master, 65536)
                if not chunk:
                    break
                self.screen += chunk
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=20)
        os.close(self.master)


def test_top_redraws_when_a_lease_is_created_and_stops_on_ctrl_c(
    server: Server, admin: httpx.Client
) -> None:
    terminal = Terminal(server, "--interval", "600")  # only events can redraw it in time
    try:
        terminal.read_until("local:1")
        terminal.read_until("live")
        assert b"\x1b[?1049h" in terminal.screen  # the alternate (full) screen
        lease = ask(admin, "8G")
        terminal.read_until(lease["id"])
        terminal.read_until("committed 8.0 GiB")
        terminal.proc.send_signal(signal.SIGINT)
        assert terminal.finish() == 130
        assert b"\x1b[?1049l" in terminal.screen  # the terminal was given back
    finally:
        terminal.close()


def test_top_quits_on_q(server: Server) -> None:
    terminal = Terminal(server, "--interval", "600")
    try:
        terminal.read_until("local:0")
        os.write(terminal.master, b"q")
        assert terminal.finish() == 0
    finally:
        terminal.close()
