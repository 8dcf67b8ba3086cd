"""The launcher and the watchdog with real child processes and real signals: groups
stopped (SIGTERM, SIGKILL after the grace), the watchdog stopping them when the gateway
is killed, reused pids never signalled, leftovers of a previous run found, bounded
logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gpu_arbiter.gateway.servers import process as process_module
from gpu_arbiter.gateway.servers import watchdog
from gpu_arbiter.gateway.servers.interfaces import log_path
from gpu_arbiter.gateway.servers.process import GatewayRefused, ModelLog, ProcessLauncher

pytestmark = pytest.mark.timeout(90)

SRC = Path(__file__).resolve().parents[2] / "src"

SERVER = """
import argparse, json, os, signal, subprocess, sys, time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("info")
parser.add_argument("--ignore-term", action="store_true")
parser.add_argument("--lines", type=int, default=0)
parser.add_argument("--line-bytes", type=int, default=20)
parser.add_argument("--exit", type=int, default=None)
parser.add_argument("--child", action="store_true")
args = parser.parse_args()
info = Path(args.info)

def on_term(signum, frame):
    with info.with_suffix(".terms").open("a") as terms:
        terms.write("TERM\\n")
    if not args.ignore_term:
        sys.exit(143)

signal.signal(signal.SIGTERM, on_term)
for i in range(args.lines):
    print(f"line {i:07d} " + "x" * max(0, args.line_bytes - 13), flush=i % 64 == 0)
sys.stdout.flush()
found = {"pid": os.getpid(), "pgid": os.getpgid(0), "stdin": os.readlink("/proc/self/fd/0")}
found["fds"] = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
if args.child:  # stays in the group, ignoring SIGTERM
    child = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
         "signal.SIG_IGN); time.sleep(3600)"])
    found["child"] = child.pid
info.with_suffix(".tmp").write_text(json.dumps(found))
os.replace(info.with_suffix(".tmp"), info)
if args.exit is not None:
    sys.exit(args.exit)
while True:
    time.sleep(1)
"""

GATEWAY = """
import asyncio, json, os, sys
from pathlib import Path
from gpu_arbiter.gateway.servers.process import ProcessLauncher

