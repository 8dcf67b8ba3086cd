"""One replica of a model: one server process under one lease.

::

    queued --granted--> loading --ready 2xx--> warm <--> busy
      |                   |                     |  idle keep_alive: stop
      | nobody waits:     | exited / not ready  |  revoked: no new requests, in-flight
      | cancelled         | in load_timeout:    |  ones get the grace, then stop
      v                   v failed              v
                    stop (SIGTERM, SIGKILL after grace) -> exited -> release -> ended

Busy and idle: the lease is marked busy before a request is forwarded to a replica
marked idle, and idle once no request has been in flight for ``idle_after`` (so that
back-to-back requests do not cost two controller calls each). The revocation is
learnt by long-polling the lease (``GET /v1/leases/{id}?wait=&state=``): it goes
through the client's failover and leader following, and ``state=`` answers at once
when the state already changed, so no change is missed between two polls.

The memory of a revoked lease stays committed until the process group has exited
(I4): the lease is released only after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from ..agent.local import agent_request, attach
from ..client import ApiError, ControllerUnreachable, NotGranted, pending_text
from .upstream import Upstream

if TYPE_CHECKING:
    from .model import ModelServer

__all__ = ["Replica"]

log = logging.getLogger("gpu_arbiter.gateway")
VISIBLE_DEVICES = (
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
)
READY_POLL_S = 0.1
AGENT_MARGIN_S = 5.0  # beyond the grace, before the gateway kills what the agent did not
Json = dict[str, Any]


@dataclass(slots=True)
class Ending:
    """Why a replica stops: ``kind`` (keep_alive, reclaimed, preempted, revoked, failed,
    cancelled, shutdown) and the words for logs and error bodies."""

    kind: str
    reason: str


class Replica:
    def __init__(self, model: ModelServer, number: int) -> None:
        self.model = model
        self.number = number
        self.state = "queued"
        self.lease: Json = {}
        self.port = 0
        self.pid: int | None = None
        self.in_flight = 0
        self.ending: Ending | None = None
        self.pending_reason = "waiting for a lease"
        self.exited = asyncio.Event()
        self.returncode: int | None = None
        self._end = asyncio.Event()
        self._idle_marked = False
        self._mark = asyncio.Lock()
        self._arrivals = 0  # requests that took a slot
        self._quiet_since = 0.0  # when the last one left
        self._quiet_task: asyncio.Task[None] | None = None
        self.upstream = Upstream(0, model.config.max_parallel)  # its server's, once started
        self._process: subprocess.Popen[bytes] | None = None
        # the tasks relaying a request to the server (the gateway's app adds and removes
        # them); those left at the end of the grace are cancelled, and ``cut`` set
        self.relays: set[asyncio.Task[Any]] = set()
        self.cut = False
        self._by_agent = False  # the local agent supervises the process

    # ------------------------------------------------------------------ routing

    @property
    def accepting(self) -> bool:
        return self.state in ("warm", "busy") and self.ending is None

    @property
    def live(self) -> bool:
        return self.state != "ended"

    async def enter(self) -> bool:
        """Takes a slot (the caller checked it has room); False if the lease was lost
        meanwhile. Marks the lease busy first when it was marked idle."""
        self.in_flight += 1
        self._arrivals += 1
        self.state = "busy"
        if not self._idle_marked:
            return True
        async with self._mark:
            if self._idle_marked:
                try:
                    self.lease = await self.model.client.busy(self.lease["id"])
                    self._idle_marked = False
                except (ApiError, ControllerUnreachable) as error:
                    self.leave()
                    self._stop(Ending("revoked", f"lease {self.lease['id']} lost: {error}"))
                    return False
        return True

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            if self.state == "busy":
                self.state = "warm"
            self._quiet_since = time.monotonic()
            self._start_quiet()
        self.model.notify()

    def _start_quiet(self) -> None:
        if self._quiet_task is None or self._quiet_task.done():
            self._quiet_task = asyncio.ensure_future(self._quiet())

    async def _quiet(self) -> None:
        """No request in flight: idle after ``idle_after``, stopped after ``keep_alive``.
        One timer per replica (not one per request): it ends while a request is in
        flight, and the next request to leave starts it again."""
        config = self.model.config
        while not self.in_flight and self.ending is None:
            arrivals = self._arrivals
            if not await self._stays_quiet(config.idle_after_s, arrivals):
                continue  # a request came: from the start once none is in flight
            await self._mark_idle(arrivals)
            if await self._stays_quiet(config.keep_alive_s, arrivals):
                idle_s = config.keep_alive_s
                self._stop(Ending("keep_alive", f"idle for {idle_s:g}s (keep_alive)"))
                return

    async def _stays_quiet(self, quiet_s: float, arrivals: int) -> bool:
        """Waits until no request has come for ``quiet_s`` since the last one left;
        False as soon as one comes (or the replica is ending)."""
        while self._arrivals == arrivals and self.ending is None:
            left = self._quiet_since + quiet_s - time.monotonic()
            if left <= 0:
                return True
            await asyncio.sleep(left)
        return False

    async def _mark_idle(self, arrivals: int) -> None:
        async with self._mark:
            if self._arrivals != arrivals or self.ending is not None:
                return
            lease_id = self.lease["id"]
            with contextlib.suppress(ApiError, ControllerUnreachable):
                self.lease = await self.model.client.idle(lease_id)
                self._idle_marked = True
                if self._arrivals != arrivals:  # one came meanwhile, and did not wait
                    self.lease = await self.model.client.busy(lease_id)
                    self._idle_marked = False

    def cancel_if_queued(self) -> None:
        if self.state == "queued":
            self._stop(Ending("cancelled", "nobody waits for it any more"))

    def shutdown(self) -> None:
        self._stop(Ending("shutdown", "the gateway is stopping"))

    def _stop(self, ending: Ending) -> None:
        if self.ending is None:
            self.ending = ending
            self._end.set()
            self.model.notify()

    # ------------------------------------------------------------------ life

    async def run(self) -> None:
        """The whole life of the replica; never raises (the reason is in ``ending``)."""
        try:
            if await self._acquire():
                await self._serve()
        except Exception as error:  # a bug or the controller gone: end cleanly, say why
            log.exception("model %s replica %d failed", self.model.name, self.number)
            self._stop(Ending("failed", f"{error.__class__.__name__}: {error}"))
        finally:
            await self._finish()

    async def _acquire(self) -> bool:
        client = self.model.client
        try:
            self.lease = await client.create_lease(**self.model.lease_request(self.number))
        except NotGranted as error:
            self._stop(Ending("failed", f"lease not granted: {error.state} ({error.reason})"))
            return False
        except ApiError as error:
            self._stop(Ending("failed", f"lease refused ({error.code}): {error}"))
            return False
        while self.lease["state"] == "pending" and self.ending is None:
            self.pending_reason = pending_text(self.lease)
            self.model.notify()
            waiting = asyncio.ensure_future(
                client.lease(self.lease["id"], wait_s=30.0, state="pending")
            )
            ended = asyncio.ensure_future(self._end.wait())
            await asyncio.wait({waiting, ended}, return_when=asyncio.FIRST_COMPLETED)
            ended.cancel()
            if not waiting.done():
                waiting.cancel()
                break
            with contextlib.suppress(ControllerUnreachable):
                self.lease = waiting.result()
        if self.lease["state"] in ("loading", "active") and self.ending is None:
            return True
        if self.ending is None:
            reason = self.lease.get("end_reason") or self.lease["state"]
            self._stop(Ending("failed", f"lease not granted: {reason}"))
        return False

    async def _serve(self) -> None:
        self.state = "loading"
        self.model.notify()
        started = time.monotonic()
        helpers = [
            asyncio.ensure_future(self._renew()),
            asyncio.ensure_future(self._watch()),
        ]
        try:
            await self._start_process()
            loaded = await self._wait_ready()
            if loaded:
                self.model.loaded(self, time.monotonic() - started)
                self.state = "warm"
                self._quiet_since = time.monotonic()
                self._start_quiet()
                self.model.notify()
                await self._end.wait()
            await self._drain()
        finally:
            if self._quiet_task is not None:
                helpers.append(self._quiet_task)
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            self.upstream.close()

    async def _start_process(self) -> None:
        model = self.model
        self.port = _free_port()
        self.upstream = Upstream(self.port, model.config.max_parallel)
        command = [part.replace("{port}", str(self.port)) for part in model.config.command]
        env = dict(os.environ)
        local = await agent_request(str(self.lease["worker"]), {"op": "env"})
        if local and local.get("ok"):
            env.update({str(k): str(v) for k, v in (local.get("env") or {}).items()})
        indexes = ",".join(g.rpartition(":")[2] for g in self.lease["gpus"])
        env.update({name: indexes for name in VISIBLE_DEVICES})
        env.update(model.config.env)
        env["GPU_ARBITER_LEASE"] = str(self.lease["id"])
        env["GPU_ARBITER_FENCING_TOKEN"] = str(self.lease["token"])
        try:
            self._process = await asyncio.to_thread(
                subprocess.Popen, command, env=env, process_group=0, stdin=subprocess.DEVNULL
            )
        except OSError as error:
            self._stop(Ending("failed", f"cannot start {command[0]}: {error.strerror or error}"))
            self.exited.set()
            return
        self.pid = self._process.pid
        model.supervisor.watch(self.lease["id"], self.pid, self.pid)
        self._by_agent = await self._attach()
        log.info(
            "model %s replica %d: started pid %d on %s port %d (lease %s)",
            model.name, self.number, self.pid, ", ".join(self.lease["gpus"]), self.port,
            self.lease["id"],
        )  # fmt: skip
        self.model.spawn(self._reap())

    async def _reap(self) -> None:
        """Waits for the process to exit (pidfd: woken by the kernel), keeps its exit code,
        and ends what it left in its group: the lease covers the whole group."""
        assert self.pid is not None and self._process is not None
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        fd = os.pidfd_open(self.pid)
        loop.add_reader(fd, woken.set)
        try:
            await woken.wait()
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        code = self._process.wait()  # the supervisor may have reaped it: its code then
        entry = self.model.supervisor.get(self.lease["id"])
        self.returncode = entry.returncode if entry and entry.returncode is not None else code
        await _end_group(self.pid)
        self.exited.set()
        if self.ending is None:
            self._stop(Ending("failed", f"the server exited with code {self.returncode}"))

    async def _wait_ready(self) -> bool:
        config = self.model.config
        deadline = time.monotonic() + config.load_timeout_s
        url = f"http://127.0.0.1:{self.port}{config.ready}"
        async with httpx.AsyncClient(timeout=2.0) as http:
            while self.ending is None:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(url)).is_success:
                        break
                if time.monotonic() > deadline:
                    self._stop(
                        Ending(
                            "failed", f"not ready at {config.ready} in {config.load_timeout_s:g}s"
                        )
                    )
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._end.wait(), READY_POLL_S)
        if self.ending is not None:
            return False
        try:
            self.lease = await self.model.client.ready(self.lease["id"])
        except (ApiError, ControllerUnreachable) as error:
            self._stop(Ending("revoked", f"lease lost while loading: {error}"))
            return False
        return True

    async def _attach(self) -> bool:
        """Puts the process group under the local agent's supervision: the controller then
        knows its memory is the lease's (I2), and the agent stops it when the lease lapses
        or this gateway is gone. On a revocation the gateway stops it itself, after the
        requests in flight had their grace (``holder_stops_s``): the agent's own SIGTERM
        comes only if it has not by then."""
        assert self.pid is not None
        worker, grace_s = str(self.lease["worker"]), self.model.config.grace_s
        return await attach(worker, self.lease["id"], self.pid, holder_stops_s=grace_s)

    async def _drain(self) -> None:
        """No new requests; those in flight get the grace to finish, and those still in
        flight after it are cut off (503, naming why the replica stops); then the process
        group is stopped: SIGTERM once, SIGKILL after the grace."""
        assert self.ending is not None
        grace_s = self.model.config.grace_s
        if self.pid is not None and not self.exited.is_set():
            await self.model.measure(self)  # its last figure, for the next lease
        if self.ending.kind in ("preempted", "reclaimed", "revoked", "shutdown"):
            deadline = time.monotonic() + grace_s
            while self.in_flight and time.monotonic() < deadline and not self.exited.is_set():
                await asyncio.sleep(0.05)
            self._cut_relays()
        self.state = "stopping"
        self.model.notify()
        if self.pid is None or self.exited.is_set():
            return
        await self._stop_process(grace_s)

    def _cut_relays(self) -> None:
        self.cut = bool(self.relays)
        for relay in self.relays:
            relay.cancel()
        if self.cut:
            log.info(
                "model %s replica %d: %d request(s) did not finish within the %gs grace",
                self.model.name, self.number, len(self.relays), self.model.config.grace_s,
            )  # fmt: skip

    async def _stop_process(self, grace_s: float) -> None:
        """By the agent where it supervises the process (one SIGTERM, whoever asks), else
        by the gateway's own supervisor; SIGKILL here if the agent has not stopped it by
        the grace and a margin."""
        assert self.pid is not None
        pgid = self.pid
        body = {"op": "stop", "lease": self.lease["id"], "grace_s": grace_s}
        by_agent = self._by_agent and bool(
            (answer := await agent_request(str(self.lease["worker"]), body)) and answer.get("ok")
        )
        if not by_agent:
            task = self.model.supervisor.stop(self.lease["id"], grace_s)
            if task is not None:
                await task
        try:
            await asyncio.wait_for(self.exited.wait(), grace_s + AGENT_MARGIN_S)
        except TimeoutError:
            log.warning("model %s: pid %s outlived its grace: SIGKILL", self.model.name, self.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            await self.exited.wait()

    async def _finish(self) -> None:
        """Process gone (or never started) -> release -> ended."""
        if self.pid is not None:
            await self.exited.wait()
            self.model.supervisor.forget(self.lease["id"])
        if self.lease.get("id"):
            await self._release()
        assert self.ending is not None
        self.state = "ended"
        self.model.ended(self)

    async def _release(self) -> None:
        for _ in range(20):
            try:
                await self.model.client.release(self.lease["id"])
                return
            except ControllerUnreachable:
                await asyncio.sleep(1.0)
            except ApiError:
                return

    async def _renew(self) -> None:
        ttl_s = float(self.lease.get("ttl_s") or 30.0)
        while True:
            await asyncio.sleep(max(0.2, ttl_s / 3))
            try:
                await self.model.client.renew(self.lease["id"])
                if self.pid is not None and not self.exited.is_set():
                    self._by_agent = await self._attach()  # a restarted agent learns it again
            except ControllerUnreachable:
                continue  # not lost until the controller says so
            except ApiError as error:
                if error.status in (404, 409):
                    self._stop(Ending("revoked", f"lease {self.lease['id']} lost: {error}"))
                    return

    async def _watch(self) -> None:
        state = str(self.lease["state"])
        while True:
            try:
                lease = await self.model.client.lease(self.lease["id"], wait_s=30.0, state=state)
            except ControllerUnreachable:
                await asyncio.sleep(0.5)
                continue
            state = str(lease["state"])
            if state == "revoking" or lease.get("ended_at") is not None:
                self._stop(self._revoked(lease))
                return

    def _revoked(self, lease: Json) -> Ending:
        why = lease.get("revoke_reason") or lease.get("end_reason") or lease["state"]
        detail = f"lease {lease['id']} revoked ({why}"
        if lease.get("preempted_for"):
            detail += f" for {lease['preempted_for']}"
        detail += ")"
        if why == "preempted":
            return Ending("reclaimed" if self.in_flight == 0 else "preempted", detail)
        return Ending("revoked", detail)

    async def used_mb(self) -> int | None:
        """The GPU memory of the process group now, as the local agent's probe sees it."""
        if self.pid is None:
            return None
        body = {"op": "usage", "pgid": self.pid}
        answer = await agent_request(str(self.lease.get("worker")), body)
        used = answer.get("used_mb") if answer else None
        return used if isinstance(used, int) else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _end_group(pgid: int) -> None:
    """Kills what is left of a group whose leader exited (its SIGTERM came before)."""
    for _ in range(100):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        await asyncio.sleep(0.05)
