"""The gateway's watchdog: stops its model servers when the gateway dies, however it dies.

A model server runs in its own process group, so nothing the kernel does when the
gateway dies (``kill -9``, an OOM kill, a crash) reaches it. One watchdog process per
gateway, started with the first server (no cost per cold start), reads a pipe from the
gateway on its stdin::

    + PGID START GRACE_S     a group the gateway started (START: /proc/PGID/stat field 22)
    - PGID                   a group that ended

On EOF (the gateway is gone, or closed the pipe once its servers ended) it sends SIGTERM
to each group still alive, SIGKILL to those alive after their grace, waits until they
are gone and exits: it never outlives its job. A group is signalled only while its
number still names the process that was started (same start time, same boot), so a
reused pid is never signalled.

It runs in its own session (a Ctrl-C at the gateway's terminal does not reach it) and
ignores SIGINT and SIGHUP. This module is run by its path (``python -I -S
watchdog.py``): it imports the standard library only, and the launcher
(``process.py``) imports its helpers, so that both judge a group by the same rules.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["boot_id", "group_alive", "same_group", "signal_group", "start_time", "stop_groups"]

POLL_S = 0.05
GONE_WAIT_S = 10.0  # after SIGKILL: the kernel frees the processes, the watchdog waits


def boot_id() -> str:
    """This boot's id: a start time is only comparable within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command (field 3, the state, first)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22); None if it is gone."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def same_group(pgid: int, started: int) -> bool:
    """Whether group ``pgid`` is still the one whose leader started at ``started``: its
    leader is that very process, or has exited while its group lives on (a group's
    number is not given to a new process while the group has members)."""
    now = start_time(pgid)
    return now is None or now == started


def group_alive(pgid: int) -> bool:
    """Whether group ``pgid`` has a process that is not a zombie (a zombie holds no
    memory, and one whose parent never reaps it would otherwise look alive forever)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                fields = _stat(int(entry.name))
                if fields and int(fields[2]) == pgid and fields[0] != "Z":
                    return True
    return False


def signal_group(pgid: int, started: int, signum: int) -> bool:
    """Sends ``signum`` to group ``pgid`` if it is still the one started at ``started``;
    False if it is gone (or the number names another process now)."""
    if not same_group(pgid, started):
        return False
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_groups(groups: Iterable[tuple[int, int, float]], *, kill_now: bool = False) -> None:
    """Stops each ``(pgid, start, grace_s)`` group still alive: SIGTERM, SIGKILL once its
    grace has passed (at once with ``kill_now``), and returns when all are gone (or
    ``GONE_WAIT_S`` after the last SIGKILL)."""
    first = signal.SIGKILL if kill_now else signal.SIGTERM
    now = time.monotonic()
    live = {
        pgid: (started, now + (0.0 if kill_now else grace_s))
        for pgid, started, grace_s in groups
        if signal_group(pgid, started, first)
    }
    killed: dict[int, float] = {}
    while live:
        time.sleep(POLL_S)
        now = time.monotonic()
        for pgid, (started, deadline) in list(live.items()):
            if not group_alive(pgid):
                del live[pgid]
            elif pgid in killed:
                if now - killed[pgid] > GONE_WAIT_S:
                    del live[pgid]  # unkillable (a process stuck in the kernel): give up
            elif now >= deadline:
                signal_group(pgid, started, signal.SIGKILL)
                killed[pgid] = now


def watch(lines: Iterable[bytes]) -> dict[int, tuple[int, float]]:
    """The groups still running when ``lines`` ends (the gateway's messages)."""
    groups: dict[int, tuple[int, float]] = {}
    for line in lines:
        parts = line.split()
        try:
            if parts[:1] == [b"+"] and len(parts) == 4:
                groups[int(parts[1])] = (int(parts[2]), float(parts[3]))
            elif parts[:1] == [b"-"] and len(parts) == 2:
                groups.pop(int(parts[1]), None)
        except ValueError:
            continue  # a garbled line: the groups it does not name are still watched
    return groups


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    groups = watch(sys.stdin.buffer)
    stop_groups((pgid, started, grace_s) for pgid, (started, grace_s) in groups.items())


if __name__ == "__main__":
    main()
