"""One replica of a model: one server process under one lease.

::

    queued --granted--> loading --ready 2xx--> warm <--request in / all out--> busy
      |                   |                     |
      | nobody waits:     | exited, not ready   | keep_alive quiet, revoked, reclaimed,
      | cancelled         | in load_timeout:    | preempted, shutdown, the server exited
      v                   v failed              v
    ended <--released-- stopping <--------------+   (requests in flight get the grace)

A replica whose model was removed or replaced is *draining* (:meth:`Replica.retire`):
warm or busy still, it takes no new request, and it stops (``retired``) once the
requests in flight have left, with no grace to cut them short; one that serves no
request (queued, loading, asleep) stops at once.

Timers are driven by events, never by a sleep that nothing can wake: a request that
arrives or leaves wakes the replica's keep-warm task, which re-arms from the moment the
last request left: marked ``idle`` after ``idle_after`` with nothing in flight (so that
back-to-back requests do not cost two controller calls each), stopped after
``keep_alive``. A request marks the lease ``busy`` again before it is forwarded. The
lease is not marked idle before the replica has been ready ``min_resident`` (so that an
equal priority cannot reclaim a model that just loaded: swap thrash). A pinned model's
replicas are never marked idle and never stopped for keep_alive: only a revocation (a
strictly higher priority preempting it, when it is preemptible) or an unload ends them.

Structure (Trio's nursery is the model): :meth:`Replica.run` is the whole life; while a
lease is held, one ``asyncio.TaskGroup`` owns the replica's own work (renewing the lease,
watching it for a revocation, reaping the process, keep-warm, measuring its memory), and
that work ends before the lease is released. One revocation has one watcher (the
long-poll of the lease) and one stopper (the life itself, after the grace). Time, the
process, the agent, the controller and the health check are the :mod:`.interfaces`, so
that all of this runs in unit tests on a virtual clock. An engine that sleeps has a
tier between warm and stopped (``asleep``, ``waking``): :mod:`.asleep`, run by the
keep-warm task.

The memory of a revoked lease stays committed until the process group has exited (I4):
the lease is released only after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from ...client import ApiError, ControllerUnreachable, NotGranted
from ..base.clock import sleep_or
from ..base.race import first
from ..base.scopes import CancelScope
from ..base.upstream import Upstream
from .asleep import SleepTier
from .interfaces import ReplicaOwner, ServerProcess
from .lease import Lease
from .states import Ending, EndKind, ReplicaState, check_move

__all__ = ["EndKind", "Ending", "Replica", "ReplicaState"]

log = logging.getLogger("gpu_arbiter.gateway")
VISIBLE_DEVICES = (
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
)
READY_POLL_FIRST_S = 0.01  # a server that loads in a moment is seen at once; one that
READY_POLL_MAX_S = 0.25  # takes minutes is asked four times a second, not a hundred
AGENT_MARGIN_S = 5.0  # beyond the grace, before the gateway kills what the agent did not
CUT_WAIT_S = 1.0  # at most this long for cut requests to close their connections
RELEASE_TRIES = 20
PORT_TRIES = 3  # a server that could not bind its port is started again on another
TAIL_LINES = 8
SWAP_CHECK_S = 1.0  # how often a busy replica looks whether another model waits for it
BUSY_POLL_S = 0.5  # how often an engine whose work runs after its answer is asked
MEASURE_S = 2.0  # how often a serving replica's memory is measured (vram = "auto")
Json = dict[str, Any]


class Replica:
    def __init__(self, model: ReplicaOwner[Replica], number: int) -> None:
        self.model = model
        self.number = number
        self.parts = model.parts
        self.state = ReplicaState.QUEUED
        self.lease: Lease | None = None  # asked for (pending), granted, or adopted
        self.port = 0
        self.process: ServerProcess | None = None
        self.in_flight = 0
        self.ending: Ending | None = None
        self.pending_reason = "waiting for a lease"
        self.priority = model.config.priority  # what its lease was asked for at
        self.exited = asyncio.Event()
        self.returncode: int | None = None
        self.last_used = self.parts.clock.now()
        self.ready_at: float | None = None
        self.upstream = Upstream(0, model.config.max_parallel)  # its server's, once started
        # the cancel scopes of the requests being relayed to the server (the gateway's
        # app adds and removes them); those left at the end of the grace are cancelled
        # by the replica, and ``cut`` set
        self.relays: set[CancelScope] = set()
        self.cut = False
        self.ended = asyncio.Event()  # set with ``ending``
        self.activity = asyncio.Event()  # a request came or left, or the replica ends
        self.arrivals = 0  # requests that took a slot
        self.quiet_since = self.last_used  # when the last one left
        self._idle_marked = False
        self._mark = asyncio.Lock()
        self._by_agent = False  # the local agent supervises the process
        self.group: asyncio.TaskGroup | None = None
        self.tier = SleepTier(self)
        self.created_at = self.parts.clock.now()
        self._yielding = False  # marked idle while busy: another model waited swap_after
        self.generation = 0  # the model's config it was started for (ModelServer.generation)
        self.replacement = False  # started to replace a replica: kept while nobody waits
        self.retiring: str | None = None  # draining: why it ends once nothing is in flight

    # ------------------------------------------------------------------ routing

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def accepting(self) -> bool:
        serving = self.state in (ReplicaState.WARM, ReplicaState.BUSY)
        return serving and self.ending is None and self.retiring is None

    @property
    def draining(self) -> bool:
        """Retired while requests were in flight: it takes no new one, and ends once
        they have left."""
        return self.retiring is not None and self.ending is None

    @property
    def live(self) -> bool:
        return self.state is not ReplicaState.ENDED

    @property
    def lease_id(self) -> str | None:
        return None if self.lease is None else self.lease.id

    @property
    def holding(self) -> Lease:
        """Its lease, once asked for (or adopted): a bug to ask before."""
        assert self.lease is not None, f"replica {self.number} of {self.model.name} has no lease"
        return self.lease

    @property
    def extra(self) -> bool:
        """A replica beyond the model's ``replicas.min``: marked idle as soon as nothing
        is in flight (the arbiter reclaims it before the others). The cluster's lease
        says its place among the model's replicas (``replica``); this gateway's own are
        counted in the order they were asked for."""
        metadata = self.lease.metadata if self.lease is not None else {}
        if "cluster_model" in metadata:
            return int(metadata.get("replica") or 1) > self.model.config.replicas_min
        live = [r for r in self.model.replicas if r.live]
        return self in live and live.index(self) >= self.model.config.replicas_min

    @property
    def lease_idle(self) -> bool:
        """Whether its lease is marked idle (a cache the arbiter may reclaim)."""
        return self._idle_marked

    def keep_alive_left_s(self) -> float | None:
        """Seconds until keep_alive stops it, while nothing is in flight: warm, or asleep
        (keep_alive runs on while it sleeps). None: busy, waking, loading, or pinned."""
        quiet = (ReplicaState.WARM, ReplicaState.ASLEEP)
        if self.state not in quiet or self.in_flight or self.model.pinned:
            return None
        left = self.quiet_since + self.model.config.keep_alive_s - self.parts.clock.now()
        return max(0.0, left)

    async def enter(self) -> bool:
        """Takes a slot (the caller checked it has room); False if the lease was lost
        meanwhile. Marks the lease busy first when it was marked idle."""
        self.in_flight += 1
        self.arrivals += 1
        self.move(ReplicaState.BUSY, notify=False)
        self.last_used = self.parts.clock.now()
        self.activity.set()
        if self._yielding and self.model.swap_due(self.priority) is None:
            self._yielding = False  # nobody waits any more: marked busy again below
        if not self._idle_marked or self._yielding:
            return True
        try:
            async with self._mark:
                if self._idle_marked:
                    await self._mark_all(self.parts.leases.busy)
                    self._idle_marked = False
        except ControllerUnreachable:
            pass  # still ours until the controller says otherwise: marked next time
        except ApiError as error:
            self.leave()
            self.stop(Ending(EndKind.REVOKED, f"lease {self.holding.id} lost: {error}"))
            return False
        except asyncio.CancelledError:  # its caller went away meanwhile: the slot back
            self.leave()
            raise
        return True

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            if self.state is ReplicaState.BUSY:
                self.move(ReplicaState.WARM, notify=False)  # told below
            self.quiet_since = self.last_used = self.parts.clock.now()
            self.activity.set()
            if self.retiring is not None:
                self.stop(Ending(EndKind.RETIRED, self.retiring))
        self.model.notify()

    def retire(self, why: str) -> None:
        """Its model was removed or replaced (``why``, for the log): it takes no new
        request and stops once the requests in flight have left (at once when none is;
        a queued one is cancelled)."""
        if self.ending is not None or self.retiring is not None:
            return
        self.retiring = why
        if self.state is ReplicaState.QUEUED:
            self.stop(Ending(EndKind.CANCELLED, why))
        elif not self.in_flight:
            self.stop(Ending(EndKind.RETIRED, why))
        else:
            log.info(
                "model %s replica %d: draining (%d in flight): %s",
                self.model.name, self.number, self.in_flight, why,
            )  # fmt: skip
            self.model.notify()

    def outranked(self) -> None:
        """A caller above the priority its pending lease was asked at waits for it: it
        looks again (and asks again at the higher one, if still queued)."""
        if self.state is ReplicaState.QUEUED:
            self.activity.set()

    def cancel_if_queued(self) -> None:
        if self.state is ReplicaState.QUEUED and not self.replacement:
            self.stop(Ending(EndKind.CANCELLED, "nobody waits for it any more"))
        self.activity.set()  # a wake nobody waits for any more is given up

    @property
    def asleep(self) -> bool:
        return self.state in (ReplicaState.ASLEEP, ReplicaState.WAKING) and self.ending is None

    def want_awake(self) -> None:
        """A request waits for this replica: a sleeping one is woken."""
        if not self.tier.wake.is_set():
            self.tier.wake.set()
            self.activity.set()

    def shutdown(self) -> None:
        self.stop(Ending(EndKind.SHUTDOWN, "the gateway is stopping"))

    def unload(self, why: str = "by an operator") -> None:
        """An unload (an operator's, or a drain's: ``why``): a queued one is cancelled,
        the others stop as for a revocation (the requests in flight get the grace)."""
        kind = EndKind.CANCELLED if self.state is ReplicaState.QUEUED else EndKind.UNLOADED
        self.stop(Ending(kind, f"unloaded {why}"))

    def pin_changed(self) -> None:
        """The model was pinned or unpinned: the keep-warm task looks again, its timers
        re-armed from now."""
        if not self.in_flight:
            self.quiet_since = self.parts.clock.now()
        self.activity.set()

    async def mark_busy(self) -> None:
        """Marks the lease busy now if it is marked idle (a pin: no longer a cache)."""
        async with self._mark:
            if self._idle_marked and self.ending is None:
                with contextlib.suppress(ApiError, ControllerUnreachable):
                    await self._mark_all(self.parts.leases.busy)
                    self._idle_marked = False

    def move(self, to: ReplicaState, *, notify: bool = True) -> None:
        """The one way its state changes: a move :data:`~.states.TRANSITIONS` does not
        allow is a bug (``AssertionError``); staying in the same state is no move. The
        model is told (``notify``) unless the caller tells it itself."""
        if to is not self.state:
            check_move(self.state, to)
            self.state = to
        if notify:
            self.model.notify()

    def stop(self, ending: Ending) -> None:
        if self.ending is None:
            self.ending = ending
            self.ended.set()
            self.activity.set()
            self.model.notify()

    # ------------------------------------------------------------------ life

    async def run(self) -> None:
        """The whole life of the replica; never raises (the reason is in ``ending``)."""
        try:
            with self.model.file_kept():  # its model file first: no lease held meanwhile
                if await self.model.file_ready(self) and await self._acquire():
                    await self._serve()
        except Exception as error:  # a bug or the controller gone: end cleanly, say why
            log.exception("model %s replica %d failed", self.model.name, self.number)
            cause = _first_cause(error)
            self.stop(Ending(EndKind.FAILED, f"{cause.__class__.__name__}: {cause}"))
        except asyncio.CancelledError:  # the gateway gave up waiting for it to stop
            self.stop(Ending(EndKind.SHUTDOWN, "cancelled while the gateway stopped"))
            raise
        finally:
            await self._finish()

    async def _acquire(self) -> bool:
        """Asks for the lease and waits while it is pending: asked for again when a caller
        above the priority it was asked at waits (:meth:`outranked`). A replica made for
        a lease granted already (the cluster's load, adopted: :meth:`ModelServer.adopt`)
        asks for nothing."""
        leases = self.parts.leases
        if self.lease is not None:
            return self.ending is None
        if not await self._ask():
            return False
        while self.holding.pending and self.ending is None:
            if self.priority < self.model.lease_priority():
                if not await self._ask_again():
                    return False
                continue
            self.pending_reason = self.holding.pending_text()
            self.model.notify()
            waiting = asyncio.ensure_future(
                leases.lease(self.holding.id, wait_s=30.0, state="pending")
            )
            self.activity.clear()  # set by an ending and by a caller who outranks it
            if await sleep_or(waiting, self.activity):
                waiting.cancel()
                continue
            with contextlib.suppress(ControllerUnreachable):
                self.lease = Lease.of(waiting.result())
        if self.holding.held and self.ending is None:
            return True
        if self.ending is None and self.holding.state == "timed_out":  # queue_timeout
            self.stop(Ending(EndKind.CANCELLED, "not granted within its queue_timeout"))
        elif self.ending is None:
            reason = self.holding.end_reason or self.holding.state
            self.stop(Ending(EndKind.FAILED, f"lease not granted: {reason}"))
        return False

    async def _ask(self) -> bool:
        """Asks for a lease at the model's lease priority now; False (ending set) when
        the controller refused it."""
        request = self.model.lease_request(self.number)
        try:
            self.lease = Lease.of(await self.parts.leases.create_lease(**request))
        except NotGranted as error:
            self.stop(Ending(EndKind.FAILED, f"lease not granted: {error.state} ({error.reason})"))
            return False
        except ApiError as error:
            self.stop(Ending(EndKind.FAILED, f"lease refused ({error.code}): {error}"))
            return False
        self.priority = int(request["priority"])
        return True

    async def _ask_again(self) -> bool:
        """The pending lease released, a new one asked for at the higher priority: it
        moves up a class, where its place in the lower one's order counts for nothing.
        Kept (asked again later) while the controller cannot be reached."""
        pending, before = self.holding.id, self.priority
        try:
            await self.parts.leases.release(pending)
        except ControllerUnreachable:
            await sleep_or(self.parts.clock.sleep(1.0), self.ended)
            return True
        except ApiError:
            pass  # ended meanwhile: nothing to give back
        self.lease = None
        if not await self._ask():
            return False
        log.info(
            "model %s replica %d: lease %s (priority %d) asked again as %s (priority %d)",
            self.model.name, self.number, pending, before, self.holding.id, self.priority,
        )  # fmt: skip
        return True

    async def _serve(self) -> None:
        """Holding the lease: load, serve until an ending, drain, stop the process. The
        task group's work (renew, watch, reap, keep-warm, measure) ends before it returns."""
        self.move(ReplicaState.LOADING)  # an adopted one is loading already
        started = self.parts.clock.now()
        async with asyncio.TaskGroup() as group:
            self.group = group
            keepers = [group.create_task(self._renew()), group.create_task(self.watch())]
            try:
                if await self._load(group):
                    self.model.loaded(self, self.parts.clock.now() - started)
                    self._warm(group, keepers)
                    await self.ended.wait()
                await self._drain()
            finally:
                for task in [*keepers, self.tier.extra_watch]:
                    if task is not None:
                        task.cancel()
        self.upstream.close()

    def _warm(self, group: asyncio.TaskGroup, keepers: list[asyncio.Task[None]]) -> None:
        self.move(ReplicaState.WARM, notify=False)  # told below
        self.quiet_since = self.ready_at = self.parts.clock.now()
        keepers.append(group.create_task(self._keep_warm()))
        if self.model.config.vram is None:
            keepers.append(group.create_task(self._measure()))
        self.model.notify()

    async def _load(self, group: asyncio.TaskGroup) -> bool:
        """Starts the server and waits until it is ready; a server that could not bind
        its port (another program took it meanwhile) is started again on another."""
        for attempt in range(1, PORT_TRIES + 1):
            process = await self._start_process()
            if process is None:
                return False
            group.create_task(self._reap(process))
            outcome = await self._wait_ready(process)
            if outcome != "port_taken" or attempt == PORT_TRIES:
                return outcome == "ready" and await self._mark_ready()
            log.info("model %s: port %d was taken; another one", self.model.name, self.port)
            self.exited.clear()
        return False

    async def _start_process(self) -> ServerProcess | None:
        model, launcher = self.model, self.parts.launcher
        if self.port:
            launcher.unreserve(self.port)
        self.port = launcher.port()
        self.upstream = Upstream(self.port, model.config.max_parallel)
        command = [part.replace("{port}", str(self.port)) for part in model.config.command]
        lease = self.holding
        env = dict(os.environ)
        env.update(await self.parts.agent.env(str(lease.worker)))
        indexes = ",".join(gpu.rpartition(":")[2] for gpu in lease.gpus)
        env.update({name: indexes for name in VISIBLE_DEVICES})
        env.update(model.config.env)
        env["GPU_ARBITER_LEASE"] = lease.id
        env["GPU_ARBITER_FENCING_TOKEN"] = str(lease.token)
        command, env = await self._engine_flags(command, env)
        try:
            process = await launcher.start(
                model.name, command, env, lease_id=lease.id,
                grace_s=model.config.grace_s,
            )  # fmt: skip
        except OSError as error:
            why = f"cannot start {command[0]}: {error.strerror or error}"
            self.stop(Ending(EndKind.FAILED, why))
            return None
        self.process = process
        self._by_agent = await self._attach()
        log.info(
            "model %s replica %d: started pid %s on %s port %d (lease %s)",
            model.name, self.number, process.pid, ", ".join(lease.gpus), self.port, lease.id,
        )  # fmt: skip
        return process

    async def _engine_flags(
        self, command: list[str], env: dict[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """The engine's flags for the lease (vLLM's memory fraction, llama.cpp's fit
        target...), from the lease's GPUs as the controller last saw them."""
        gpus = set(self.holding.gpus)
        try:
            workers = await self.parts.leases.workers()
        except (ApiError, ControllerUnreachable):
            workers = []
        found = [g for w in workers for g in w.get("gpus", ()) if g.get("id") in gpus]
        total = max((int(g["total_mb"]) for g in found), default=0)
        free = [int(g["total_mb"]) - int(g["used_mb"] or 0) for g in found]
        if not total:  # not known: the engine's own defaults
            return command, env
        words, changed = self.model.driver.prepare(
            command, env, self.holding.vram_mb, total, free_mb=free
        )
        return list(words), changed

    async def _attach(self) -> bool:
        """Puts the process group under the local agent's supervision: the controller then
        knows its memory is the lease's (I2), and the agent stops it when the lease lapses
        or this gateway is gone. On a revocation the gateway stops it itself, after the
        requests in flight had their grace (``holder_stops_s``: the grace, the wait for
        cut requests and a margin): the agent's own SIGTERM comes only if it has not by
        then, and never before the gateway's own stop (whose SIGKILL follows sooner). A
        process without a group of its own (``pid`` None: an Ollama model, one of several
        in one serve) is not attached: the agent would stop the whole group when this one
        lease is revoked."""
        assert self.process is not None
        if self.process.pid is None:
            return False
        lease = self.holding
        stops_s = self.model.config.grace_s + CUT_WAIT_S + AGENT_MARGIN_S  # its stop comes first
        stops_s = min(stops_s, 3600.0)  # the most the agent takes
        return await self.parts.agent.attach(str(lease.worker), lease.id, self.process.pid, stops_s)

    async def _reap(self, process: ServerProcess) -> None:
        """Waits for the process group to be gone and keeps the exit code. A server that
        exits while it serves ends the replica (one that exits while loading is the
        loader's to judge)."""
        code = await process.wait()
        if process is not self.process:
            return
        self.returncode = code
        self.exited.set()
        self.activity.set()
        if self.ending is None and self.state is not ReplicaState.LOADING:
            self.stop(Ending(EndKind.FAILED, f"the server exited with code {code}{self.tail()}"))
        self.model.notify()

    async def _wait_ready(self, process: ServerProcess) -> str:
        """``ready``, ``port_taken`` (it exited unable to bind), or ``failed`` (ending set).
        With the default ``ready``, ``/health`` answering 404 moves on to ``/v1/models``;
        a path of the config answering 404 is a configuration error, named at once."""
        config, clock = self.model.config, self.parts.clock
        deadline = clock.now() + config.load_timeout_s
        paths = (config.ready,) if config.ready else self.model.driver.ready_paths
        at, poll_s = 0, READY_POLL_FIRST_S
        while self.ending is None:
            if self.exited.is_set():
                return self._exited_while_loading()
            status = await self.parts.health.status(self.port, paths[at])
            if status is not None and 200 <= status < 300:
                return "ready"
            if status == 404 and at + 1 < len(paths):
                at += 1
                continue
            if status == 404:
                self.stop(Ending(EndKind.FAILED, _not_found(paths, config.ready is not None)))
                return "failed"
            if clock.now() > deadline:
                why = f"not ready at {paths[at]} in {config.load_timeout_s:g}s{self.tail()}"
                self.stop(Ending(EndKind.FAILED, why))
                return "failed"
            self.activity.clear()  # set by an ending and by the exit
            await sleep_or(clock.sleep(poll_s), self.activity)
            poll_s = min(READY_POLL_MAX_S, poll_s * 1.5)
        return "failed"

    def _exited_while_loading(self) -> str:
        tail = self.process.tail(TAIL_LINES) if self.process is not None else []
        if any("address already in use" in line.lower() for line in tail):
            return "port_taken"
        code = self.returncode
        self.stop(Ending(EndKind.FAILED, f"the server exited with code {code} while loading" + (
            _last_lines(tail))))  # fmt: skip
        return "failed"

    async def _mark_ready(self) -> bool:
        try:
            self.lease = Lease.of(await self.parts.leases.ready(self.holding.id))
        except (ApiError, ControllerUnreachable) as error:
            self.stop(Ending(EndKind.REVOKED, f"lease lost while loading: {error}"))
            return False
        return True

    def tail(self) -> str:
        return _last_lines(self.process.tail(TAIL_LINES)) if self.process is not None else ""

    # ------------------------------------------------------------------ keep-warm

    async def _keep_warm(self) -> None:
        """Nothing in flight for ``idle_after`` (and ready ``min_resident``): the lease is
        marked idle (a cache the arbiter may reclaim); for ``keep_alive``: the replica
        stops. Both counted from the moment the last request left, re-armed by every
        request; neither while the model is pinned. The model's config is read again
        at each turn: a change in place applies from the next."""
        while self.ending is None:
            config = self.model.config
            if self.model.pinned:
                self.activity.clear()
                await self.activity.wait()
                continue
            if self.in_flight:
                await self._busy_while_others_wait()
                continue
            since, arrivals = self.quiet_since, self.arrivals
            stop_at = since + config.keep_alive_s
            resident_at = (self.ready_at or since) + config.min_resident_s
            idle_after_s = 0.0 if self.extra else config.idle_after_s
            idle_at = max(since + idle_after_s, resident_at)
            if not self._idle_marked and idle_at < stop_at:
                if await self._quiet_until(idle_at):
                    await self.mark_idle(arrivals)
                continue
            if self.tier.wake.is_set():
                failure = await self.tier.wake_up()
                if failure is not None:
                    self.stop(Ending(EndKind.FAILED, failure))
                continue
            sleep_at = self.tier.sleep_at(since)
            if sleep_at is not None and sleep_at < stop_at:
                if await self._quiet_until(sleep_at):
                    await self.tier.fall_asleep(arrivals)
                continue
            if await self._quiet_until(stop_at):
                idle_s = config.keep_alive_s
                self.stop(Ending(EndKind.KEEP_ALIVE, f"idle for {idle_s:g}s (keep_alive)"))
                return

    async def _busy_while_others_wait(self) -> None:
        """Requests in flight: waits for one to come or leave. Meanwhile, once another
        model of this gateway has waited ``swap_after`` for a lease, this one's is marked
        idle although busy (it yields): the other may reclaim it, the requests in flight
        get the grace, and those that came meanwhile were served first."""
        clock = self.parts.clock
        self.activity.clear()
        due = self.model.swap_due(self.priority)
        if due is not None and due <= clock.now() and not self._idle_marked:
            await self._yield_lease()
        left = SWAP_CHECK_S if due is None else due - clock.now()
        wait_s = left if 0 < left < SWAP_CHECK_S else SWAP_CHECK_S
        await sleep_or(clock.sleep(wait_s), self.activity)

    async def _yield_lease(self) -> None:
        async with self._mark:
            if self._idle_marked or self.ending is not None or self.model.pinned:
                return
            with contextlib.suppress(ApiError, ControllerUnreachable):
                await self._mark_all(self.parts.leases.idle)
                self._idle_marked = self._yielding = True
                log.info(
                    "model %s replica %d: reclaimable while busy: another model waited %gs",
                    self.model.name, self.number, self.model.config.swap_after_s,
                )  # fmt: skip

    async def _quiet_until(self, at: float) -> bool:
        """True once ``at`` has come with no request coming or leaving meanwhile (and, for
        an engine whose work runs after its answer, ComfyUI's queue, with the engine not
        busy: its work counts as a request that just left)."""
        self.activity.clear()
        clock, driver = self.parts.clock, self.model.driver
        while (left := at - clock.now()) > 0:
            step = min(left, BUSY_POLL_S) if driver.polls_busy else left
            if await sleep_or(clock.sleep(step), self.activity):
                return False
            if driver.polls_busy and await driver.busy(self.port):
                self.quiet_since = self.last_used = clock.now()
                if self._idle_marked:
                    await self.mark_busy()
                return False
        return True

    async def mark_idle(self, arrivals: int) -> None:
        async with self._mark:
            if self.arrivals != arrivals or self.ending is not None or self.model.pinned:
                return
            leases = self.parts.leases
            with contextlib.suppress(ApiError, ControllerUnreachable):
                await self._mark_all(leases.idle)
                self._idle_marked = True
                if self.arrivals != arrivals:  # one came meanwhile, and did not wait
                    await self._mark_all(leases.busy)
                    self._idle_marked = False

    async def _mark_all(self, mark: Callable[[str], Awaitable[Json]]) -> None:
        """Marks the lease (and the one a wake took back) idle or busy."""
        self.lease = Lease.of(await mark(self.holding.id))
        if self.tier.extra is not None:
            self.tier.extra = Lease.of(await mark(self.tier.extra.id))

    async def _measure(self) -> None:
        """After a load, every ``MEASURE_S`` while the replica serves (once more when it
        stops: see :meth:`_drain`)."""
        while self.ending is None:
            await self.model.measure(self)
            await sleep_or(self.parts.clock.sleep(MEASURE_S), self.ended)

    # ------------------------------------------------------------------ the end

    async def _drain(self) -> None:
        """No new requests; those in flight get the grace to finish, and those still in
        flight after it are cut off (the ending a preemption gives: a 503 naming why, or
        a stream's final error event). Then the process group is stopped: its
        connections closed, SIGTERM once, SIGKILL when it has not exited by the end of
        the grace, or, where the requests took the whole grace, after the engine's short
        ``stop_s``: the grace is given once, never twice."""
        assert self.ending is not None
        grace_s, clock = self.model.config.grace_s, self.parts.clock
        deadline = clock.now() + grace_s
        if self.process is not None and not self.exited.is_set():
            await self.model.measure(self)  # its last figure, for the next lease
        if self.ending.kind.graced:
            while self.in_flight and not self.exited.is_set() and clock.now() < deadline:
                self.activity.clear()
                await sleep_or(clock.sleep(deadline - clock.now()), self.activity)
            await self._cut_relays()
        self.move(ReplicaState.STOPPING)
        self.upstream.close()  # the server sees its clients gone: it stops generating
        if self.process is not None and not self.exited.is_set():
            stop_s = min(self.model.driver.stop_s, grace_s)
            await self._stop_process(self.process, max(stop_s, deadline - clock.now()))

    async def _cut_relays(self) -> None:
        """Cancels the requests still relayed, and waits (briefly) until each has closed
        its connection to the server: a server that still sees its clients may go on
        generating, deaf to SIGTERM."""
        self.cut = bool(self.relays)
        for relay in self.relays:
            relay.cancel("the replica stopped")
        if not self.cut:
            return
        log.info(
            "model %s replica %d: %d request(s) did not finish within the %gs grace",
            self.model.name, self.number, len(self.relays), self.model.config.grace_s,
        )  # fmt: skip
        clock = self.parts.clock
        deadline = clock.now() + CUT_WAIT_S
        while self.relays and clock.now() < deadline:
            self.activity.clear()
            await sleep_or(clock.sleep(deadline - clock.now()), self.activity)

    def relay_ended(self, relay: CancelScope) -> None:
        """A relayed request is over (its connection to the server closed or handed back)."""
        self.relays.discard(relay)
        self.activity.set()

    async def _stop_process(self, process: ServerProcess, wait_s: float) -> None:
        """By the agent where it supervises the process (one SIGTERM, whoever asks), else
        here; SIGKILL here if it has not exited in ``wait_s`` (and a margin for the
        agent's own SIGKILL, which it sends after ``wait_s``)."""
        lease = self.holding
        by_agent = self._by_agent and await self.parts.agent.stop(
            str(lease.worker), lease.id, wait_s
        )
        if not by_agent:
            process.signal(signal.SIGTERM)
        if not await self._exits_within(process, wait_s + (AGENT_MARGIN_S if by_agent else 0.0)):
            name = self.model.name
            log.warning(
                "model %s: pid %s did not exit %gs after SIGTERM: SIGKILL", name, process.pid,
                wait_s,
            )  # fmt: skip
            process.signal(signal.SIGKILL)
            await self._exits_within(process, None)

    async def _exits_within(self, process: ServerProcess, seconds: float | None) -> bool:
        """Waits for the group to be gone (at most ``seconds``); True when it is."""
        waiting = asyncio.ensure_future(process.wait())
        if seconds is not None and await first(waiting, self.parts.clock.sleep(seconds)) == 1:
            return False  # the wait was cancelled, and is over
        self.returncode = await waiting
        self.exited.set()
        return True

    async def _finish(self) -> None:
        """Process gone (or never started) -> release -> ended."""
        if self.process is not None:
            if not self.exited.is_set():  # a failure left it running: stop it now
                await self._stop_process(self.process, self.model.config.grace_s)
            self.parts.launcher.unreserve(self.port)
        for lease in (self.tier.extra, self.lease):
            if lease is not None:
                await self.release(lease.id)
        assert self.ending is not None
        if self.state not in (ReplicaState.QUEUED, ReplicaState.STOPPING):
            # a failure skipped the drain (an exception in its life): stopped all the same
            self.move(ReplicaState.STOPPING, notify=False)
        self.move(ReplicaState.ENDED, notify=False)  # the model is told by ``ended``
        self.model.ended(self)

    async def release(self, lease_id: str) -> None:
        for _ in range(RELEASE_TRIES):
            try:
                await self.parts.leases.release(lease_id)
                return
            except ControllerUnreachable:
                await self.parts.clock.sleep(1.0)
            except ApiError:
                return

    # ------------------------------------------------------------------ the lease

    async def _renew(self) -> None:
        ttl_s = self.holding.ttl_s or 30.0
        while True:
            await self.parts.clock.sleep(max(0.2, ttl_s / 3))
            try:
                await self.parts.leases.renew(self.holding.id)
                if self.tier.extra is not None:
                    await self.parts.leases.renew(self.tier.extra.id)
                if self.process is not None and not self.exited.is_set():
                    self._by_agent = await self._attach()  # a restarted agent learns it again
            except ControllerUnreachable:
                continue  # not lost until the controller says so
            except ApiError as error:
                if error.status in (404, 409):
                    why = f"a lease of replica {self.number} lost: {error}"
                    self.stop(Ending(EndKind.REVOKED, why))
                    return

    async def watch(self, extra: bool = False) -> None:
        """The one watcher of a revocation: a long-poll of the lease (or of the lease of
        what a wake took back), which answers at once when its state is no longer the one
        it last saw."""
        watched = self.tier.extra if extra else self.lease
        assert watched is not None
        lease_id, state = watched.id, watched.state
        while True:
            try:
                lease = Lease.of(await self.parts.leases.lease(lease_id, wait_s=30.0, state=state))
            except ControllerUnreachable:
                await self.parts.clock.sleep(0.5)
                continue
            state = lease.state
            if state == "revoking" or lease.ended_at is not None:
                self.stop(self._revoked(lease))
                return

    def _revoked(self, lease: Lease) -> Ending:
        why = lease.revoke_reason or lease.end_reason or lease.state
        detail = f"lease {lease.id} revoked ({why}"
        if lease.preempted_for:
            detail += f" for {lease.preempted_for}"
        detail += ")"
        if why == "preempted":  # reclaimed: taken as a cache, its lease marked idle
            # the controller's word, not ``_idle_marked``: the revocation can come back
            # before the answer to the idle mark that made it possible
            # a replica that yielded under swap_after is taken as a cache, requests in
            # flight and all (they get the grace)
            marked = lease.idle or self._idle_marked
            cache = marked and (self.in_flight == 0 or self._yielding)
            return Ending(EndKind.RECLAIMED if cache else EndKind.PREEMPTED, detail)
        return Ending(EndKind.REVOKED, detail)

    async def used_mb(self) -> int | None:
        """The GPU memory of the process group now, as the local agent's probe sees it
        (a process without a group of its own: the engine's figure for it)."""
        if self.process is None:
            return None
        if self.process.pid is None:
            return await self.model.driver.used_mb(self.port)
        worker = self.lease.worker if self.lease is not None else None
        return await self.parts.agent.used_mb(str(worker), self.process.pid)


def _first_cause(error: BaseException) -> BaseException:
    """The error a task group's ``ExceptionGroup`` wraps (its first), else ``error``."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def _last_lines(lines: list[str]) -> str:
    shown = [line.strip() for line in lines if line.strip()][-TAIL_LINES:]
    return "; last output: " + " | ".join(shown) if shown else ""


def _not_found(paths: tuple[str, ...], configured: bool) -> str:
    if configured:
        return (
            f"the server answers 404 at ready = {paths[0]!r}: set ready to a path it "
            "answers 2xx at once loaded"
        )
    tried = " and ".join(paths)
    return f"the server answers 404 at {tried}: set ready to a path it answers 2xx at once loaded"