async def main() -> None:
    state, out, command = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    launcher = ProcessLauncher(state)
    await launcher.stop_leftovers()
    server = await launcher.start("m", command, dict(os.environ), lease_id="L1", grace_s=0.5)
    out.write_text(json.dumps({"server": server.pid, "watchdog": launcher.watchdog_pid}))
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def wait_until(predicate: Any, timeout_s: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(0.02)
    return value


def alive(pid: int) -> bool:
    fields = watchdog._stat(pid)
    return fields is not None and fields[0] != "Z"


class Child:
    """The server script's files: its info (pid, group, stdin, fds) and SIGTERMs."""

    def __init__(self, directory: Path, name: str) -> None:
        self.info_path = directory / f"{name}.json"
        self.script = directory / "server.py"
        if not self.script.exists():
            self.script.write_text(SERVER)

    def command(self, *flags: str) -> list[str]:
        return [sys.executable, str(self.script), str(self.info_path), *flags]

    def info(self, timeout_s: float = 30.0) -> dict[str, Any]:
        def read() -> dict[str, Any] | None:
            try:
                found: dict[str, Any] = json.loads(self.info_path.read_text())
            except (OSError, ValueError):
                return None
            return found

        found: dict[str, Any] = wait_until(read, timeout_s, f"{self.info_path.name}")
        return found

    @property
    def terms(self) -> int:
        try:
            return len(self.info_path.with_suffix(".terms").read_text().splitlines())
        except OSError:
            return 0


@pytest.fixture
async def launcher(tmp_path: Path) -> AsyncIterator[ProcessLauncher]:
    found = ProcessLauncher(tmp_path / "state")
    assert await found.stop_leftovers() == []
    yield found
    await found.close()


async def test_output_goes_to_the_models_log_and_tail_gives_its_last_lines(
    launcher: ProcessLauncher, tmp_path: Path
) -> None:
    child = Child(tmp_path, "a")
    server = await launcher.start(
        "chat", child.command("--lines", "10", "--exit", "3"), dict(os.environ),
        lease_id="L1", grace_s=1.0,
    )  # fmt: skip

    assert await server.wait() == 3
    assert [line.split()[:2] for line in server.tail(2)] == [
        ["line", "0000008"],
        ["line", "0000009"],
    ]
    text = log_path(tmp_path / "state", "chat").read_text().splitlines()
    assert f"] pid {server.pid} started (lease L1): " in text[0]
    assert [line.split()[1] for line in text[1:11]] == [f"{i:07d}" for i in range(10)]
    assert text[11].endswith(f"pid {server.pid} exited with code 3")
    info = child.info()
    assert info["stdin"] == "/dev/null"
    assert info["fds"] == [0, 1, 2, 3]  # 3: the listing itself; no pipe of the gateway's
    assert info["pgid"] == server.pid  # it leads its own group


async def test_a_server_ignoring_sigterm_gets_one_and_sigkill_after_its_grace(
    launcher: ProcessLauncher, tmp_path: Path
) -> None:
    child = Child(tmp_path, "stubborn")
    server = await launcher.start(
        "chat", child.command("--ignore-term"), dict(os.environ), lease_id="L1", grace_s=0.5
    )
    child.info()
    began = time.monotonic()

    assert await server.stop(0.5) == -signal.SIGKILL

    assert time.monotonic() - began >= 0.5 * 0.9
    assert child.terms == 1
    assert not alive(server.pid)
    assert launcher.servers() == []


async def test_close_stops_what_still_runs_one_sigterm_then_sigkill(
    tmp_path: Path,
) -> None:
    launcher = ProcessLauncher(tmp_path / "state")
    await launcher.stop_leftovers()
    child = Child(tmp_path, "left")
    server = await launcher.start(
        "chat", child.command("--ignore-term", "--child"), dict(os.environ),
        lease_id="L1", grace_s=0.3,
    )  # fmt: skip
    grandchild = child.info()["child"]
    watchdog_pid = launcher.watchdog_pid
    assert watchdog_pid is not None

    await launcher.close()

    assert child.terms == 1
    assert not alive(server.pid) and not alive(grandchild)
    assert not alive(watchdog_pid)  # nothing left to watch: it exited by itself
    state = json.loads((tmp_path / "state" / "gateway" / "servers.json").read_text())
    assert state["servers"] == []


async def test_what_is_left_of_the_group_when_the_leader_exits_is_killed(
    launcher: ProcessLauncher, tmp_path: Path
) -> None:
    child = Child(tmp_path, "parent")
    server = await launcher.start(
        "chat", child.command("--child", "--exit", "0"), dict(os.environ),
        lease_id="L1", grace_s=1.0,
    )  # fmt: skip

    assert await server.wait() == 0

    assert not alive(child.info()["child"])  # it ignored SIGTERM: the group was killed


async def test_a_program_that_cannot_start_raises_and_leaves_nothing(
    launcher: ProcessLauncher, tmp_path: Path
) -> None:
    opened: list[list[str]] = []
    for _ in range(2):  # the first opens the watchdog's pipe and the model's log
        with pytest.raises(FileNotFoundError):
            await launcher.start("chat", ["/nowhere/server"], {}, lease_id="L1", grace_s=1.0)
        opened.append(sorted(os.listdir("/proc/self/fd")))
    assert opened[0] == opened[1]  # no pipe left behind
    assert launcher.servers() == []


def _start_gateway(state: Path, out: Path, command: list[str]) -> subprocess.Popen[bytes]:
    script = out.with_name("gateway.py")
    script.write_text(GATEWAY)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.Popen(
        [sys.executable, str(script), str(state), str(out), *command], env=env, process_group=0
    )


@pytest.mark.parametrize("how", ["kill -9", "Ctrl-C at its terminal"])
def test_the_watchdog_stops_the_servers_when_the_gateway_dies(tmp_path: Path, how: str) -> None:
    child = Child(tmp_path, "orphan")
    out = tmp_path / "gateway.json"
    gateway = _start_gateway(tmp_path / "state", out, child.command("--ignore-term"))
    try:
        started = json.loads(wait_until(lambda: out.exists() and out.read_text(), what="start"))
        child.info()
        if how == "kill -9":
            gateway.kill()
        else:  # the terminal sends SIGINT to its foreground group: the gateway's
            os.killpg(gateway.pid, signal.SIGINT)
        gateway.wait(timeout=30)

        wait_until(lambda: not alive(started["server"]), what="the server to be stopped")
        wait_until(lambda: not alive(started["watchdog"]), what="the watchdog to exit")
        assert child.terms == 1  # SIGTERM once, SIGKILL after the grace
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()


def _victim(tmp_path: Path, name: str) -> tuple[Child, subprocess.Popen[bytes]]:
    child = Child(tmp_path, name)
    proc = subprocess.Popen(child.command(), process_group=0)
    child.info()
    return child, proc


def test_the_watchdog_never_signals_a_reused_pid_nor_an_ended_group(tmp_path: Path) -> None:
    reused, reused_proc = _victim(tmp_path, "reused")
    ended, ended_proc = _victim(tmp_path, "ended")
    try:
        started = watchdog.start_time(ended_proc.pid)
        lines = f"+ {reused_proc.pid} 12345 0.1\n+ {ended_proc.pid} {started} 0.1\n"
        lines += f"- {ended_proc.pid}\n"
        done = subprocess.run(
            [sys.executable, "-I", "-S", watchdog.__file__], input=lines.encode(), timeout=30
        )

        assert done.returncode == 0
        assert reused_proc.poll() is None and ended_proc.poll() is None
        assert reused.terms == 0 and ended.terms == 0
    finally:
        for proc in (reused_proc, ended_proc):
            proc.kill()
            proc.wait()


async def test_leftovers_of_the_previous_run_are_stopped_and_their_leases_returned(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    left, left_proc = _victim(tmp_path, "left")
    reused, reused_proc = _victim(tmp_path, "reused")
    other_boot, other_proc = _victim(tmp_path, "other-boot")
    (state / "gateway").mkdir(parents=True)

    def entry(model: str, lease: str, pid: int, start: int | None) -> dict[str, Any]:
        return {"model": model, "lease": lease, "pid": pid, "pgid": pid,
                "start_time": start, "grace_s": 0.5}  # fmt: skip

    previous = {
        "boot_id": watchdog.boot_id(),
        "servers": [
            entry("chat", "L1", left_proc.pid, watchdog.start_time(left_proc.pid)),
            entry("embed", "L2", reused_proc.pid, 12345),
        ],
    }
    (state / "gateway" / "servers.json").write_text(json.dumps(previous))
    try:
        launcher = ProcessLauncher(state)
        assert await launcher.stop_leftovers() == ["L1", "L2"]
        await launcher.close()

        assert left_proc.wait(timeout=30) == 143 and left.terms == 1
        assert reused_proc.poll() is None and reused.terms == 0
        found = json.loads((state / "gateway" / "servers.json").read_text())
        assert found["servers"] == []

        start = watchdog.start_time(other_proc.pid)
        elsewhere = {
            "boot_id": "another boot",
            "servers": [entry("x", "L3", other_proc.pid, start)],
        }
        (state / "gateway" / "servers.json").write_text(json.dumps(elsewhere))
        launcher = ProcessLauncher(state)
        assert await launcher.stop_leftovers() == ["L3"]
        await launcher.close()
        assert other_proc.poll() is None and other_boot.terms == 0
    finally:
        for proc in (left_proc, reused_proc, other_proc):
            proc.kill()
            proc.wait()


async def test_a_second_launcher_on_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    first = ProcessLauncher(tmp_path / "state")
    with pytest.raises(GatewayRefused) as refused:
        ProcessLauncher(tmp_path / "state")
    assert str(refused.value) == f"a gateway (pid {os.getpid()}) already uses {tmp_path / 'state'}"
    assert refused.value.exit_code == 73
    await first.stop_leftovers()
    await first.close()
    second = ProcessLauncher(tmp_path / "state")  # the lock went with the first
    await second.stop_leftovers()
    await second.close()


async def test_the_log_is_capped_and_rotated_in_whole_lines(tmp_path: Path) -> None:
    launcher = ProcessLauncher(tmp_path / "state", log_max_bytes=64 * 1024)
    await launcher.stop_leftovers()
    try:
        child = Child(tmp_path, "chatty")
        server = await launcher.start(
            "chat", child.command("--lines", "5000", "--line-bytes", "100", "--exit", "0"),
            dict(os.environ), lease_id="L1", grace_s=1.0,
        )  # fmt: skip
        assert await server.wait() == 0
    finally:
        await launcher.close()
    path = log_path(tmp_path / "state", "chat")
    rotated = path.with_name("chat.log.1")
    assert path.stat().st_size <= 64 * 1024 and rotated.stat().st_size <= 64 * 1024
    lines = rotated.read_text().splitlines() + path.read_text().splitlines()
    served = [line for line in lines if not line.startswith("[gpu-arbiter")]
    assert all(len(line) == 100 and line.startswith("line ") for line in served)
    numbers = [int(line.split()[1]) for line in served]
    assert numbers == list(range(numbers[0], 5000))  # the latest, in order, none cut


def test_a_write_larger_than_the_cap_keeps_its_last_whole_lines(tmp_path: Path) -> None:
    model_log = ModelLog(tmp_path / "chat.log", max_bytes=25)
    model_log.write(b"line one\n" + b"line two\nline three\n")  # 29 bytes: one read
    model_log.close()
    assert (tmp_path / "chat.log").read_bytes() == b"line two\nline three\n"


async def test_a_chatty_server_never_waits_while_the_event_loop_is_busy(
    launcher: ProcessLauncher, tmp_path: Path
) -> None:
    child = Child(tmp_path, "burst")
    command = child.command("--lines", "40000", "--line-bytes", "200", "--exit", "0")  # 8 MB
    server = await launcher.start("chat", command, dict(os.environ), lease_id="L1", grace_s=1.0)

    wait_until(child.info_path.exists, 60, "all its output written")  # the loop is held

    assert await server.wait() == 0
    assert server.tail(1)[0].startswith("line 0039999 ")


async def test_a_server_writing_line_by_line_is_read_in_batches_not_once_a_line(
    launcher: ProcessLauncher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's server writes a few lines per request, each on its own: the reader
    waits ``LOG_BATCH_S`` after a small read (it was woken for each line, taking the GIL
    from the relay as often). A bound of the mechanism, not of speed: each read but the
    last ones (the server exited: no more waiting) came after a wait of ``LOG_BATCH_S``."""
    reads: list[int] = []
    take = process_module._Output._take

    def counted(output: Any, chunk: bytes) -> None:
        reads.append(len(chunk))
        take(output, chunk)

    monkeypatch.setattr(process_module._Output, "_take", counted)
    lines = 60
    script = (
        "import time\n"
        f"for i in range({lines}):\n"
        "    print(f'line {i:07d}', flush=True)\n"
        "    time.sleep(0.01)\n"
    )
    began = time.monotonic()
    server = await launcher.start(
        "chat", [sys.executable, "-c", script], dict(os.environ), lease_id="L1", grace_s=1.0
    )
    assert await server.wait() == 0
    elapsed_s = time.monotonic() - began

    assert len(reads) <= elapsed_s / process_module.LOG_BATCH_S + 2, (reads, elapsed_s)
    assert len(reads) < lines / 2, reads  # once a line before
    assert server.tail(lines) == [f"line {i:07d}" for i in range(lines)]  # all of it, whole
    text = log_path(tmp_path / "state", "chat").read_text().splitlines()
    assert [line for line in text if line.startswith("line ")] == server.tail(lines)


async def test_a_reserved_port_is_not_handed_out_again_until_unreserved(
    launcher: ProcessLauncher, monkeypatch: pytest.MonkeyPatch
) -> None:
    offered = iter([5001, 5001, 5002, 5001])
    monkeypatch.setattr(process_module, "free_port", lambda: next(offered))
    first = launcher.port()
    assert (first, launcher.port()) == (5001, 5002)  # 5001 again: reserved, skipped
    launcher.unreserve(first)
    assert launcher.port() == 5001


async def test_a_gateway_that_stops_before_taking_over_keeps_the_last_runs_list(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state" / "gateway" / "servers.json"
    state.parent.mkdir(parents=True)
    entry = {"model": "chat", "lease": "L1", "pid": 1, "pgid": 1, "start_time": 1, "grace_s": 1}
    state.write_text(json.dumps({"boot_id": watchdog.boot_id(), "servers": [entry]}))
    launcher = ProcessLauncher(tmp_path / "state")

    await launcher.close()  # its start failed (it could not listen, say)

    assert json.loads(state.read_text())["servers"] == [entry]  # the next start finds it
