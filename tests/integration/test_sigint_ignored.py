"""Started with SIGINT ignored (a launcher that ignores it, a shell's background job: SIG_IGN
is inherited across exec), the commands still stop on SIGINT, and so do the children they
start: ``run`` forwards SIGINT to its command, which must not have inherited SIG_IGN."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from gpu_arbiter.gateway.servers.interfaces import log_path

from .agents import RunProcess, lease_of
from .conftest import SRC, Server, wait_for


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _sigint_disposition(pid: int) -> bool:
    """Whether ``pid`` ignores SIGINT, read from /proc (SigIgn is a mask, bit 1 is SIGINT)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    raise AssertionError(f"no SigIgn line for pid {pid}")


def test_logs_follow_stops_on_sigint_though_started_with_it_ignored(tmp_path: Path) -> None:
    path = log_path(tmp_path, "chat")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("line 1\n")
    command = [sys.executable, "-m", "gpu_arbiter", "logs", "chat", "--state-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    with subprocess.Popen(
        [*command, "--follow"], stdout=subprocess.PIPE, env=env, preexec_fn=_ignore_sigint
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"line 1\n"  # it follows: its handlers are set
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 130
        finally:
            if proc.poll() is None:
                proc.kill()


def test_runs_command_does_not_inherit_an_ignored_sigint(
    server: Server, admin: httpx.Client, tmp_path: Path
) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir()
    run = RunProcess(server.url, server.admin_token, runtime, "sleeper", mb=0)
    run.start(preexec_fn=_ignore_sigint)
    assert run.proc is not None
    try:
        child = run.wait_child()
        assert _sigint_disposition(run.proc.pid) is False
        assert _sigint_disposition(child["pid"]) is False
        run.proc.send_signal(signal.SIGINT)  # forwarded to the command's group
        assert run.wait() == 128 + signal.SIGINT, run.stderr
        wait_for(
            lambda: (lease_of(admin, "sleeper") or {}).get("state") == "released",
            what="the lease released",
        )
    finally:
        run.kill()
