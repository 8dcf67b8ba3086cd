"""``Controller``: the decision core driven for a whole cluster, with durable state.

It is the service's one authority: every change — a request, a release, a
heartbeat, a drain, a timer — runs in one *change*::

    now = clock()
    apply the event to the core          (Scheduler: submit, release, drain ...)
    core.decide(now)                     (grants, revocations, expiries, drains)
    one store transaction                (leases + worker statuses + events + counters)
    wake long-polls and event streams

and the caller is answered only after the transaction committed. Changes run
one at a time on the event loop (they never await), so no reader ever sees a
lease table and a worker status that disagree. The only timer is one
``call_at`` for the earliest of the core's next deadline and the next
heartbeat deadline: nothing polls.

One rule for every failure: memory and store are never left apart. When a change
cannot be encoded or stored — any exception, not only a :class:`StoreError` — or
fails half-applied (a bug, an interruption), the controller drops what it held in
memory and *reloads* what the store holds, as ``start()`` does (without a new
term); the caller gets the error (503 ``unavailable`` for a store failure) and
nothing was acknowledged. The event sequence advances only with a stored commit,
so ``last_event_seq`` is never ahead of the events it can return. After a reload
the controller keeps serving; GPUs of agents are unknown again (no grants there)
until each agent's next heartbeat. If the store cannot be read either, the
controller refuses every change (503, and ``/readyz`` says why) and retries the
reload, backing off up to :data:`RELOAD_RETRY_MAX_S`, until it succeeds. A commit
refused because another controller leads (:class:`~.store.Fenced`) reloads too,
then refuses changes until this controller is demoted.

Roles, when several controllers share one store (PostgreSQL)::

    standby ──start()──▶ leader ──demote()──▶ standby
       ▲ │                 (its term ended,     │
       └─┘ mirror()         or it was fenced)   ▼
     (reload what the leader committed)      mirror()

A *standby* holds a read-only copy of what the leader committed (``mirror()``
reloads it): reads are answered from it, every change raises
:class:`NotLeader`, and no timer runs. ``start()`` makes a controller the
leader: it reloads the acknowledged state, so a new leader continues the fencing
tokens and leases of the old one exactly where its last commit left them.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import itertools
import logging
import secrets
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from .core import (
    ArbiterError,
    Conflict,
    Constraints,
    Decisions,
    Gpu,
    GpuFigures,
    GpuId,
    GpuProbe,
    Lease,
    LeaseState,
    NotFound,
    PendingReason,
    Policy,
    Request,
    Scheduler,
    Unschedulable,
    Worker,
    WorkerStatus,
    format_mb,
)
from .fanout import Fanout
from .store import (
    Batch,
    Event,
    Fenced,
    LeaseRecord,
    OperationRecord,
    OperationStep,
    Snapshot,
    Store,
    StoreError,
    WorkerRecord,
)

__all__ = [
    "Controller",
    "DrainOutcome",
    "GpuProbeReport",
    "Histogram",
    "Limits",
    "NotLeader",
    "PendingView",
    "ServiceUnavailable",
    "TooManyRequests",
]

log = logging.getLogger("gpu_arbiter.controller")

_LIVE = (LeaseState.PENDING, LeaseState.LOADING, LeaseState.ACTIVE, LeaseState.REVOKING)


class TooManyRequests(ArbiterError):
    """A limit on pending requests was reached; retry later."""

    code = "too_many_requests"


class ServiceUnavailable(ArbiterError):
    """The controller cannot accept changes (its store failed, or it is stopping)."""

    code = "unavailable"


class NotLeader(ServiceUnavailable):
    """This controller is a standby: changes go to the leader (``leader``, when known)."""

    code = "not_leader"


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one caller can make the controller hold."""

    max_pending: int = 10_000
    max_pending_per_token: int = 1_000
    max_pending_per_holder: int = 1_000
    max_gpus_per_worker: int = 64
    max_workers: int = 10_000
    recent_final_leases: int = 10_000
    event_buffer: int = 10_000


@dataclass(frozen=True, slots=True)
class PendingView:
    position: int
    effective_priority: int
    reason: PendingReason


@dataclass(frozen=True, slots=True)
class DrainOutcome:
    """What a drain (or cancel, or removal) did: previous and new state, how many leases
    it revoked, how many were already being revoked, how many had already ended."""

    worker: str
    previous_state: str
    state: str
    revoked: int = 0
    already_revoking: int = 0
    already_finished: int = 0
    leases_left: int = 0


@dataclass(frozen=True, slots=True)
class GpuProbeReport:
    """One GPU's reading in a heartbeat."""

    index: int
    used_mb: int
    lease_used_mb: Mapping[str, int] | None = None


RELOAD_RETRY_MAX_S = 10.0
"""The longest wait between two attempts to reload from a store that could not be read."""

UPDATE_TIMEOUT_S = 3600.0
"""How long an update may take, drain included, unless the admin says otherwise."""

