"""A model's replicas, and how a request gets a slot on one of them.

A request takes a slot on the replica that the replica profile picks
(``profile/rules.py``: an accepting replica with a free slot below ``max_parallel``,
the fewest requests in flight, the first on a tie: the same rule as a host's at the
front door). When there is none, it waits (up to ``queue_timeout``); a new
replica (a new lease) is asked for when the requests waiting outnumber the slots of
the replicas already on their way, up to ``replicas``. A replica that failed (its
server exited, or was not ready in time) makes the model back off before it starts
another: 1 s, doubling per failure in a row up to 60 s, so that a broken server never
holds the GPU's load gate in a loop.

A model's life (:meth:`ModelServer.run`, for the gateway's) owns its replicas' tasks
and ends once it is shut down and every replica has ended; no replica starts after.

An operator may pin a model (its leases always marked busy: never reclaimed as a cache,
never stopped for keep_alive; only a strictly higher priority may preempt it, and only
when it is preemptible: I5) and unpin it, or unload it (its replicas stopped now, those
queued cancelled, and the requests waiting for it refused).

Callers of different importance share one model. A request's priority is its API key's
(``[[gateway.keys]] priority``), else the model's. A replica's lease is asked for at
:meth:`ModelServer.lease_priority`: the model's priority, raised to the highest priority
among the callers waiting when it is asked for. A caller below the model's priority
therefore never lowers its lease (a batch key never makes an interactive model
preemptible: ``preemptible``, unless the model sets it, is the controller's default for
the lease's priority), and a caller above it is not queued behind a lease asked for at
the model's. A replica still queued at a lower priority than a caller who now waits for
it is asked for again at the higher one (its pending lease released first: a queue
position in a lower class is worth nothing in the higher one). A granted lease keeps
its priority (the controller has no verb to raise it): callers of every priority share
the replicas that serve, and only the next replica asked for follows a higher caller.

A running gateway's model set may change (``gateway/live.py``). A model removed is
retired (:meth:`ModelServer.retire`): new requests and those waiting are refused (404,
saying what removed it), its replicas drain (they end once their requests in flight
have left) and its life ends. A change to what the server runs is a new generation of
the model (:meth:`ModelServer.replace`): its replicas are replaced one at a time, each
replica that serves after a new one is ready beside it, so a model that served never
has no replica that serves; new requests go to the new generation's replicas first. Any
other change applies in place (:meth:`ModelServer.update`): the same processes go on,
their timers re-read.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

from ...core import PRIORITY_NAMES, format_s, priority_name
from ..base.clock import sleep_or
from ..base.metrics import GatewayMetrics
from ..profile import Affinity, Ask, Candidate, Memory, profiles
from .config import ModelConfig
from .engines import OFFLINE, driver_for
from .interfaces import FileKeeper, Parts
from .lease import Lease
from .replica import AGENT_MARGIN_S, Replica, ReplicaState
from .states import EndKind, most_advanced

__all__ = ["ModelServer", "Refused"]

log = logging.getLogger("gpu_arbiter.gateway")
_COMING = (ReplicaState.QUEUED, ReplicaState.LOADING, ReplicaState.WAKING)
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
UNLOAD_MARGIN_S = 10.0  # beyond two graces and the agent's margin: the release


def tenths_up(seconds: float) -> float:
    """Seconds left, rounded up to a tenth: 0 only once none is left (a back-off shown
    over while a moment of it remains would be a start refused after 0 s)."""
    return math.ceil(round(max(0.0, seconds) * 10, 6)) / 10  # 0.1000000001 is 0.1


class Grower(Protocol):
    """The cluster, as a model that needs one more replica sees it (``cluster/cluster.py``)."""

    def grow(self, model: ModelServer) -> bool:
        """Asks for one more replica for the cluster; False when no other gateway
        declares the model (this one starts its own)."""


class Refused(Exception):
    """No replica for the request: ``status`` (502, 503), ``reason``, ``retry_after_s``."""

    def __init__(self, status: int, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s


class ModelServer:
    def __init__(
        self,
        config: ModelConfig,
        *,
        parts: Parts,
        metrics: GatewayMetrics,
        worker: str | None,
        vram_mb: int,
    ) -> None:
        self.config = config
        self.name = config.name
        self.parts = parts
        self.clock = parts.clock
        self.driver = driver_for(
            config.engine, parts.engines or OFFLINE, sleep_after_s=config.sleep_after_s,
            sleep_level=config.sleep_level,
        )  # fmt: skip
        self.metrics = metrics
        self._group: asyncio.TaskGroup | None = None  # its replicas' lives, while it runs
        self._unstarted: list[Replica] = []  # asked for before it ran: started when it does
        self._closing = asyncio.Event()
        self.worker = worker
        self.vram_mb = vram_mb
        self.replicas: list[Replica] = []
        self.waiting = 0
        self.neighbours: Mapping[str, ModelServer] = {}  # the gateway's models, this one too
        self.asker: Mapping[str, str] = {}  # which gateway asks (lease metadata; serve.py)
        self.cluster: Grower | None = None  # where other gateways declare it too
        self.affinity: Affinity | None = None  # prefix affinity (serve.py; None: off)
        self._went = Memory()  # a prefix -> the replica it went to last
        self.files: FileKeeper | None = None  # its model file's copy (serve.py; None: none)
        self.copying: str | None = None  # the copy of its file under way, in words
        self._wanting: Counter[int] = Counter()  # the priorities of the callers waiting
        self.failures = 0
        self.failed_at = 0.0
        self.failure: str | None = None
        self.pinned = config.pinned
        self.last_used: float | None = None  # when a request last took a slot
        self._unloads = 0
        self._unloaded_why = "by an operator"
        self._changed = asyncio.Event()
        self._numbers = 0
        self.generation = 0  # bumped by each change to what its server runs (replace)
        self.retired: str | None = None  # removed from the gateway: why
        self._replacing: asyncio.Task[None] | None = None  # the replicas being replaced

    # ------------------------------------------------------------------ life

    async def run(self) -> None:
        """The model's life, for the gateway's: the one owner of its replicas' tasks.
        Returns once :meth:`shutdown` was called and every replica has ended (its lease
        released); cancelled, it cancels them (each still stops its server and releases
        its lease: :meth:`Replica.run`)."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            for replica in self._unstarted:
                group.create_task(replica.run())
            self._unstarted.clear()
            try:
                await self._closing.wait()
            finally:
                self._group = None  # no replica starts from now (cancelled: closed too)
                self._closing.set()

    def _launch(self, replica: Replica) -> bool:
        """Starts ``replica``'s life under the model's (once it runs, if it does not
        yet); False once the model stops: no replica starts then."""
        if self._closing.is_set():
            return False
        replica.generation = self.generation
        self.replicas.append(replica)
        self.metrics.cold_starts.labels(self.name).inc()
        if self._group is None:
            self._unstarted.append(replica)
        else:
            self._group.create_task(replica.run())
        return True

    # ------------------------------------------------------------------ requests

    async def acquire(
        self,
        on_wait: Callable[[], None] | None = None,
        priority: int | None = None,
        body: bytes | bytearray | None = None,
    ) -> tuple[Replica, float]:
        """A replica with a slot taken for the caller, and the seconds it queued.
        Raises :class:`Refused` (503 after ``queue_timeout``, 502 when its start failed).
        ``on_wait`` is called once, when the caller has to wait (not when a slot is free):
        the gateway then tells a streaming caller why (:meth:`waiting_for`). ``priority``:
        the caller's (its key's; None: the model's), which a lease asked for while it
        waits is asked at, if higher than the model's. ``body``: the request's JSON body,
        when held (its prefix, with prefix affinity on: :attr:`affinity`)."""
        prefix = "" if self.affinity is None else self.affinity.prefix(self.name, body)
        started = self.clock.now()
        deadline = started + self.config.queue_timeout_s
        failures_before, unloads_before = self.failures, self._unloads
        wanted = self.config.priority if priority is None else priority
        self.waiting += 1
        self._wanting[wanted] += 1
        try:
            while True:
                if self.retired is not None:
                    raise Refused(404, f"model {self.name} was removed {self.retired}")
                replica = self._free_replica(prefix)
                if replica is not None:
                    if await replica.enter():
                        self.last_used = self.clock.now()
                        return replica, self.clock.now() - started
                    continue
                if self.failures > failures_before and not self._live():
                    raise Refused(502, f"model {self.name}: {self.failure}")
                if self._unloads > unloads_before:
                    raise Refused(503, f"model {self.name} was unloaded {self._unloaded_why}", 1.0)
                self._refuse_while_backing_off()
                self._wake_or_start()
                changed = self._changed
                remaining = deadline - self.clock.now()
                if remaining <= 0:
                    raise Refused(503, self._queue_timeout_reason(), self.config.queue_timeout_s)
                if on_wait is not None:
                    on_wait()
                    on_wait = None
                await sleep_or(self.clock.sleep(remaining), changed)
        finally:
            self.waiting -= 1
            self._wanting[wanted] -= 1
            if not self._wanting[wanted]:
                del self._wanting[wanted]
            if self.waiting == 0:
                for replica in self.replicas:
                    replica.cancel_if_queued()

    def _free_replica(self, prefix: str = "") -> Replica | None:
        """The replica the request takes a slot on now, if one has a free slot (where
        its ``prefix`` went last first, with prefix affinity on)."""
        by_number = {r.number: r for r in self.replicas}
        profile = profiles(self.affinity is not None)[1]
        ask = Ask(self.name, prefix, self._went.get(prefix))
        current = [r for r in self.replicas if r.generation == self.generation]
        picked = profile.pick(ask, [self._figures(r) for r in current]).picked
        if picked is None:  # an older generation's replica while the new one loads
            picked = profile.pick(ask, [self._figures(r) for r in self.replicas]).picked
        if picked is None:
            return None
        self._went.put(prefix, picked.name)
        return by_number[picked.replica]

    def _figures(self, replica: Replica) -> Candidate:
        """A replica as routing reads it."""
        accepting = replica.accepting
        return Candidate(
            "", replica.number, local=True, state=str(replica.state), ready=int(accepting),
            slots=self.config.max_parallel if accepting else 0, in_flight=replica.in_flight,
        )  # fmt: skip

    def _live(self) -> list[Replica]:
        return [r for r in self.replicas if r.live and r.ending is None]

    def _refuse_while_backing_off(self) -> None:
        wait_s = self.backoff_left_s()
        if wait_s > 0 and not self._live():
            raise Refused(
                503,
                f"model {self.name}: {self.failure}; next start in {tenths_up(wait_s)}s",
                wait_s,
            )

    def backoff_left_s(self) -> float:
        if not self.failures:
            return 0.0
        backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** (self.failures - 1))
        return max(0.0, self.failed_at + backoff - self.clock.now())

    def _wake_or_start(self) -> None:
        """A sleeping replica is woken before another is started."""
        asleep = [r for r in self.replicas if r.asleep]
        if asleep:
            for replica in asleep:
                replica.want_awake()
            return
        self._move_up_queued()
        self._start_if_needed()

    def lease_priority(self) -> int:
        """The priority a lease is asked for at now: the model's, or the highest of the
        callers waiting if higher (a lower one never lowers it)."""
        return max(self.config.priority, max(self._wanting, default=0))

    def _move_up_queued(self) -> None:
        """A replica queued at a lower priority than a caller now waiting is asked for
        again, at the higher one (the replica checks it again before it does)."""
        wanted = self.lease_priority()
        for replica in self.replicas:
            if replica.state is ReplicaState.QUEUED and replica.priority < wanted:
                replica.outranked()

    def _start_if_needed(self) -> None:
        holding = [r for r in self.replicas if r.live]  # a stopping one still holds memory
        coming = [r for r in self._live() if r.state in _COMING]
        slots = len(coming) * self.config.max_parallel
        if self.waiting > slots and len(holding) < self.config.replicas:
            if holding and self.cluster is not None and self.cluster.grow(self):
                return  # one more replica for the cluster: the arbiter places it
            self._numbers += 1
            self._launch(Replica(self, self._numbers))

    def adopt(self, lease: Lease) -> Replica | None:
        """Starts a replica under ``lease``, granted to this host for the cluster (a front
        door asked for it: ``cluster/cluster.py``); None when a replica holds it already or it is
        not held any more. The lease is this gateway's from now: it renews, readies and
        releases it."""
        if not lease.held:
            return None
        if any(r.lease_id == lease.id for r in self.replicas):
            return None
        self._numbers += 1
        replica = Replica(self, self._numbers)
        replica.lease = lease
        replica.priority = lease.priority or self.config.priority
        replica.move(ReplicaState.LOADING, notify=False)  # never "queued": nobody's leaving
        # cancels it (the model is told below)
        if not self._launch(replica):
            return None
        log.info(
            "model %s replica %d: adopted the cluster's lease %s on %s",
            self.name, replica.number, lease.id, ", ".join(lease.gpus),
        )  # fmt: skip
        self.notify()
        return replica

    def file_kept(self) -> AbstractContextManager[None]:
        """Its model file kept (never evicted) while a replica of it lives."""
        return nullcontext() if self.files is None else self.files.kept(self)

    async def file_ready(self, replica: Replica) -> bool:
        """Its model file in place before ``replica`` asks for its lease (``files/``)."""
        return True if self.files is None else await self.files.ready(self, replica)

    def holds(self, lease_id: str) -> bool:
        return any(r.lease_id == lease_id and r.live for r in self.replicas)

    def waiting_for(self) -> str:
        """What a request that waits for a slot waits for now, in words: a replica
        loading, else one queued for its lease (the arbiter's reason and the position,
        after the model of this gateway in its way, by name: :meth:`_in_the_way`), else a
        slot on the replicas that serve."""
        live = self._live()
        if self.copying is not None:
            return self.copying
        if any(r.state is ReplicaState.LOADING for r in live):
            return f"loading {self.name}"
        queued = [r for r in live if r.state is ReplicaState.QUEUED]
        if queued:
            return f"queued, {self._queued_text(queued[0])}"
        return f"waiting for a free slot on {self.name} (max_parallel {self.config.max_parallel})"

    def _queued_text(self, replica: Replica) -> str:
        in_the_way = self._in_the_way(replica)
        reason = replica.pending_reason
        return reason if in_the_way is None else f"{in_the_way}; {reason}"

    def _in_the_way(self, replica: Replica) -> str | None:
        """The model of this gateway whose lease the controller names in the way of
        ``replica``'s (its reason's ``blockers``), and when it gives way: a busy one after
        ``swap_after`` (the gateway's own rule, which the controller does not know), an
        idle one by the controller's rule (I5). None: no model of this gateway."""
        reason = replica.lease.reason if replica.lease is not None else {}
        for blocker in reason.get("blockers") or ():
            lease_id = blocker.get("id")
            for other in self.neighbours.values():
                for held in other.replicas:
                    if other is not self and held.live and held.lease_id == lease_id:
                        return other._giving_way(held, blocker, replica)
        return None

    def _giving_way(self, held: Replica, blocker: Mapping[str, Any], waiting: Replica) -> str:
        """``held`` (a replica of this model) in the way of ``waiting``, in words."""
        name, by = f"{self.name!r}", priority_name(waiting.priority)
        own = priority_name(held.priority)
        if held.state not in (ReplicaState.WARM, ReplicaState.BUSY):
            return f"{name} is {held.state} ({own})"
        if not held.lease_idle:
            if self.pinned:
                return f"{name} is pinned ({own}): only a higher priority may preempt it"
            due = self.swap_due(held.priority)
            if due is not None:
                left = format_s(max(0.0, due - self.clock.now()))
                return f"{name} is busy: swapped after {left} more (swap_after)"
            return f"{name} is busy ({own}): swap_after does not swap it out for {by}"
        until, rule = blocker.get("until"), str(blocker.get("rule"))
        if rule == "at_once":
            return f"waiting for idle {name} ({own}): reclaimable by {by} now"
        if until is None:
            return f"waiting for idle {name} ({own}): not reclaimable by {by} ({rule})"
        # the controller's clock now: it took the lease at its submitted_at, when the
        # replica asked for it
        submitted_at = waiting.lease.submitted_at if waiting.lease is not None else None
        controller_now = (submitted_at or 0.0) + (self.clock.now() - waiting.created_at)
        left = format_s(max(0.0, float(until) - controller_now))
        return f"waiting for idle {name} ({own}): reclaimable by {by} in {left} ({rule})"

    async def changed(self) -> None:
        """Returns at the next change of the model's replicas (a state, a pending
        reason, a request left): when what a waiting request waits for may have moved."""
        await self._changed.wait()

    def _queue_timeout_reason(self) -> str:
        """A replica never granted its lease is still queued, with the controller's reason
        (its server never started: it is not "not ready")."""
        after = f"{self.config.queue_timeout_s:g}s"
        queued = [r for r in self.replicas if r.state is ReplicaState.QUEUED]
        if queued:
            why = self._queued_text(queued[0])
            return f"model {self.name} still queued for its lease after {after}: {why}"
        return f"model {self.name} not ready after {after}: {self.state()}"

    # ------------------------------------------------------------------ replicas

    def lease_request(self, number: int) -> dict[str, Any]:
        config = self.config
        host = socket.gethostname()[:100]
        return {
            "vram_mb": self.vram_mb,
            "gpus": config.gpus,
            "priority": self.lease_priority(),
            "preemptible": config.preemptible,  # None: the controller's, for that priority
            "constraints": {"worker": self.worker} if self.worker else {},
            "holder": f"gateway {self.name} #{number}@{host}"[:256],
            "metadata": {"model": self.name, "replica": number, "gateway": host, **self.asker},
            "ttl_s": config.ttl_s,
            "max_wait_s": config.queue_timeout_s,  # nobody waits for it longer
            "load_timeout_s": config.load_timeout_s,
        }

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def queued_since(self) -> float | None:
        """Since when this model's oldest queued replica has waited for its lease."""
        return min(
            (r.created_at for r in self.replicas if r.state is ReplicaState.QUEUED),
            default=None,
        )

    def swap_due(self, priority: int) -> float | None:
        """When a busy replica of priority ``priority`` must become reclaimable for
        another model of this gateway that waits for a lease: ``swap_after`` after the
        longest such wait began (None: no model of equal or higher priority waits). The
        requests for the loaded model that come meanwhile are served first (collation),
        and the others never wait without bound behind a model that is never idle."""
        waits = [
            since
            for other in self.neighbours.values()
            if other is not self and other.lease_priority() >= priority
            and (since := other.queued_since()) is not None
        ]  # fmt: skip
        return min(waits) + self.config.swap_after_s if waits else None

    def loaded(self, replica: Replica, load_s: float) -> None:
        self.failures = 0
        self.metrics.load_seconds.labels(self.name).observe(load_s)
        log.info(
            "model %s replica %d: ready in %.1fs (lease %s)",
            self.name, replica.number, load_s, replica.lease_id,
        )  # fmt: skip

    async def measure(self, replica: Replica) -> None:
        """The replica's memory as the agent's probe last saw it replaces the size asked
        for when it is higher (``vram = "auto"`` only: a given size is the user's)."""
        if self.config.vram is not None:
            return
        used = await replica.used_mb()
        if used is not None and used > self.vram_mb:
            log.info("model %s: measured %d MiB, above %d MiB", self.name, used, self.vram_mb)
            self.vram_mb = used

    def ended(self, replica: Replica) -> None:
        assert replica.ending is not None
        kind, reason = replica.ending.kind, replica.ending.reason
        if kind is EndKind.FAILED:
            self.failures += 1
            self.failed_at = self.clock.now()
            self.failure = reason
        if kind is not EndKind.CANCELLED:
            self.metrics.stops.labels(self.name, kind).inc()
        log.info("model %s replica %d: stopped (%s: %s)", self.name, replica.number, kind, reason)
        self.replicas.remove(replica)
        self.notify()

    def shutdown(self) -> None:
        """Every replica stops (the requests in flight get the grace); :meth:`run`
        returns once they all have ended."""
        self._closing.set()
        for replica in self.replicas:
            replica.shutdown()
        self.notify()

    # ------------------------------------------------------------------ changes

    def retire(self, why: str) -> None:
        """Removed from the gateway (``why``: words after 'removed', such as 'by the
        reload of models.toml at 12:03:04'): the requests waiting, and any that still
        find it, are refused (404); each replica drains (:meth:`Replica.retire`), and
        :meth:`run` returns once they have ended."""
        self.retired = why
        self._closing.set()
        for replica in list(self.replicas):
            replica.retire(f"model {self.name} removed {why}")
        self.notify()

    def update(self, config: ModelConfig) -> None:
        """``config`` differs from the running one in no key of what the server runs:
        applied in place. The replicas' timers look again (keep_alive, idle_after...);
        a pin in ``config`` differing from the running one's is applied by the caller
        (:meth:`pin`, :meth:`unpin`); a queued replica below a raised priority is asked
        for again at it; the leases held keep theirs until the next replica."""
        self.config = config
        self.driver = driver_for(
            config.engine, self.parts.engines or OFFLINE, sleep_after_s=config.sleep_after_s,
            sleep_level=config.sleep_level,
        )  # fmt: skip
        for replica in self.replicas:
            replica.upstream.keep = config.max_parallel  # idle connections kept
            replica.activity.set()
        self._move_up_queued()
        self.notify()

    def replace(self, config: ModelConfig, vram_mb: int, why: str) -> None:
        """What the server runs changed (``config``, its lease's size ``vram_mb``): a new
        generation. New replicas start with it; the older ones are replaced one at a
        time (:meth:`_replace_each`, a task of the model's life)."""
        older = [r for r in self.replicas if r.live and r.ending is None]
        self.update(config)
        self.vram_mb = vram_mb
        self.generation += 1
        self.failures = 0  # the back-off was the old config's
        if self._replacing is not None:  # a change before the last one was through:
            self._replacing.cancel()  # its replicas are older now, replaced in turn
        if self._group is None:  # not running (yet): nothing serves to keep
            for replica in older:
                replica.retire(f"model {self.name} replaced {why}")
            return
        self._replacing = self._group.create_task(self._replace_each(older, why))

    async def _replace_each(self, older: list[Replica], why: str) -> None:
        """One replica at a time: a replica that serves gets a new one beside it first,
        and drains once that one serves (or ends); one that serves nothing (queued,
        loading, asleep) is retired at once, the requests waiting start a new one. A new
        replica that fails ends the replacing: the older ones go on serving, and end as
        any replica does (keep_alive...); the next start is the new config's."""
        for replica in older:
            if self._closing.is_set():
                return
            if replica.accepting:
                new = self._replacement()
                if new is None:
                    return
                await self._until(_started, new)
                if not new.accepting:
                    log.warning(
                        "model %s: its replacement replica %d did not start (%s): the "
                        "older replicas go on serving", self.name, new.number,
                        new.ending.reason if new.ending else new.state,
                    )  # fmt: skip
                    return
                new.replacement = False
            replica.retire(f"model {self.name} replaced {why}")
            await self._until(_gone, replica)

    def _replacement(self) -> Replica | None:
        self._numbers += 1
        replica = Replica(self, self._numbers)
        replica.replacement = True
        return replica if self._launch(replica) else None

    async def _until(self, done: Callable[[Replica], bool], replica: Replica) -> None:
        """Waits, change by change, until ``done(replica)`` or the model is closing."""
        while not done(replica) and not self._closing.is_set():
            changed = self._changed
            await changed.wait()

    # ------------------------------------------------------------------ operators

    async def pin(self) -> None:
        """Pinned from now: a lease marked idle is marked busy at once."""
        self.pinned = True
        for replica in list(self.replicas):
            replica.pin_changed()
        await asyncio.gather(*(replica.mark_busy() for replica in list(self.replicas)))
        self.notify()

    def unpin(self) -> None:
        """Unpinned: idle_after and keep_alive count again, from now."""
        self.pinned = False
        for replica in self.replicas:
            replica.pin_changed()
        self.notify()

    async def unload(self, why: str = "by an operator") -> dict[str, Any]:
        """Stops every replica now (a queued one is cancelled; the requests in flight
        get the grace) and refuses the requests waiting for one, saying ``why`` (words
        after 'unloaded': an operator's, or a drain's); returns once they have ended
        (their leases released), or after two graces and margins if not."""
        live = self._live()
        for replica in live:
            replica.unload(why)
        self._unloads += 1
        self._unloaded_why = why
        self.notify()
        cancelled = sum(
            1 for r in live if r.ending is not None and r.ending.kind is EndKind.CANCELLED
        )
        deadline = self.clock.now() + 2 * self.config.grace_s + AGENT_MARGIN_S + UNLOAD_MARGIN_S
        while any(r in self.replicas for r in live) and self.clock.now() < deadline:
            await sleep_or(self.clock.sleep(deadline - self.clock.now()), self._changed)
        left = sum(1 for r in live if r in self.replicas)
        return {
            "id": self.name,
            "stopped": len(live) - cancelled,
            "cancelled": cancelled,
            "still_stopping": left,
            "state": self.state(),
        }

    def preemptible_by(self) -> str | None:
        """Who may take the model's GPU while its lease is busy (always, when pinned):
        a strictly higher base priority, if the model is preemptible (I5); of its
        replicas, the one whose lease was asked for at the lowest priority."""
        priority = min((r.priority for r in self._live()), default=self.config.priority)
        preemptible = self.config.preemptible
        if preemptible is None:  # the controller's default
            preemptible = priority < PRIORITY_NAMES["interactive"]
        return f"priority above {priority}" if preemptible else None

    # ------------------------------------------------------------------ state

    def state(self) -> str:
        """The most advanced replica's state (``MODEL_STATES``); with none, ``failed``
        when the last one failed (it could not start, was not ready in time, or its
        server exited: :attr:`failure`) and no start loaded since, else ``cold``."""
        states = (str(r.state) for r in self.replicas if r.state is not ReplicaState.ENDED)
        found = most_advanced(states)
        if found is not None:
            return found
        return "failed" if self.failures else "cold"

    def describe(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "id": self.name,
            "object": "model",
            "owned_by": "gpu-arbiter",
            "state": self.state(),
            "aliases": list(self.config.aliases),
            "vram_mb": self.vram_mb,
            "gpus": self.config.gpus,
            "max_parallel": self.config.max_parallel,
            "priority": self.config.priority,
            "held_mb": sum(_held_mb(r) for r in self.replicas),
            "in_flight": sum(r.in_flight for r in self.replicas),
            "queued": self.waiting,
            "last_used_ago_s": self._last_used_ago_s(),
            "pinned": self.pinned,
            "preemptible_by": self.preemptible_by(),
            "file": None if self.config.file is None else self.config.file.name,
            "replicas": [_replica(r) for r in self.replicas],
        }
        queued = [r for r in self.replicas if r.state is ReplicaState.QUEUED]
        if queued:
            found["pending_reason"] = self._queued_text(queued[0])
        if found["state"] == "failed":
            left = self.backoff_left_s()
            found["failure"] = self.failure
            found["retry_at"] = round(time.time() + left, 3)  # the wall clock's, unix time
            found["retry_in_s"] = tenths_up(left)
        return found

    def _last_used_ago_s(self) -> float | None:
        """Seconds since a request last came or left: 0 while one is in flight (in use
        now); None: never since the start."""
        if any(r.in_flight for r in self.replicas):
            return 0.0
        if self.last_used is None:
            return None
        served = (ReplicaState.WARM, ReplicaState.BUSY, ReplicaState.ASLEEP, ReplicaState.WAKING)
        last = max([self.last_used, *(r.last_used for r in self.replicas if r.state in served)])
        return round(max(0.0, self.clock.now() - last), 1)


def _started(replica: Replica) -> bool:
    """Serving, or never will: ended, or ending."""
    return replica.accepting or replica.ending is not None or not replica.live


def _gone(replica: Replica) -> bool:
    return not replica.live


def _held_mb(replica: Replica) -> int:
    """The memory its lease holds on all its GPUs (0 while queued)."""
    lease = replica.lease
    if replica.state is ReplicaState.QUEUED or lease is None or not lease.gpus:
        return 0
    return lease.vram_mb * len(lease.gpus)


def _replica(replica: Replica) -> dict[str, Any]:
    found: dict[str, Any] = {
        "state": str(replica.state),
        "in_flight": replica.in_flight,
        "lease": replica.lease_id,
        "lease_idle": replica.lease_idle,
        "priority": replica.priority,
        "gpus": None if replica.lease is None else list(replica.lease.gpus),
        "pid": replica.pid,
    }
    if replica.draining:
        found["draining"] = True
    left = replica.keep_alive_left_s()
    if left is not None:
        found["keep_alive_left_s"] = round(left, 1)
    return found
