"""The supervisor stops real processes: SIGTERM to the group, SIGKILL after the grace."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

from gpu_arbiter.agent.supervisor import ProcessSupervisor, process_alive

IGNORES_TERM = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
OBEYS_TERM = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"
WITH_GRANDCHILD = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def start(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # wait until it runs its own code (signal handlers set)
    proc.stdout.close()
    return proc


async def test_process_that_obeys_sigterm_stops_without_sigkill() -> None:
    proc = start(OBEYS_TERM)
    supervisor = ProcessSupervisor(poll_s=0.02)
    entry = supervisor.watch("lease-1", proc.pid)
    task = supervisor.stop("lease-1", grace_s=5.0)
    assert task is not None
    await task
    assert entry.stopped and not entry.killed
    assert entry.returncode == -signal.SIGTERM
    proc.wait(timeout=5)  # already reaped by the supervisor


async def test_process_that_ignores_sigterm_is_killed_after_grace() -> None:
    proc = start(IGNORES_TERM)
    supervisor = ProcessSupervisor(poll_s=0.02)
    entry = supervisor.watch("lease-1", proc.pid)
    task = supervisor.stop("lease-1", grace_s=0.3)
    assert task is not None
    await task
    assert entry.stopped and entry.killed
    assert entry.returncode == -signal.SIGKILL
    proc.wait(timeout=5)


async def test_whole_process_group_is_stopped() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WITH_GRANDCHILD],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    proc.stdout.close()
    supervisor = ProcessSupervisor(poll_s=0.02)
    supervisor.watch("lease-1", proc.pid)
    task = supervisor.stop("lease-1", grace_s=2.0)
    assert task is not None
    await task
    proc.wait(timeout=5)
    for _ in range(200):  # the grandchild is not our child: wait for init to reap it
        if not process_alive(grandchild):
            break
        await asyncio.sleep(0.02)
    assert not process_alive(grandchild)


async def test_refresh_reports_an_exit_once() -> None:
    proc = start(OBEYS_TERM)
    supervisor = ProcessSupervisor()
    supervisor.watch("lease-1", proc.pid)
    assert supervisor.refresh() == []
    proc.kill()
    proc.wait(timeout=5)
    stopped = supervisor.refresh()
    assert [entry.lease_id for entry in stopped] == ["lease-1"]
    assert supervisor.refresh() == []


def test_stop_of_unknown_lease_is_none() -> None:
    assert ProcessSupervisor().stop("nope", 1.0) is None


async def test_a_child_of_this_process_is_seen_exited_but_left_to_its_starter() -> None:
    """In ``serve --local`` the gateway's servers are children of the agent's process:
    the supervisor must not reap them, or their starter loses the exit code."""
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    supervisor = ProcessSupervisor()
    entry = supervisor.watch("L1", proc.pid, proc.pid)
    for _ in range(200):
        if supervisor.refresh():
            break
        await asyncio.sleep(0.05)
    assert entry.stopped and entry.returncode == 3
    assert proc.wait(timeout=10) == 3  # still there for its starter to reap