WAIT_BOUNDS_S = (0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0)
GRANT_LATENCY_BOUNDS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(slots=True)
class Histogram:
    """Counts of observed seconds by upper bound (the last count: above every bound),
    since this start."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total_s: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += times
        self.total_s += seconds * times


@dataclass(slots=True)
class _Change:
    now: float
    leases: set[str] = field(default_factory=set)
    ended: dict[str, LeaseRecord] = field(default_factory=dict)
    workers: set[str] = field(default_factory=set)
    removed_workers: set[str] = field(default_factory=set)
    events: list[tuple[str, str | None, str | None, dict[str, Any]]] = field(default_factory=list)
    operations: dict[str, OperationRecord] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    grants: int = 0
    waited_s: list[float] = field(default_factory=list)  # of each grant, once stored

    def event(
        self, kind: str, lease_id: str | None = None, worker: str | None = None, **data: Any
    ) -> None:
        self.events.append((kind, lease_id, worker, data))


class _PendingCounts(Counter[tuple[str, str]]):
    """Pending requests by (owner, holder), and their totals by owner, kept as they
    change: the per-token limit is one look-up."""

    def __init__(self) -> None:
        super().__init__()
        self.by_owner: Counter[str] = Counter()

    def __setitem__(self, key: tuple[str, str], value: int) -> None:
        self.by_owner[key[0]] += value - self[key]
        super().__setitem__(key, value)

    def clear(self) -> None:
        super().clear()
        self.by_owner.clear()


class Controller:
    EVENT_FLUSH_S = 0.05
    """Event streams are woken at most this often: one wake carries every event since."""
    EVENT_TICK_S = 7.5
    """Event streams are woken at least this often (an idle one sends a keep-alive)."""

    def __init__(
        self,
        store: Store,
        *,
        policy: Policy | None = None,
        limits: Limits | None = None,
        heartbeat_timeout_s: float = 15.0,
        simulated: Sequence[Gpu] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.policy = policy or Policy()
        self.limits = limits or Limits()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._simulated = tuple(simulated)
        self._clock = clock
        self.scheduler = Scheduler(self.policy)
        self.broken: str | None = None
        self.started = False
        self.standby = False
        self.leader_url: str | None = None
        self.wait_times = Histogram(WAIT_BOUNDS_S)  # submitted -> granted
        self.grant_latency = Histogram(GRANT_LATENCY_BOUNDS_S)  # change start -> grant stored
        self._records: dict[str, LeaseRecord] = {}
        self._recent: OrderedDict[str, LeaseRecord] = OrderedDict()
        self._keys: dict[tuple[str, str], str] = {}
        self._pending_by_holder = _PendingCounts()
        self._workers: dict[str, WorkerRecord] = {}
        self._operations: dict[str, OperationRecord] = {}
        self._seen: dict[str, float] = {}
        self._offline_heap: list[tuple[float, str]] = []
        self._meta: dict[str, int] = {}
        self._event_seq = 0
        self._events: deque[Event] = deque(maxlen=self.limits.event_buffer)
        self._event_fanout = Fanout(min_interval_s=self.EVENT_FLUSH_S, tick_s=self.EVENT_TICK_S)
        self._lease_changed: dict[str, asyncio.Event] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._reload_retry: asyncio.TimerHandle | None = None
        self._reload_delay_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stopping = asyncio.Event()

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Loads the acknowledged state and starts the timer: this controller leads.
        Call on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._stop_timer()
        snapshot = self.store.load()
        self._rebuild(snapshot)
        self.standby = False
        self.leader_url = None
        self.broken = None
        with self._change() as change:
            self._restore_leases(snapshot.leases, change)
            self._renew_restored(change)
            if self._simulated:
                self._put_simulated(change)
            change.event("controller.started", leases=len(self.scheduler.leases))
        self.started = True
        self._wake_waiters(events=False)  # long-polls a standby held ask again, now of a leader

    def mirror(self, leader_url: str | None = None) -> None:
        """Standby: reloads what the leader committed, for reads; changes raise
        :class:`NotLeader` (naming ``leader_url``). Commits nothing, runs no timer."""
        self._loop = asyncio.get_running_loop()
        self._stop_timer()
        self.started = False
        self.standby = True
        self.leader_url = leader_url
        snapshot = self.store.load()  # a StoreError leaves the last copy: still a standby
        self.broken = None  # what was not committed is gone with the reload
        before = self._event_seq
        self._rebuild(snapshot)
        self._restore_leases(snapshot.leases, _Change(self._clock()))  # nothing is written
        self._wake_waiters(events=self._event_seq != before)

    def demote(self, leader_url: str | None = None) -> None:
        """The leader's term is over (or it was fenced): it becomes a standby at once
        (changes raise :class:`NotLeader`), then reloads what was committed; what it
        held in memory but could not commit is dropped."""
        log.warning("no longer the leader; continuing as a standby")
        self._wake_waiters(events=True)
        self.mirror(leader_url)  # a standby before it loads: a failed load leaves one

    def close(self) -> None:
        self.stopping.set()
        self._wake_waiters(events=True)  # event streams and long-polls answer now
        self._stop_timer()
        self.started = False

    def _rebuild(self, snapshot: Snapshot) -> None:
        """Replaces the in-memory state by ``snapshot``'s workers and counters (leases
        are restored by the caller, which decides whether that is a change)."""
        now = self._clock()
        meta = dict(snapshot.meta)
        self.scheduler = Scheduler(
            self.policy, next_token=meta.get("next_token", 1), next_seq=meta.get("next_seq", 1)
        )
        self._records.clear()
        self._recent.clear()
        self._keys.clear()
        self._pending_by_holder.clear()
        self._workers.clear()
        self._seen.clear()
        self._offline_heap.clear()
        self._meta = meta
        if self._event_seq != snapshot.last_event_seq or not self._events:
            self._event_seq = snapshot.last_event_seq
            self._events.clear()
            self._events.extend(self.store.events_after(max(0, self._event_seq - 1000), 1000))
        if meta.get("paused"):
            self.scheduler.pause()
        self._operations = {op.id: op for op in snapshot.operations}
        for worker in snapshot.workers:
            self._restore_worker(worker, now)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_at = None
        if self._reload_retry is not None:
            self._reload_retry.cancel()
            self._reload_retry = None

    def _wake_waiters(self, *, events: bool) -> None:
        for waiter in self._lease_changed.values():
            waiter.set()
        self._lease_changed.clear()
        if events:
            self.wake_event_streams()

    def _restore_worker(self, record: WorkerRecord, now: float) -> None:
        name = record.name
        self.scheduler.put_worker(Worker(name, record.status, record.labels), record.gpus)
        self._workers[name] = record
        if record.simulated:
            return
        for gpu in record.gpus:  # memory unknown until the worker reports again
            self.scheduler.set_probe(gpu.id, None)
        self._expect_heartbeat(name, now)
        if record.status is WorkerStatus.DRAINING and record.drain_deadline is not None:
            self.scheduler.drain(name, now, deadline_s=max(0.0, record.drain_deadline - now))

    def _restore_leases(self, records: Sequence[LeaseRecord], change: _Change) -> None:
        held = sorted((r.lease.token, r.lease, r) for r in records if r.lease is not None)
        for _, lease, record in held:
            try:
                self.scheduler.restore_lease(lease)
            except (ArbiterError, KeyError) as error:
                log.warning("lease %s cannot be restored (%s); ending it", record.id, error)
                self._end(change, record, LeaseState.EXPIRED, "gpu_gone")
                continue
            self._remember(record)
        pending = sorted((r for r in records if r.lease is None), key=lambda r: r.request.seq)
        for record in pending:
            try:
                self.scheduler.submit(record.request, record.request.submitted_at)
            except Unschedulable as error:
                self._end(change, record, LeaseState.REJECTED, error.reason.code)
                continue
            self._remember(record)
            self._pending_by_holder[self._holder_key(record)] += 1

    def _renew_restored(self, change: _Change) -> None:
        """No holder could renew while no controller led (a restart, a failover): each
        restored lease gets at least its TTL from now, so that none lapses for the outage
        and frees memory its holder still uses (I4). A dead holder's lapses one TTL later."""
        for lease in list(self.scheduler.leases.values()):
            ttl = lease.request.ttl_s
            if ttl is not None and lease.expires_at < change.now + ttl:
                self.scheduler.extend(lease.id, change.now + ttl)  # a revoked one too
                change.leases.add(lease.id)

    def _put_simulated(self, change: _Change) -> None:
        name = self._simulated[0].worker
        existing = self._workers.get(name)
        status = existing.status if existing is not None else WorkerStatus.ONLINE
        record = WorkerRecord(
            name=name,
            status=status,
            gpus=self._simulated,
            url="simulated",
            agent_version="simulated",
            registered_at=existing.registered_at if existing else change.now,
            simulated=True,
        )
        self.scheduler.put_worker(Worker(name, status), self._simulated)
        self._workers[name] = record
        change.workers.add(name)
        if existing is None:
            change.event("worker.registered", worker=name, gpus=len(self._simulated))

    # ------------------------------------------------------------------ leases

    def submit(
        self, owner: str | None, fields: Mapping[str, Any], constraints: Mapping[str, Any]
    ) -> tuple[LeaseRecord, bool]:
        """Queues a request and runs a cycle. Returns the record and whether it is new
        (False: an earlier request with the same idempotency key). Raises
        :class:`Unschedulable` when no known GPU could ever satisfy it."""
        self._check_available()
        request = Request.build(
            f"lease-{secrets.token_hex(8)}",
            constraints=Constraints.build(**constraints),
            **fields,
        )
        if request.idempotency_key is not None:
            earlier = self._by_key(owner, request.idempotency_key)
            if earlier is not None:
                return self._replay(earlier, request), False
        self._check_limits(owner, request)
        record = LeaseRecord(request=request, state=LeaseState.PENDING, owner=owner)
        with self._change() as change:
            queued = self.scheduler.submit(request, change.now)
            record = replace(record, request=queued)
            self._remember(record)
            self._pending_by_holder[self._holder_key(record)] += 1
            change.leases.add(record.id)
            change.event(
                "lease.requested",
                record.id,
                vram_mb=request.vram_mb,
                gpus=request.gpus,
                priority=request.priority,
                holder=request.holder,
            )
        return self.lease(record.id), True

    def _replay(self, earlier: LeaseRecord, request: Request) -> LeaseRecord:
        mine = (request.vram_mb, request.gpus, request.priority, request.constraints)
        theirs = (
            earlier.request.vram_mb,
            earlier.request.gpus,
            earlier.request.priority,
            earlier.request.constraints,
        )
        if mine != theirs or request.holder != earlier.request.holder:
            raise Conflict(
                f"idempotency_key {request.idempotency_key!r} was used for a different request",
                lease_id=earlier.id,
            )
        return earlier

    def _by_key(self, owner: str | None, key: str) -> LeaseRecord | None:
        lease_id = self._keys.get((owner or "", key))
        if lease_id is not None:
            return self.lease(lease_id)
        return self.store.lease_by_key(owner, key)

    def _check_limits(self, owner: str | None, request: Request) -> None:
        """Refuses a request past the per-token, then the global, then the per-holder
        limit on pending requests. A token is the caller's authenticated identity (with
        auth off every caller is one: ``anonymous``), so no name the caller picks can
        take a share of another caller's limit."""
        holder = self._holder_key(LeaseRecord(request, LeaseState.PENDING, owner))
        counts = (
            ("max_pending_per_token", self._pending_by_holder.by_owner[holder[0]]),
            ("max_pending", len(self.scheduler.queue)),
            ("max_pending_per_holder", self._pending_by_holder[holder]),
        )
        for name, current in counts:
            value = getattr(self.limits, name)
            if current >= value:
                raise TooManyRequests(
                    f"{current} requests are already pending ({name} is {value}); retry later",
                    limit=name,
                    value=value,
                    current=current,
                )

    @staticmethod
    def _holder_key(record: LeaseRecord) -> tuple[str, str]:
        return (record.owner or "", record.request.holder)

    def lease(self, lease_id: str) -> LeaseRecord:
        """The current record of a lease, live or ended. Raises NotFound."""
        record = self._records.get(lease_id)
        if record is not None:
            return self._current(record)
        record = self._recent.get(lease_id) or self.store.lease(lease_id)
        if record is None:
            raise NotFound(f"no lease {lease_id!r}", lease_id=lease_id)
        return record

    def leases(
        self,
        *,
        state: LeaseState | None = None,
        worker: str | None = None,
        holder: str | None = None,
    ) -> list[LeaseRecord]:
        """Live leases, and recently ended ones, oldest first."""
        found = [self._current(r) for r in self._records.values()]
        found += list(self._recent.values())
        return sorted(
            (
                r
                for r in found
                if (state is None or r.state is state)
                and (worker is None or r.worker == worker)
                and (holder is None or r.request.holder == holder)
            ),
            key=lambda r: r.request.seq,
        )

    def pending_view(self, lease_id: str) -> PendingView | None:
        if lease_id not in self.scheduler.queue:
            return None
        now = self._clock()
        for position, request, effective in self.scheduler.pending(now):
            if request.id == lease_id:
                return PendingView(position, effective, self.scheduler.explain(lease_id, now))
        return None

    def positions(self) -> dict[str, tuple[int, int]]:
        """Every pending request's (position, effective priority), in one pass."""
        now = self._clock()
        return {r.id: (pos, eff) for pos, r, eff in self.scheduler.pending(now)}

    def queue(self, limit: int = 100) -> list[tuple[LeaseRecord, PendingView]]:
        """The first ``limit`` pending requests in order, each with its reason."""
        now = self._clock()
        return [
            (
                self._current(self._records[request.id]),
                PendingView(position, effective, self.scheduler.explain(request.id, now)),
            )
            for position, request, effective in itertools.islice(self.scheduler.pending(now), limit)
        ]

    def renew(self, lease_id: str, ttl_s: float | None = None) -> LeaseRecord:
        return self._held_verb(lease_id, "renew", ttl_s)

    def ready(self, lease_id: str) -> LeaseRecord:
        return self._held_verb(lease_id, "ready")

    def set_idle(self, lease_id: str, idle: bool) -> LeaseRecord:
        return self._held_verb(lease_id, "idle" if idle else "busy")

    def _held_verb(self, lease_id: str, verb: str, ttl_s: float | None = None) -> LeaseRecord:
        self._check_available()
        held = self.scheduler.leases.get(lease_id)
        if held is not None and held.expires_at <= self._clock():
            with self._change():  # its TTL lapsed just before its timer ran: run it first
                pass
        record = self.lease(lease_id)
        if lease_id not in self.scheduler.leases:
            raise Conflict(
                f"lease {lease_id} is {record.state}, not held",
                lease_id=lease_id,
                state=str(record.state),
            )
        with self._change() as change:
            scheduler = self.scheduler
            if verb == "renew":
                scheduler.renew(lease_id, change.now, ttl_s)
            elif verb == "ready":
                if scheduler.leases[lease_id].loading:
                    change.event("lease.ready", lease_id)
                scheduler.ready(lease_id, change.now)
            else:
                if scheduler.leases[lease_id].idle != (verb == "idle"):
                    change.event(f"lease.{verb}", lease_id)
                scheduler.set_idle(lease_id, verb == "idle", change.now)
            change.leases.add(lease_id)
        return self.lease(lease_id)

    def release(self, lease_id: str) -> LeaseRecord:
        """Releases a held lease, cancels a pending one; an ended one is returned as is."""
        self._check_available()
        record = self.lease(lease_id)
        if record.state.is_final:
            return record
        with self._change() as change:
            if lease_id in self.scheduler.queue:
                self.scheduler.cancel(lease_id)
                self._end(change, record, LeaseState.CANCELLED, "cancelled")
            else:
                ended = self.scheduler.release(lease_id, change.now)
                self._end(change, record, LeaseState.RELEASED, "released", ended)
        return self.lease(lease_id)

    def revoke(self, lease_id: str, reason: str = "revoked_by_admin") -> LeaseRecord:
        self._check_available()
        record = self.lease(lease_id)
        if lease_id not in self.scheduler.leases:
            raise Conflict(f"lease {lease_id} is {record.state}, not held", state=str(record.state))
        with self._change() as change:
            lease = self.scheduler.revoke(lease_id, reason, change.now)
            self._revoked(change, [lease])
        return self.lease(lease_id)

    # ------------------------------------------------------------------ workers

    def workers(self) -> list[WorkerRecord]:
        return [self._worker_now(name) for name in sorted(self._workers)]

    def worker(self, name: str) -> WorkerRecord:
        if name not in self._workers:
            raise NotFound(f"no worker {name!r}", worker=name)
        return self._worker_now(name)

    def worker_leases(self, name: str) -> list[Lease]:
        """The held leases on a worker, by fencing token."""
        leases = self.scheduler.leases
        return sorted(
            (leases[i] for i in self.scheduler.worker_lease_ids(name)), key=lambda x: x.token
        )

    def gpu_figures(self, name: str) -> list[GpuFigures]:
        return [self.scheduler.figures(g) for g in self.scheduler.gpu_ids(name)]

    def last_seen(self, name: str) -> float | None:
        return self._seen.get(name)

    def register(
        self,
        name: str,
        gpus: Sequence[Gpu],
        *,
        labels: Mapping[str, str] | None = None,
        url: str = "",
        agent_version: str = "",
        simulated: bool = False,
    ) -> tuple[WorkerRecord, bool]:
        """Registers a worker, or updates a known one (its GPUs, labels, version).
        ``simulated``: its agent's GPUs are simulated."""
        self._check_available()
        existing = self._workers.get(name)
        if existing is None and len(self._workers) >= self.limits.max_workers:
            raise TooManyRequests(
                f"{len(self._workers)} workers are registered (the limit)",
                limit="max_workers",
                value=self.limits.max_workers,
                current=len(self._workers),
            )
        if existing is not None and existing.simulated:
            raise Conflict(f"worker {name} is simulated by this controller")
        with self._change() as change:
            status = (
                WorkerStatus.ONLINE if existing is None else self.scheduler.workers[name].status
            )
            self.scheduler.put_worker(Worker(name, status, dict(labels or {})), gpus)
            record = WorkerRecord(
                name=name,
                status=status,
                gpus=tuple(gpus),
                labels=dict(labels or {}),
                url=url,
                agent_version=agent_version,
                registered_at=change.now if existing is None else existing.registered_at,
                drain_deadline=None if existing is None else existing.drain_deadline,
                status_after_offline=(
                    WorkerStatus.ONLINE if existing is None else existing.status_after_offline
                ),
                simulated_gpus=simulated,
            )
            self._workers[name] = record
            change.workers.add(name)
            data: dict[str, Any] = {"gpus": len(gpus), "agent_version": agent_version}
            over = self._overcommitted(name)
            if over:
                data["overcommitted_mb"] = over
            change.event("worker.registered", worker=name, **data)
            self._seen_now(name, change)
            self._update_restarted(change, name, agent_version)
        return self.worker(name), existing is None

    def _overcommitted(self, name: str) -> dict[str, int]:
        """GPUs registered smaller than their leases (accepted, so that the worker can come
        back, e.g. after a driver change; they get no grant until back under capacity)."""
        over = {}
        for figures in self.gpu_figures(name):
            if figures.overcommitted_mb:
                over[str(figures.gpu.id)] = figures.overcommitted_mb
                log.warning(
                    "GPU %s registered with %d MiB of capacity under %d MiB of leases: "
                    "over-committed; no grant there until its leases fit",
                    figures.gpu.id,
                    figures.gpu.capacity_mb,
                    figures.committed_mb,
                )
        return over

    def heartbeat(
        self,
        name: str,
        probes: Sequence[GpuProbeReport] = (),
        *,
        stopped: Sequence[str] = (),
        stale: Sequence[int] = (),
        supervised: Sequence[str] | None = None,
    ) -> WorkerRecord:
        """A worker's probe snapshot, the leases whose processes it saw stop, and the GPUs
        its probe could not read (``stale``: no grants there until they read again).

        ``supervised``: the leases whose running processes the agent watches (None: it
        says nothing of them). Such a lease is not freed when its TTL lapses but revoked,
        and its memory stays committed until the agent reports its process stopped (I4);
        a lease the agent no longer lists falls back to its TTL."""
        self._check_available()
        record = self.worker(name)
        if record.simulated:
            raise Conflict(f"worker {name} is simulated by this controller")
        known = set(self.scheduler.gpu_ids(name))
        for index in [p.index for p in probes] + list(stale):
            if GpuId(name, index) not in known:
                raise NotFound(f"worker {name} has no GPU {index}; register it first")
        ending = [
            lid for lid in dict.fromkeys(stopped) if lid in self.scheduler.worker_lease_ids(name)
        ]
        changed = self._apply_probes(name, probes)
        for index in stale:
            changed |= not self.scheduler.figures(GpuId(name, index)).stale
            self.scheduler.set_probe(GpuId(name, index), None)
        changed = changed and len(self.scheduler.queue) > 0
        offline = self.scheduler.workers[name].status is WorkerStatus.OFFLINE
        watched = self._supervision_changes(name, supervised, ending)
        if not (changed or ending or offline or watched):  # a reading matters to pending work
            self._seen[name] = self._clock()  # nothing to decide, nothing to persist
            self._push_offline_deadline(name, self._seen[name])
            return record
        with self._change() as change:
            self._seen_now(name, change)
            for lease_id, watched_now in watched.items():
                self.scheduler.set_supervised(lease_id, watched_now, change.now)
                change.leases.add(lease_id)
            for lease_id in ending:
                ended = self.scheduler.release(lease_id, change.now)
                self._end(
                    change, self._records[lease_id], LeaseState.RELEASED, "holder_stopped", ended
                )
        return self.worker(name)

    def _supervision_changes(
        self, name: str, supervised: Sequence[str] | None, ending: Sequence[str]
    ) -> dict[str, bool]:
        """The worker's leases whose ``supervised`` flag the heartbeat changes."""
        if supervised is None:
            return {}
        watched = set(supervised) - set(ending)
        changes = {}
        for lease_id in self.scheduler.worker_lease_ids(name):
            now_watched = lease_id in watched
            if self.scheduler.leases[lease_id].supervised != now_watched:
                changes[lease_id] = now_watched
        return changes

    def _apply_probes(self, name: str, probes: Sequence[GpuProbeReport]) -> bool:
        changed = False
        for report in probes:
            gpu_id = GpuId(name, report.index)
            figures = self.scheduler.figures(gpu_id)
            lease_used = None if report.lease_used_mb is None else dict(report.lease_used_mb)
            self.scheduler.set_probe(gpu_id, GpuProbe(report.used_mb, lease_used))
            changed |= figures.used_mb != report.used_mb or figures.stale or lease_used is not None
        return changed

    def _seen_now(self, name: str, change: _Change) -> None:
        """A sign of life: an offline worker comes back (draining if it was)."""
        self._seen[name] = change.now
        self._push_offline_deadline(name, change.now)
        worker = self.scheduler.workers[name]
        if worker.status is not WorkerStatus.OFFLINE:
            return
        back = self._workers[name].status_after_offline
        self.scheduler.set_worker_status(name, WorkerStatus.ONLINE)
        if back is WorkerStatus.DRAINING:
            self.scheduler.drain(name, change.now)
        change.workers.add(name)
        change.event("worker.online", worker=name, previous="offline", state=str(back))

    def drain(
        self, name: str, *, force: bool = False, deadline_s: float | None = None
    ) -> DrainOutcome:
        self._check_available()
        self.worker(name)
        with self._change() as change:
            outcome = self._drain(change, name, force=force, deadline_s=deadline_s)
        return replace(outcome, state=str(self.scheduler.workers[name].status))

    def _drain(
        self, change: _Change, name: str, *, force: bool, deadline_s: float | None
    ) -> DrainOutcome:
        record = self._worker_now(name)
        before = set(self.scheduler.worker_lease_ids(name))
        self._absorb(change, self.scheduler.decide(change.now))
        still = self.scheduler.worker_lease_ids(name)
        revoking = {lid for lid in still if self.scheduler.leases[lid].state is LeaseState.REVOKING}
        revoked = self.scheduler.drain(name, change.now, force=force, deadline_s=deadline_s)
        fresh = [lease for lease in revoked if lease.id not in revoking]
        self._revoked(change, fresh)
        deadline = None if deadline_s is None else change.now + deadline_s
        self._workers[name] = replace(self._workers[name], drain_deadline=deadline)
        change.workers.add(name)
        outcome = DrainOutcome(
            worker=name,
            previous_state=str(record.status),
            state=str(self.scheduler.workers[name].status),
            revoked=len(fresh),
            already_revoking=len(revoking) if force else 0,
            already_finished=len(before - still),
            leases_left=len(still),
        )
        change.event(
            "worker.draining",
            worker=name,
            mode="force" if force else "graceful",
            deadline_s=deadline_s,
            previous=outcome.previous_state,
            revoked=outcome.revoked,
            already_revoking=outcome.already_revoking,
            already_finished=outcome.already_finished,
        )
        return outcome

    def cancel_drain(self, name: str) -> DrainOutcome:
        """Back online, leases kept. It ends an update of the worker that has not yet run
        its command (failed: cancelled); while the command runs it is refused."""
        self._check_available()
        self.worker(name)
        update = self.running_update(name)
        command = None if update is None else update.step("update_command")
        if update is not None and command is not None and update.step("restart") is None:
            raise Conflict(
                f"worker {name} is running its update command (operation {update.id}); "
                "wait for its outcome",
                operation=update.id,
            )
        with self._change() as change:
            previous = self._cancel_drain(change, name)
            if update is not None:
                self._fail_update(change, update, "cancelled by cancel-drain")
        return DrainOutcome(
            worker=name,
            previous_state=str(previous),
            state=str(self.scheduler.workers[name].status),
            leases_left=len(self.scheduler.worker_lease_ids(name)),
        )

    def _cancel_drain(self, change: _Change, name: str) -> WorkerStatus:
        previous = self.scheduler.cancel_drain(name)
        self._workers[name] = replace(self._workers[name], drain_deadline=None)
        change.workers.add(name)
        change.event("worker.online", worker=name, previous=str(previous), state="online")
        return previous

    def remove(self, name: str, *, force: bool = False) -> DrainOutcome:
        """Forgets a worker. Refused while it holds leases, unless ``force``: then its leases
        are revoked (reason ``worker_removed``) and end with it."""
        self._check_available()
        record = self.worker(name)
        held = sorted(self.scheduler.worker_lease_ids(name))
        if held and not force:
            raise Conflict(
                f"worker {name} holds {len(held)} lease(s); drain it first or remove with force",
                leases=len(held),
            )
        with self._change() as change:
            for lease_id in held:
                revoked = self.scheduler.revoke(lease_id, "worker_removed", change.now)
                change.event("lease.revoked", lease_id, name, reason="worker_removed")
                ended = self.scheduler.release(lease_id, change.now)
                self._end(
                    change,
                    self._records[lease_id],
                    LeaseState.RELEASED,
                    "worker_removed",
                    replace(ended, revoke_reason=revoked.revoke_reason),
                )
            update = self.running_update(name)
            if update is not None:
                self._fail_update(change, update, "the worker was removed")
            self.scheduler.remove_worker(name)
            del self._workers[name]
            self._seen.pop(name, None)
            change.removed_workers.add(name)
            change.event(
                "worker.removed", worker=name, previous=str(record.status), revoked=len(held)
            )
        return DrainOutcome(name, str(record.status), "removed", revoked=len(held))

    # ------------------------------------------------------------------ update

    def start_update(
        self,
        name: str,
        *,
        timeout_s: float = UPDATE_TIMEOUT_S,
        drain_deadline_s: float | None = None,
    ) -> OperationRecord:
        """An update of a worker's agent: drain -> the agent runs its own update command ->
        it restarts and registers its new version -> the drain is cancelled. Each step is
        recorded in the operation, with its time and outcome. The drain and the record are
        one transaction. Not done within ``timeout_s``, it fails and the worker stays
        drained; ``drain_deadline_s`` revokes what still runs there by then."""
        self._check_available()
        record = self.worker(name)
        if record.simulated:
            raise Conflict(f"worker {name} is simulated by this controller; it has no agent")
        running = self.running_update(name)
        if running is not None:
            raise Conflict(f"worker {name} is already being updated", operation=running.id)
        with self._change() as change:
            status = self.scheduler.workers[name].status
            if status is not WorkerStatus.DRAINED and (
                status is not WorkerStatus.DRAINING or drain_deadline_s is not None
            ):
                self._drain(change, name, force=False, deadline_s=drain_deadline_s)
                self._absorb(change, self.scheduler.decide(change.now))  # drained already?
            how = "" if drain_deadline_s is None else f", deadline {drain_deadline_s:g} s"
            operation = OperationRecord(
                id=f"op-{secrets.token_hex(8)}",
                kind="update",
                worker=name,
                state="running",
                created_at=change.now,
                steps=(
                    OperationStep(
                        "drain", "started", change.now, f"graceful drain{how} (was {status})"
                    ),
                ),
                from_version=record.agent_version,
                deadline=change.now + timeout_s,
            )
            if self.scheduler.workers[name].status is WorkerStatus.DRAINED:
                operation = _with_step(operation, "drain", "ok", change.now, "no lease left")
            self._put_operation(change, operation)
        return operation

    def operation(self, operation_id: str) -> OperationRecord:
        found = self._operations.get(operation_id) or self.store.operation(operation_id)
        if found is None:
            raise NotFound(f"no operation {operation_id!r}", operation=operation_id)
        return found

    def update_for(self, name: str) -> dict[str, Any] | None:
        """What a heartbeat answer tells the agent of an update: its operation, and whether
        to run the update command now (the worker is drained and it has not run yet)."""
        operation = self.running_update(name)
        if operation is None:
            return None
        drained = self.scheduler.workers[name].status is WorkerStatus.DRAINED
        drain = operation.step("drain")
        if drained and (drain is None or drain.outcome != "ok"):
            operation = self._step(operation, "drain", "ok", "no lease left on the worker")
        return {"operation": operation.id, "run": drained and not operation.step("update_command")}

    def report_operation(
        self, operation_id: str, step: str, outcome: str, detail: str
    ) -> OperationRecord:
        """The agent reports a step it carried out (``update_command``)."""
        self._check_available()
        operation = self.operation(operation_id)
        if not operation.running:
            raise Conflict(f"operation {operation_id} is {operation.state}", state=operation.state)
        done = operation.step(step)
        if done is not None and done.outcome != "started":
            raise Conflict(f"step {step} of {operation_id} was already reported {done.outcome}")
        if outcome == "failed":
            failed = replace(operation, state="failed", reason=f"{step} failed: {detail}")
            return self._step(failed, step, outcome, detail)
        if outcome == "ok":
            now = self._clock()
            operation = _with_step(operation, step, outcome, now, detail)
            return self._step(operation, "restart", "started", "the agent restarts")
        return self._step(operation, step, outcome, detail)

    def _update_restarted(self, change: _Change, name: str, version: str) -> None:
        """In a registration: an agent back from its update ends the operation and its
        drain, in the same transaction."""
        operation = self.running_update(name)
        if operation is None or operation.step("restart") is None:
            return
        detail = f"registered with version {version} (was {operation.from_version})"
        operation = _with_step(operation, "restart", "ok", change.now, detail)
        if self.scheduler.workers[name].status in (WorkerStatus.DRAINING, WorkerStatus.DRAINED):
            self._cancel_drain(change, name)
        operation = replace(operation, state="succeeded", to_version=version)
        self._put_operation(
            change, _with_step(operation, "cancel_drain", "ok", change.now, "back online")
        )

    def _fail_update(self, change: _Change, operation: OperationRecord, why: str) -> None:
        """Ends a running update as failed at the step it was waiting on."""
        step = operation.waiting_on
        failed = replace(operation, state="failed", reason=f"{step} failed: {why}")
        self._put_operation(change, _with_step(failed, step, "failed", change.now, why))

    def _operation_sweep(self, change: _Change) -> None:
        """Updates past their deadline fail; the worker stays as it is (drained)."""
        for operation in list(self._operations.values()):
            if operation.deadline is not None and operation.deadline <= change.now:
                limit = operation.deadline - operation.created_at
                why = f"{_WAITING_FOR[operation.waiting_on]} within {limit:g} s"
                self._fail_update(change, operation, why)

    def running_update(self, name: str) -> OperationRecord | None:
        """The update of worker ``name`` under way, if any."""
        return next(
            (op for op in self._operations.values() if op.worker == name and op.running), None
        )

    def _step(self, op: OperationRecord, name: str, outcome: str, detail: str) -> OperationRecord:
        operation = _with_step(op, name, outcome, self._clock(), detail)
        with self._change() as change:
            self._put_operation(change, operation)
        return operation

    def _put_operation(self, change: _Change, operation: OperationRecord) -> None:
        """Stores ``operation`` in ``change``, with an event for each step it gained (the
        last one ``operation.<state>`` when it ended)."""
        before = change.operations.get(operation.id) or self._operations.get(operation.id)
        change.operations[operation.id] = operation
        new = operation.steps[len(before.steps) if before is not None else 0 :]
        for i, step in enumerate(new, 1):
            ended = i == len(new) and not operation.running
            change.event(
                f"operation.{operation.state}" if ended else "operation.step",
                worker=operation.worker,
                operation=operation.id,
                step=step.name,
                outcome=step.outcome,
            )
        if operation.running:
            self._operations[operation.id] = operation
        else:
            self._operations.pop(operation.id, None)

    # ------------------------------------------------------------------ arbiter

    def pause(self) -> None:
        self._check_available()
        with self._change() as change:
            if not self.scheduler.paused:
                change.event("arbiter.paused")
            self.scheduler.pause()

    def resume(self) -> None:
        self._check_available()
        with self._change() as change:
            if self.scheduler.paused:
                change.event("arbiter.resumed")
            self.scheduler.resume()

    def status(self) -> dict[str, Any]:
        leases: Counter[str] = Counter(str(lease.state) for lease in self.scheduler.leases.values())
        workers: Counter[str] = Counter(str(w.status) for w in self.scheduler.workers.values())
        return {
            "paused": self.scheduler.paused,
            "pending": len(self.scheduler.queue),
            "pending_by_priority": {
                str(p): n for p, n in sorted(self.scheduler.queue.count_by_priority().items())
            },
            "leases_by_state": dict(leases),
            "workers_by_state": dict(workers),
            "counters": dict(self.scheduler.counters),
            "next_token": self.scheduler.next_token,
            "last_event": self._event_seq,
            "role": "standby" if self.standby else "leader",
            "leader": self.leader_url,
        }

    # ------------------------------------------------------------------ waiting

    async def wait_lease(self, lease_id: str, state: LeaseState, timeout_s: float) -> LeaseRecord:
        """The lease once its state differs from ``state``, or as it is after ``timeout_s``."""
        deadline = self._clock() + timeout_s
        while True:
            record = self.lease(lease_id)
            left = deadline - self._clock()
            if record.state is not state or record.state.is_final or left <= 0:
                return record
            if self.stopping.is_set():
                return record
            changed = self._lease_changed.setdefault(lease_id, asyncio.Event())
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                return self.lease(lease_id)

    def events_after(self, seq: int, limit: int = 500) -> list[Event]:
        """Events after ``seq``: from memory when recent, else from the store's history."""
        events = self._events
        if events and events[0].seq <= seq + 1:
            if events[-1].seq - seq <= 64:  # a live reader: walk back from the newest
                tail = list(itertools.takewhile(lambda e: e.seq > seq, reversed(events)))
                return tail[::-1][:limit]
            start = max(0, seq + 1 - events[0].seq)
            return list(itertools.islice(events, start, start + limit))
        return self.store.events_after(seq, limit)

    async def wait_events(self, seq: int) -> bool:
        """Waits until an event after ``seq`` exists (True), or the next tick (every
        :attr:`EVENT_TICK_S`), or the controller stops (False). Always suspends, even when
        the answer is known at once: a caller looping on it never holds the event loop."""
        if self._event_seq > seq or self.stopping.is_set():
            await asyncio.sleep(0)
        else:
            await self._event_fanout.wait()
        return self._event_seq > seq

    def _publish(self, events: Sequence[Event]) -> None:
        """Committed events: kept for readers; event streams are woken at most every
        :attr:`EVENT_FLUSH_S` (later while many streams are open), each wake carrying
        every event since the last."""
        self._events.extend(events)
        if self._loop is not None:
            self._event_fanout.wake_soon(self._loop)

    def wake_event_streams(self) -> None:
        """Wakes every :meth:`wait_events` now."""
        self._event_fanout.wake_now()

    @property
    def last_event_seq(self) -> int:
        return self._event_seq

    # ------------------------------------------------------------------ the change

    def _check_available(self) -> None:
        if self.standby:
            where = f"; the leader is {self.leader_url}" if self.leader_url else ""
            raise NotLeader(f"this controller is a standby{where}", leader=self.leader_url or "")
        if self.broken is not None:
            raise ServiceUnavailable(f"the controller is not accepting changes: {self.broken}")
        if not self.started and self._loop is not None:
            raise ServiceUnavailable("the controller is stopping")

    @contextmanager
    def _change(self) -> Iterator[_Change]:
        """One change: the caller applies it in the body; then the cycle runs, and all of
        it is stored in one transaction. A refusal (:class:`ArbiterError`) in the body
        stores what was applied before it; any other exception, in the body or in the
        cycle, sends memory back to what the store holds."""
        change = _Change(self._clock())
        try:
            yield change
        except ArbiterError:
            self._commit(change)
            raise
        except BaseException as error:
            self._recover(error)
            raise
        try:
            self._offline_sweep(change)
            self._operation_sweep(change)
            self._absorb(change, self.scheduler.decide(change.now))
        except BaseException as error:
            self._recover(error)
            raise
        self._commit(change)
        for waited_s in change.waited_s:
            self.wait_times.observe(waited_s)
        if change.grants:  # each grant of this cycle waited for the whole change to be stored
            self.grant_latency.observe(time.perf_counter() - change.started, change.grants)

    def _commit(self, change: _Change) -> None:
        """Encodes and stores ``change``; only then is anyone told (waiters, streams). Any
        exception on the way sends memory back to what the store holds."""
        try:
            self._store(self._batch(change))
        except BaseException as error:
            self._recover(error)
            if isinstance(error, Exception):
                raise ServiceUnavailable(f"the change could not be stored: {error}") from error
            raise
        self._arm_timer()

    def _store(self, batch: Batch) -> None:
        if batch:
            self.store.commit(batch)
        self._meta.update(batch.meta)
        for lease_id in batch.leases:
            waiter = self._lease_changed.pop(lease_id, None)
            if waiter is not None:
                waiter.set()
        if batch.events:
            self._event_seq = batch.events[-1].seq
            self._publish(batch.events)
            for event in batch.events:
                line = _lease_log_line(event, batch.leases.get(event.lease_id or ""))
                if line is not None:
                    log.info("%s", line)

    def _batch(self, change: _Change) -> Batch:
        """What ``change`` writes. Counters and the event sequence are not advanced here:
        :meth:`_store` does, once the store has it."""
        batch = Batch()
        for lease_id in change.leases - change.ended.keys():
            if lease_id in self._records:
                record = self._current(self._records[lease_id])
                self._records[lease_id] = record
                batch.leases[lease_id] = record
        batch.leases.update(change.ended)
        for name in change.workers - change.removed_workers:
            if name in self._workers:
                batch.workers[name] = self._worker_now(name)
                self._workers[name] = batch.workers[name]
        batch.removed_workers = set(change.removed_workers)
        batch.operations = dict(change.operations)
        for seq, (kind, subject, worker, data) in enumerate(change.events, self._event_seq + 1):
            batch.events.append(Event(seq, change.now, kind, subject, worker, data))
        meta = {
            "next_token": self.scheduler.next_token,
            "next_seq": self.scheduler.next_seq,
            "paused": int(self.scheduler.paused),
        }
        batch.meta = {k: v for k, v in meta.items() if self._meta.get(k) != v}
        return batch

    # ------------------------------------------------------------------ recovery

    def _recover(self, error: BaseException) -> None:
        """A change failed before it was stored: memory goes back to what the store holds."""
        if isinstance(error, StoreError):
            log.error("a change could not be stored (%s); reloading what the store holds", error)
        else:
            log.error("a change failed (%r); reloading what the store holds", error, exc_info=error)
        self._reload_or_refuse(fenced=isinstance(error, Fenced))

    def _reload_or_refuse(self, *, fenced: bool = False) -> None:
        """Reloads; if the store cannot be read, refuses changes and tries again later."""
        self._stop_timer()
        try:
            self._reload()
        except Exception as error:
            self.broken = f"the store cannot be read, so changes are refused: {error}"
            log.error("%s; trying again", self.broken)
            self._retry_reload_later()
        else:
            self._reload_delay_s = 0.0
            self.broken = "this controller no longer leads the store" if fenced else None
            self._arm_timer()
        finally:
            self._wake_waiters(events=True)

    def _reload(self) -> None:
        """Memory becomes what the store holds (what was acknowledged), as at ``start()``."""
        snapshot = self.store.load()
        self._rebuild(snapshot)
        change = _Change(self._clock())
        self._restore_leases(snapshot.leases, change)  # ends what no GPU can hold any more
        self._store(self._batch(change))

    def _retry_reload_later(self) -> None:
        if self._loop is None or self.stopping.is_set() or self.standby:
            return
        self._reload_delay_s = min(RELOAD_RETRY_MAX_S, max(0.1, 2 * self._reload_delay_s))
        self._reload_retry = self._loop.call_later(self._reload_delay_s, self._reload_again)

    def _reload_again(self) -> None:
        self._reload_retry = None
        if self.broken is not None and not self.standby and not self.stopping.is_set():
            self._reload_or_refuse()

    def _absorb(self, change: _Change, decisions: Decisions) -> None:
        """Records what one cycle decided, causes before their effects: the leases that
        ended (expired, timed out, rejected) and the loads that finished, then the drains
        that their end completed, the revocations, and last the grants they made room for."""
        for lease in decisions.expired:
            self._end(change, self._records[lease.id], LeaseState.EXPIRED, "expired", lease)
        for request in decisions.timed_out:
            self._end(change, self._records[request.id], LeaseState.TIMED_OUT, "max_wait")
        for request, why in decisions.rejected:  # the cluster shrank under it
            record = self._records[request.id]
            self._end(change, record, LeaseState.REJECTED, why.code, message=why.message)
        for lease in decisions.loaded:
            change.leases.add(lease.id)
            change.event("lease.loaded", lease.id, lease.worker, reason="load_timeout")
        for name, previous, status in decisions.workers:
            change.workers.add(name)
            change.event("worker.drained", worker=name, previous=str(previous), state=str(status))
        self._revoked(change, decisions.revocations)
        for lease in decisions.grants:
            self._granted(change, lease)

    def _granted(self, change: _Change, lease: Lease) -> None:
        change.leases.add(lease.id)
        self._pending_by_holder[self._holder_key(self._records[lease.id])] -= 1
        change.grants += 1
        waited_s = max(0.0, lease.granted_at - lease.request.submitted_at)
        change.waited_s.append(waited_s)
        change.event(
            "lease.granted",
            lease.id,
            lease.worker,
            gpus=[str(g) for g in lease.gpus],
            token=lease.token,
            vram_mb=lease.vram_mb,
            waited_s=round(waited_s, 6),
        )

    def _revoked(self, change: _Change, leases: Sequence[Lease]) -> None:
        for lease in leases:
            change.leases.add(lease.id)
            change.event(
                "lease.revoked",
                lease.id,
                lease.worker,
                reason=lease.revoke_reason,
                for_request=lease.preempted_for,
            )

    def _end(
        self,
        change: _Change,
        record: LeaseRecord,
        state: LeaseState,
        reason: str,
        lease: Lease | None = None,
        *,
        message: str | None = None,
    ) -> None:
        """A record reaches a final state: it leaves the live set, kept as recent.
        ``message``: the reason in words, for the event."""
        if lease is None and record.lease is None and record.id in self._records:  # never granted
            self._pending_by_holder[self._holder_key(record)] -= 1
        ended = replace(
            record,
            state=state,
            lease=lease if lease is not None else record.lease,
            ended_at=change.now,
            end_reason=reason,
        )
        self._records.pop(record.id, None)
        if record.request.idempotency_key is not None:  # the store answers for ended ones
            self._keys.pop((record.owner or "", record.request.idempotency_key), None)
        self._recent[record.id] = ended
        while len(self._recent) > self.limits.recent_final_leases:
            self._recent.popitem(last=False)
        change.ended[record.id] = ended
        worker = None if ended.lease is None else ended.lease.worker
        more = {} if message is None else {"message": message}
        change.event(f"lease.{state}", record.id, worker, reason=reason, **more)

    def _remember(self, record: LeaseRecord) -> None:
        self._records[record.id] = record
        if record.request.idempotency_key is not None:
            self._keys[(record.owner or "", record.request.idempotency_key)] = record.id

    def _current(self, record: LeaseRecord) -> LeaseRecord:
        lease = self.scheduler.leases.get(record.id)
        if lease is not None:
            if record.lease is lease:
                return record
            return replace(record, request=lease.request, state=lease.state, lease=lease)
        if record.id in self.scheduler.queue:
            request = self.scheduler.queue.get(record.id)
            return record if record.request is request else replace(record, request=request)
        return record

    def _worker_now(self, name: str) -> WorkerRecord:
        record = self._workers[name]
        status = self.scheduler.workers[name].status
        return record if record.status is status else replace(record, status=status)

    # ------------------------------------------------------------------ timers

    def _expect_heartbeat(self, name: str, now: float) -> None:
        self._seen[name] = now
        self._push_offline_deadline(name, now)

    def _push_offline_deadline(self, name: str, seen_at: float) -> None:
        heapq.heappush(self._offline_heap, (seen_at + self.heartbeat_timeout_s, name))

    def _offline_sweep(self, change: _Change) -> None:
        """Workers silent for ``heartbeat_timeout_s`` go offline: exactly one event each."""
        heap = self._offline_heap
        while heap and heap[0][0] <= change.now:
            _, name = heapq.heappop(heap)
            seen = self._seen.get(name)
            if seen is None or seen + self.heartbeat_timeout_s > change.now:
                continue  # removed, or heard from since
            status = self.scheduler.workers[name].status
            if status is WorkerStatus.OFFLINE:
                continue
            revoked = self.scheduler.set_offline(name, change.now)
            self._revoked(change, revoked)
            after = (
                WorkerStatus.DRAINING
                if status in (WorkerStatus.DRAINING, WorkerStatus.DRAINED)
                else WorkerStatus.ONLINE
            )
            self._workers[name] = replace(
                self._workers[name], status_after_offline=after, drain_deadline=None
            )
            change.workers.add(name)
            change.event("worker.offline", worker=name, previous=str(status), revoked=len(revoked))

    def _next_wakeup(self) -> float | None:
        heap = self._offline_heap
        while heap:
            at, name = heap[0]
            seen = self._seen.get(name)
            if seen is not None and seen + self.heartbeat_timeout_s == at:
                break
            heapq.heappop(heap)
        deadlines = [
            self.scheduler.next_deadline(),
            heap[0][0] if heap else None,
            *(op.deadline for op in self._operations.values()),
        ]
        return min((d for d in deadlines if d is not None), default=None)

    def _arm_timer(self) -> None:
        if self._loop is None or self.stopping.is_set() or self.standby:
            return
        at = self._next_wakeup()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            self._timer = self._loop.call_later(max(0.0, at - self._clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        if self.broken is not None or self.stopping.is_set() or self.standby:
            return
        try:
            with self._change():
                pass
        except ServiceUnavailable:
            pass
        except Exception:  # a bug must not stop the timer for good
            log.exception("timer cycle failed")
            self._arm_timer()


_WAITING_FOR = {
    "drain": "the worker was not drained",
    "update_command": "the update command was not run to its end",
    "restart": "the agent did not register again",
}


def _with_step(
    operation: OperationRecord, name: str, outcome: str, at: float, detail: str
) -> OperationRecord:
    return replace(operation, steps=(*operation.steps, OperationStep(name, outcome, at, detail)))


_LOGGED = ("lease.granted", "lease.revoked", "lease.released", "lease.expired")


def _lease_log_line(event: Event, record: LeaseRecord | None) -> str | None:
    """The serve log's one line for a grant, a revocation or the end of a held lease:
    the lease, its holder, its GPUs and why; None for any other event."""
    if event.kind not in _LOGGED or record is None or record.lease is None:
        return None
    lease = record.lease
    gpus = ",".join(map(str, lease.gpus))
    who = f"lease {record.id} (holder {record.request.holder or '-'!r}) on {gpus}"
    if event.kind == "lease.granted":
        waited = float(event.data.get("waited_s") or 0.0)
        return (
            f"granted {who}: {format_mb(lease.vram_mb)}, priority {lease.base_priority}, "
            f"token {lease.token}, waited {waited:.1f}s"
        )
    if event.kind == "lease.revoked":
        reason = str(event.data.get("reason") or "revoked")
        preemptor = event.data.get("for_request")
        return f"revoked {who}: {reason}" + (f" for {preemptor}" if preemptor else "")
    return f"ended {who}: {event.data.get('reason') or event.kind.removeprefix('lease.')}"
