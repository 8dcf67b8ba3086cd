"""Supervision of the processes that hold leases on this host.

The supervisor knows, for each lease, the process group of the process that
uses it. On revocation it sends SIGTERM to the group, waits ``grace_s``, then
sends SIGKILL, and reports the lease's process as stopped only once the
process has really exited (I4: memory is freed only when it is free).

Each process gets each signal once: a second SIGTERM is "quit now" to many
programs (they would lose the checkpoint they are writing). A stop already
under way is never started again, whoever asks (the controller's revocation
in a heartbeat answer, or ``gpu-arbiter run`` through the local endpoint).

Liveness is checked with ``waitid(WNOWAIT)`` for children of this process (never
reaping them: whoever started one learns its exit code), and ``/proc/<pid>`` for
others, so the supervisor also watches processes that another program
(``gpu-arbiter run``) started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["ProcessSupervisor", "Supervised", "process_alive"]

log = logging.getLogger("gpu_arbiter.agent.supervisor")


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a child of ours is not reaped here)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@dataclass(slots=True)
class Supervised:
    lease_id: str
    pid: int
    pgid: int
    stopping: bool = False
    stopped: bool = False
    killed: bool = False
    returncode: int | None = None  # known when the process was our child
    attached_at: float = field(default_factory=time.monotonic)
    on_stop: list[Callable[[Supervised], None]] = field(default_factory=list)


class ProcessSupervisor:
    """Watches lease processes; stops them on revocation (SIGTERM, then SIGKILL)."""

    def __init__(self, poll_s: float = 0.1) -> None:
        self._poll_s = poll_s
        self._watched: dict[str, Supervised] = {}
        self._stops: dict[str, asyncio.Task[None]] = {}

    def watch(self, lease_id: str, pid: int, pgid: int | None = None) -> Supervised:
        if pgid is None:
            try:
                pgid = os.getpgid(pid)
            except ProcessLookupError:
                pgid = pid
        entry = self._watched.get(lease_id)
        if entry is None or entry.pid != pid:
            entry = self._watched[lease_id] = Supervised(lease_id, pid, pgid)
        return entry

    def forget(self, lease_id: str) -> None:
        self._watched.pop(lease_id, None)
        task = self._stops.pop(lease_id, None)
        if task is not None:
            task.cancel()

    def get(self, lease_id: str) -> Supervised | None:
        return self._watched.get(lease_id)

    def leases(self) -> list[Supervised]:
        return list(self._watched.values())

    def refresh(self) -> list[Supervised]:
        """Marks processes that exited; returns those newly stopped."""
        newly = []
        for entry in self._watched.values():
            if not entry.stopped and not self._alive(entry):
                entry.stopped = True
                newly.append(entry)
        return newly

    def stop(self, lease_id: str, grace_s: float) -> asyncio.Task[None] | None:
        """Starts stopping a lease's process group (idempotent); None if not supervised."""
        entry = self._watched.get(lease_id)
        if entry is None:
            return None
        task = self._stops.get(lease_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._stop(entry, grace_s))
            self._stops[lease_id] = task
        return task

    async def close(self) -> None:
        tasks = list(self._stops.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _stop(self, entry: Supervised, grace_s: float) -> None:
        entry.stopping = True
        self._signal(entry, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._alive(entry) and loop.time() < deadline:
            await asyncio.sleep(self._poll_s)
        if self._alive(entry):
            log.warning(
                "lease %s: pid %d ignored SIGTERM for %.1fs; killing its group",
                entry.lease_id,
                entry.pid,
                grace_s,
            )
            entry.killed = True
            self._signal(entry, signal.SIGKILL)
            while self._alive(entry):
                await asyncio.sleep(self._poll_s)
        entry.stopped = True

    @staticmethod
    def _alive(entry: Supervised) -> bool:
        """For a child of this process, its exit status is read without reaping it
        (``WNOWAIT``): whoever started it (the gateway's launcher, in ``serve --local``)
        reaps it and learns its real exit code; any other process is looked up."""
        try:
            found = os.waitid(os.P_PID, entry.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return process_alive(entry.pid)
        if found is None:
            return True
        exited = found.si_code == os.CLD_EXITED
        entry.returncode = found.si_status if exited else -found.si_status
        return False

    @staticmethod
    def _signal(entry: Supervised, signum: int) -> None:
        """Sends ``signum`` once to each process of the lease: to its group, and to the
        process itself only when it is not in that group (or the group is our own)."""
        if entry.pgid != os.getpgrp():  # never signal our own group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(entry.pgid, signum)
                if _pgid(entry.pid) == entry.pgid:
                    return  # the group signal reached it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(entry.pid, signum)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None
