"""The command ``gpu-arbiter run`` starts (``cli/run.py`` :class:`Child`): a real process
in a group of its own whose exit the event loop sees through a pidfd, or by polling where
there is none; an exit at once is never lost, and the status is the command's."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from gpu_arbiter.cli.run import Child

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polled"])
async def test_an_exit_at_once_and_its_status_are_seen(
    pidfd: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    for _ in range(20):  # a command that exits before its watch begins, many times
        assert await asyncio.wait_for(Child.start(["true"], dict(os.environ)).wait(), 30) == 0
    failing = Child.start([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ))
    assert await asyncio.wait_for(failing.wait(), 30) == 3
    assert failing.returncode == 3


async def test_a_signal_is_a_negative_status_and_the_group_is_its_own() -> None:
    child = Child.start(["sleep", "30"], dict(os.environ))
    assert os.getpgid(child.pid) == child.pid  # its own group: run signals the group
    os.killpg(child.pid, signal.SIGTERM)
    assert await asyncio.wait_for(child.wait(), 30) == -signal.SIGTERM


async def test_a_command_that_cannot_start_raises_as_exec_does() -> None:
    with pytest.raises(FileNotFoundError):
        Child.start(["/nonexistent/command"], dict(os.environ))
