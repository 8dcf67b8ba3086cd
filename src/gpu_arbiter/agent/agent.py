"""The worker agent: registers this host's GPUs, heartbeats the probe's readings, and
carries out revocations on the processes that hold leases here.

::

    register --> heartbeat every heartbeat_s --(answer)--> stop revoked processes
        ^              |  unreachable / 404                 report them stopped
        +-- backoff <--+                                    run an update when asked

Which process holds which lease it learns from ``gpu-arbiter run`` over the local
endpoint (:mod:`.local`); which leases share one process group's memory (an ``ollama
serve``), from the holder's accounts (:mod:`.accounts`). A killed or restarted agent
loses nothing that matters: the processes keep running, ``run`` attaches them again
with its next renewal (and a holder says its account again), and the controller keeps
the leases committed in the meantime (I4).

An update (``POST /v1/workers/{name}/update``) reaches the agent in the heartbeat
answer once the worker is drained. The agent runs the command configured on this
host (``update_command``; never one received over the network), reports the
outcome, and on success replaces itself (``os.execv``) with the same command line;
the new agent registers with its new version and the controller ends the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..client import ApiError, ArbiterClient, ControllerUnreachable
from .accounts import Accounts, parse_shares, split_groups
from .local import LocalEndpoint, process_uid, socket_path
from .probes import FakeProbe, GpuReading, Probe, ProbeSnapshot, process_alive, to_gpus
from .supervisor import ProcessSupervisor, Supervised

__all__ = ["Agent", "AgentConfig", "read_version"]

log = logging.getLogger("gpu_arbiter.agent")
Json = dict[str, Any]
COMMAND_TIMEOUT_S = 900.0
OUTPUT_TAIL = 2000


@dataclass(frozen=True, slots=True)
class AgentConfig:
    name: str
    controller: str | None = None
    token: str | None = None
    heartbeat_s: float = 2.0
    grace_s: float = 10.0
    update_command: str | None = None
    version_file: Path | None = None
    headroom_mb: int = 256
    labels: dict[str, str] = field(default_factory=dict)
    max_backoff_s: float = 10.0


def read_version(version_file: Path | None) -> str:
    """The version this agent reports: the first line of ``version_file`` when configured
    (what an update changes), else the package's version."""
    from .. import __version__

    if version_file is not None:
        with contextlib.suppress(OSError):
            text = version_file.read_text(encoding="utf-8").strip().splitlines()
            if text and text[0].strip():
                return text[0].strip()[:200]
    return __version__


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        probe: Probe,
        *,
        client: ArbiterClient | None = None,
        reexec: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.probe = probe
        self.client = client or ArbiterClient(config.controller, token=config.token)
        self.supervisor = ProcessSupervisor()
        self.accounts = Accounts(_start_time, clock)  # groups shared by leases (Ollama)
        self.endpoint = LocalEndpoint(socket_path(config.name), self._local)
        self.attachments = self.endpoint.path.with_suffix(".leases.json")
        self.version = read_version(config.version_file)
        self._reexec = reexec or _reexec
        self._snapshot: ProbeSnapshot | None = None
        self._kick = asyncio.Event()
        self._registered = False
        self._registered_gpus: set[int] = set()
        self._updating: str | None = None
        self._update_task: asyncio.Task[None] | None = None
        self._holder_stops: dict[str, float] = {}  # lease -> seconds its holder takes
        self._deferred: dict[str, asyncio.Task[None]] = {}  # stops after those seconds

    # ------------------------------------------------------------------ life cycle

    async def run(self, stop: asyncio.Event) -> None:
        """Registers and heartbeats until ``stop`` is set. Supervised processes are left
        running when the agent stops: they are not the agent's to end."""
        await self.endpoint.start()
        self._restore()
        backoff = 0.5
        try:
            while not stop.is_set():
                try:
                    await self._cycle()
                    backoff = 0.5
                    delay = self.config.heartbeat_s
                except ControllerUnreachable as error:
                    log.warning("controller unreachable; retrying in %.1fs: %s", backoff, error)
                    self._registered = False
                    delay, backoff = backoff, min(backoff * 2, self.config.max_backoff_s)
                except ApiError as error:
                    log.warning("controller refused (%s %s): %s", error.status, error.code, error)
                    if error.status in (404, 409):
                        self._registered = False
                    delay, backoff = backoff, min(backoff * 2, self.config.max_backoff_s)
                await self._sleep(stop, delay)
        finally:
            waiting = [*self._deferred.values()]
            if self._update_task is not None:
                waiting.append(self._update_task)
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            await self.supervisor.close()
            await self.endpoint.close()
            await self.client.aclose()
            await self.probe.aclose()

    async def _sleep(self, stop: asyncio.Event, delay_s: float) -> None:
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._kick.wait())]
        try:
            await asyncio.wait(waits, timeout=delay_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()
        self._kick.clear()

    async def _cycle(self) -> None:
        snapshot = await self.probe.snapshot()
        self._snapshot = snapshot
        if not self._registered:
            await self._register(snapshot)
        sent_at = time.monotonic()
        answer = await self.client.heartbeat(self.config.name, self._heartbeat_body(snapshot))
        self._act(answer, sent_at)
        update = answer.get("update")
        if isinstance(update, dict) and update.get("run"):
            operation_id = str(update["operation"])
            busy = self._update_task is not None and not self._update_task.done()
            if self._updating != operation_id and not busy:  # in the background
                self._updating = operation_id
                self._update_task = asyncio.create_task(self._update(operation_id))

    async def _register(self, snapshot: ProbeSnapshot) -> None:
        gpus = to_gpus(snapshot, self.config.name, headroom_mb=self.config.headroom_mb)
        if not gpus:
            raise ControllerUnreachable(f"the probe sees no GPU to register: {snapshot.errors}")
        body = {
            "name": self.config.name,
            "url": f"unix:{self.endpoint.path}",
            "labels": self.config.labels,
            "agent_version": self.version,
            "simulated": isinstance(self.probe, FakeProbe),
            "gpus": [
                {
                    "index": g.index,
                    "total_mb": g.total_mb,
                    "uuid": g.uuid,
                    "model": g.model,
                    "vendor": g.vendor,
                    "arch": g.arch,
                    "headroom_mb": g.headroom_mb,
                }
                for g in gpus
            ],
        }
        await self.client.register(body)
        self._registered = True
        self._registered_gpus = {g.index for g in gpus}
        log.info("registered %s (%d GPUs, version %s)", self.config.name, len(gpus), self.version)

    # ------------------------------------------------------------------ heartbeat

    def _heartbeat_body(self, snapshot: ProbeSnapshot) -> Json:
        self.supervisor.refresh()
        groups = {e.pgid: e.lease_id for e in self.supervisor.leases() if not e.stopped}
        pids = {e.pid: e.lease_id for e in self.supervisor.leases() if not e.stopped}
        accounts = self.accounts.current()
        gpus = [_gpu_body(reading, pids, groups, accounts) for reading in snapshot.gpus]
        entries = self.supervisor.leases()
        return {
            "gpus": gpus,
            "leases": sorted(e.lease_id for e in entries if not e.stopped),
            "stopped": sorted(e.lease_id for e in entries if e.stopped),
            "stale": [i for i in snapshot.stale_indices if i in self._registered_gpus],
        }

    def _act(self, answer: Json, sent_at: float) -> None:
        """Stops revoked processes, and those whose lease the controller no longer holds
        (it lapsed, or ended while this agent was away): no process runs on a GPU without
        a lease. Forgets those the controller is done with. ``sent_at``: when the
        heartbeat left; a process attached since may not be in the answer yet."""
        held = set(answer.get("leases") or ())
        revoking = set(answer.get("revoking") or ())
        knows_held = isinstance(answer.get("leases"), list)  # absent: it says nothing of them
        for entry in self.supervisor.leases():
            if entry.stopped or entry.stopping:
                continue
            if entry.lease_id not in revoking:
                if not knows_held or entry.lease_id in held or entry.attached_at >= sent_at:
                    continue
                log.warning(
                    "lease %s has ended at the controller but pid %d still runs: stopping it",
                    entry.lease_id,
                    entry.pid,
                )
            elif entry.lease_id in self._holder_stops:
                self._defer_stop(entry)
                continue
            self._stop(entry.lease_id)
        done = [e for e in self.supervisor.leases() if e.lease_id not in held and e.stopped]
        for entry in done:
            self.supervisor.forget(entry.lease_id)  # released, or confirmed stopped
            self._holder_stops.pop(entry.lease_id, None)
            deferred = self._deferred.pop(entry.lease_id, None)
            if deferred is not None:
                deferred.cancel()
        if done:
            self._persist()

    def _stop(self, lease_id: str, grace_s: float | None = None) -> None:
        """SIGTERM to the lease's group, SIGKILL after the grace (once, whoever asks)."""
        task = self.supervisor.stop(lease_id, self.config.grace_s if grace_s is None else grace_s)
        if task is not None:
            task.add_done_callback(lambda _t: self._kick.set())

    def _defer_stop(self, entry: Supervised) -> None:
        """A revoked lease whose holder stops its process itself (it lets its requests
        finish first): the agent's own SIGTERM comes only if the process still runs, and
        no stop is under way, after the holder's seconds (at most ``--grace-s``)."""
        lease_id = entry.lease_id
        if lease_id in self._deferred:
            return
        wait_s = min(self._holder_stops[lease_id], self.config.grace_s)
        log.info(
            "lease %s revoked: its holder stops pid %d itself; SIGTERM here in %.1fs if not",
            lease_id, entry.pid, wait_s,
        )  # fmt: skip
        self._deferred[lease_id] = asyncio.create_task(self._stop_after(entry, wait_s))

    async def _stop_after(self, entry: Supervised, wait_s: float) -> None:
        await asyncio.sleep(wait_s)
        self.supervisor.refresh()
        if entry.stopped or entry.stopping or self.supervisor.get(entry.lease_id) is not entry:
            return
        log.warning(
            "lease %s: its holder has not stopped pid %d in %.1fs: stopping it",
            entry.lease_id, entry.pid, wait_s,
        )  # fmt: skip
        self._stop(entry.lease_id)

    # ------------------------------------------------------------------ attachments

    def _persist(self) -> None:
        """Which process holds which lease, kept across a restart of the agent (with each
        process's start time, so a pid reused meanwhile is never mistaken for it)."""
        entries = {
            e.lease_id: [e.pid, e.pgid, _start_time(e.pid)] for e in self.supervisor.leases()
        }
        partial = self.attachments.with_suffix(".tmp")
        try:
            partial.write_text(json.dumps(entries), encoding="utf-8")
            os.replace(partial, self.attachments)
        except OSError as error:
            log.warning("cannot keep the attachments in %s: %s", self.attachments, error)

    def _restore(self) -> None:
        """Supervises again what a previous run of this agent supervised; a process that
        exited meanwhile is reported stopped with the first heartbeat."""
        try:
            entries = json.loads(self.attachments.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if not isinstance(entries, dict):
            return
        for lease_id, ids in entries.items():
            if not (isinstance(ids, list) and len(ids) == 3 and isinstance(ids[0], int)):
                continue
            pid, pgid, started = ids
            entry = self.supervisor.watch(str(lease_id), pid, int(pgid))
            if not process_alive(pid) or _start_time(pid) != started:
                entry.stopped = True
            log.info("lease %s: pid %d %s", lease_id, pid, "exited" if entry.stopped else "again")
        self._persist()

    # ------------------------------------------------------------------ local endpoint

    async def _local(self, request: Json, peer_uid: int) -> Json:
        op = request.get("op")
        if op == "env":
            simulated = isinstance(self.probe, FakeProbe)
            env = self.probe.child_env() if isinstance(self.probe, FakeProbe) else {}
            return {"ok": True, "env": env, "worker": self.config.name, "simulated": simulated}
        pgid = request.get("pgid")
        if op == "usage" and "lease" not in request and isinstance(pgid, int) and pgid > 1:
            return {"ok": True, "used_mb": self._group_usage(None, pgid)}
        if op == "account":
            return self._account(pgid, request.get("shares"), peer_uid)
        lease_id = request.get("lease")
        if not isinstance(lease_id, str) or not 0 < len(lease_id) <= 64:
            return {"ok": False, "error": "lease must be a lease id"}
        if op == "attach":
            return self._attach(lease_id, request, peer_uid)
        if op == "usage":
            return {"ok": True, "used_mb": self._usage(lease_id)}
        if op == "stop":
            return self._stop_for(lease_id, request.get("grace_s"), peer_uid)
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _stop_for(self, lease_id: str, grace_s: Any, peer_uid: int) -> Json:
        """Stops a supervised lease's process for ``run``; a stop already under way (the
        controller revoked the lease) goes on as it is: one SIGTERM, whoever asks."""
        entry = self.supervisor.get(lease_id)
        if entry is None or entry.stopped:
            return {"ok": False, "error": f"lease {lease_id} has no process supervised here"}
        if peer_uid != 0 and process_uid(entry.pid) != peer_uid:
            return {"ok": False, "error": f"process {entry.pid} belongs to another user"}
        grace = float(grace_s) if _seconds(grace_s) else self.config.grace_s
        self._stop(lease_id, grace)
        return {"ok": True}

    def _attach(self, lease_id: str, request: Json, peer_uid: int) -> Json:
        pid, pgid = request.get("pid"), request.get("pgid")
        if not isinstance(pid, int) or not isinstance(pgid, int) or pid <= 1 or pgid <= 1:
            return {"ok": False, "error": "pid and pgid must be process ids"}
        holder_stops = request.get("holder_stops_s")
        if holder_stops is not None and not _seconds(holder_stops):
            return {"ok": False, "error": "holder_stops_s must be seconds, 0 to 3600"}
        owner = process_uid(pid)
        if owner is None:
            return {"ok": False, "error": f"no process {pid}"}
        if peer_uid != 0 and owner != peer_uid:
            return {"ok": False, "error": f"process {pid} belongs to another user"}
        entry = self.supervisor.get(lease_id)
        if entry is None or entry.pid != pid:
            log.info("lease %s: supervising pid %d (group %d)", lease_id, pid, pgid)
        self.supervisor.watch(lease_id, pid, pgid)
        if holder_stops is None:
            self._holder_stops.pop(lease_id, None)
        else:
            self._holder_stops[lease_id] = float(holder_stops)
        self._persist()
        return {"ok": True}

    def _account(self, pgid: Any, shares: Any, peer_uid: int) -> Json:
        """Group ``pgid``'s GPU memory is that of the leases of ``shares`` (lease id ->
        MiB, the proportions it is split in): a group several leases share, which the
        agent neither supervises nor signals (see :mod:`.accounts`)."""
        if isinstance(pgid, bool) or not isinstance(pgid, int) or pgid <= 1:
            return {"ok": False, "error": "pgid must be a process group id"}
        parsed = parse_shares(shares)
        if isinstance(parsed, str):
            return {"ok": False, "error": parsed}
        if parsed:
            owner = process_uid(pgid)
            if owner is None or _pgid(pgid) != pgid:
                return {"ok": False, "error": f"pgid: no process group {pgid}"}
            if peer_uid != 0 and owner != peer_uid:
                return {"ok": False, "error": f"pgid: process {pgid} belongs to another user"}
        refused = self.accounts.put(pgid, parsed)
        return {"ok": False, "error": refused} if refused else {"ok": True}

    def _usage(self, lease_id: str) -> int | None:
        entry = self.supervisor.get(lease_id)
        return None if entry is None else self._group_usage(entry.pid, entry.pgid)

    def _group_usage(self, pid: int | None, pgid: int) -> int | None:
        """GPU memory of a process and its group, as the last probe saw it (the gateway
        asks it of the model servers it starts, by group)."""
        if self._snapshot is None:
            return None
        total = 0
        for reading in self._snapshot.gpus:
            if reading.processes is None:
                return None
            for pid_, mb in reading.processes.items():
                if pid_ == pid or _pgid(pid_) == pgid:
                    if mb is None:
                        return None
                    total += mb
        return total

    # ------------------------------------------------------------------ update

    async def _update(self, operation_id: str) -> None:
        """Runs this host's update command, reports it, and restarts on success."""
        command = self.config.update_command
        if not command:
            await self._report(operation_id, "failed", "no --update-command is configured here")
            return
        if not await self._report(operation_id, "started", f"running: {command}"):
            return  # the controller ended it meanwhile (timed out, cancelled): run nothing
        log.info("operation %s: running the update command: %s", operation_id, command)
        code, output = await _run_command(command)
        if code != 0:
            tail = output[-OUTPUT_TAIL:]
            why = f"the update command exited with {code}" + (f": {tail}" if tail else "")
            await self._report(operation_id, "failed", why)
            return
        await self._report(operation_id, "ok", "the update command succeeded; restarting")
        await self.supervisor.close()
        await self.endpoint.close()
        await self.client.aclose()
        self._reexec()

    async def _report(self, operation_id: str, outcome: str, detail: str) -> bool:
        """False if the controller refused the report (the operation is over); an
        unreachable controller is not a refusal."""
        body = {"step": "update_command", "outcome": outcome, "detail": detail[:4000]}
        try:
            await self.client.request(
                "POST", f"/v1/operations/{operation_id}/report", json_body=body
            )
        except ApiError as error:
            log.warning("operation %s: %s refused: %s", operation_id, outcome, error)
            return False
        except ControllerUnreachable as error:
            log.warning("operation %s: could not report %s: %s", operation_id, outcome, error)
        return True


async def _run_command(command: str) -> tuple[int, str]:
    try:
        proc = await asyncio.create_subprocess_exec(
            *shlex.split(command),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
        )
    except OSError as error:
        return 127, f"cannot start it: {error}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), COMMAND_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return -9, f"timed out after {COMMAND_TIMEOUT_S:.0f}s"
    return proc.returncode or 0, out.decode(errors="replace").strip()


def _reexec() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def _seconds(value: Any) -> bool:
    """A number of seconds the local endpoint accepts: 0 to 3600."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and 0 <= value <= 3600


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _gpu_body(
    reading: GpuReading,
    pids: dict[int, str],
    groups: dict[int, str],
    accounts: Mapping[int, Mapping[str, int]],
) -> Json:
    """One GPU of a heartbeat: its used MiB and, where the probe says per process, each
    process with the lease it holds, and the accounted groups' memory per lease."""
    gpu: Json = {"index": reading.index, "used_mb": reading.used_mb}
    procs = reading.processes
    if procs is None or any(mb is None for mb in procs.values()):
        return gpu
    group_of = {pid: group for pid in procs if (group := _pgid(pid)) is not None}
    leases = {pid: _lease_of(pid, pids, groups, group_of) for pid in procs}
    gpu["processes"] = [
        {"pid": pid, "used_mb": mb, "lease": leases[pid]} for pid, mb in sorted(procs.items())
    ]
    supervised = {pid for pid, lease_id in leases.items() if lease_id is not None}
    shared = split_groups(procs, group_of, accounts, supervised)
    if shared:
        gpu["lease_used_mb"] = shared
    return gpu


def _lease_of(
    pid: int, pids: dict[int, str], groups: dict[int, str], group_of: Mapping[int, int]
) -> str | None:
    if pid in pids:
        return pids[pid]
    group = group_of.get(pid)
    return None if group is None else groups.get(group)
