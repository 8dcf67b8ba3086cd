"""``Arbiter``: the decision core driven by asyncio, for leases inside one process.

Every event (a request, a release, ``ready()``, a probe reading) runs one
scheduling cycle at once, in the caller's turn of the event loop: a release
grants the next waiter before it returns. The only timer is one ``call_at``
for the core's next deadline (a TTL, a ``max_wait_s``), re-armed once per turn of
the event loop however many events the turn brought; with nothing due, nothing
runs. Time comes from a :class:`Clock`: the event loop's by default, a virtual one
in tests, so that a test of a TTL moves time instead of sleeping through it.

A lease held in ``async with arbiter.lease(...)`` belongs to the task that
entered the block. Revoking it cancels that task; the memory is released when
the block has been left, i.e. after the task's own cleanup ran (I4). The
block then raises :class:`LeasePreempted` (a cancellation from elsewhere still
propagates as a cancellation), the way ``asyncio.timeout()`` turns its own
cancellation into ``TimeoutError``.

A task that swallows its cancellation cannot be stopped from outside: its lease
(which has no TTL) keeps its memory, and its preemptor waits, until the block is
left. The arbiter cannot end that wait, but makes it visible once the revoked
lease is held past ``policy.grace_s``: a warning in the log, a
``revocation_ignored`` event, the preemptor's pending reason naming the lease
and how long it has ignored its revocation, and ``stats().overdue_revocations``.
A lease from :meth:`Arbiter.acquire` has a TTL: once revoked it can be renewed
only within the grace, so it lapses at most grace + TTL after its revocation.

An in-process asker is present for as long as it awaits its grant (a task that stops
awaiting cancels its request), and a grant is handed to it as made: the core's presence
rule (a request unseen for its TTL ends, a grant not taken up is given back: see
``core.presence``) is the service's, off here, and every grant is claimed as made.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

from .core import (
    Alarm,
    ArbiterStopped,
    Clock,
    Constraints,
    Decisions,
    Gpu,
    GpuFigures,
    GpuId,
    GpuProbe,
    Lease,
    LeasePreempted,
    LeaseRevoked,
    LeaseState,
    NotFound,
    PendingReason,
    Policy,
    Request,
    Scheduler,
    Timer,
    Unschedulable,
    WaitTimeout,
    Worker,
    WorkerStatus,
    hand_over,
    parse_mb,
)

__all__ = [
    "Arbiter",
    "ArbiterEvent",
    "ArbiterStats",
    "Clock",
    "LeaseHandle",
    "LoopClock",
    "PendingInfo",
    "Timer",
]

log = logging.getLogger("gpu_arbiter.engine")

Probe = Callable[[], Awaitable[Mapping[GpuId, GpuProbe | None]]]
Hook = Callable[["ArbiterEvent"], object]


class LoopClock:
    """The running event loop's clock (``loop.time()`` and ``loop.call_at``): the default."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_at(when, callback)


@dataclass(frozen=True, slots=True)
class ArbiterEvent:
    """What happened: ``granted``, ``revoked``, ``released``, ``expired``, ``timed_out``,
    ``cancelled``, ``rejected``, ``loaded`` (load timed out and counts as done),
    ``revocation_ignored`` (a revoked lease still held past its grace), ``paused``,
    ``resumed``."""

    kind: str
    at: float
    lease_id: str | None = None
    detail: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class PendingInfo:
    position: int
    request: Request
    effective_priority: int
    waited_s: float
    reason: PendingReason


@dataclass(frozen=True, slots=True)
class ArbiterStats:
    """A frozen snapshot; taking it changes nothing. ``overdue_revocations``: revoked
    leases still held past ``policy.grace_s`` (their holders ignore the revocation), with
    the seconds since it, longest first."""

    paused: bool
    pending: int
    pending_by_priority: Mapping[int, int]
    leases_by_state: Mapping[str, int]
    gpus: tuple[GpuFigures, ...]
    counters: Mapping[str, int]
    overdue_revocations: Mapping[str, float] = field(default_factory=dict)


class LeaseHandle:
    """A granted lease, as its holder sees it."""

    def __init__(self, arbiter: Arbiter, lease: Lease, task: asyncio.Task[Any] | None) -> None:
        self._arbiter = arbiter
        self._lease = lease
        self._task = task
        self._revoked: asyncio.Event | None = None  # made by the first wait_revoked()
        self._cancelled_by_arbiter = False
        self.revoke_reason: str | None = None

    @property
    def id(self) -> str:
        return self._lease.id

    @property
    def gpus(self) -> tuple[GpuId, ...]:
        return self._lease.gpus

    @property
    def gpu_indexes(self) -> tuple[int, ...]:
        return tuple(g.index for g in self._lease.gpus)

    @property
    def token(self) -> int:
        return self._lease.token

    @property
    def vram_mb(self) -> int:
        """What the lease holds per GPU now (less than granted once shrunk)."""
        return self._lease.vram_mb

    @property
    def state(self) -> LeaseState:
        return self._arbiter._current(self._lease).state

    @property
    def revoked(self) -> bool:
        return self.revoke_reason is not None

    async def wait_revoked(self) -> str:
        """Returns the reason once the arbiter revokes this lease."""
        if self.revoke_reason is None:
            if self._revoked is None:
                self._revoked = asyncio.Event()
            await self._revoked.wait()
        return self.revoke_reason or "revoked"

    async def ready(self) -> None:
        """The load finished: the GPU's load gate opens for the next load."""
        self._arbiter._call(self.id, "ready")

    async def idle(self) -> None:
        """Keep-warm: the memory stays, but equal or higher priority may reclaim it."""
        self._arbiter._call(self.id, "idle")

    async def busy(self) -> None:
        self._arbiter._call(self.id, "busy")

    async def renew(self, ttl_s: float | None = None) -> None:
        self._arbiter._call(self.id, "renew", ttl_s)

    async def shrink(self, vram_mb: int | str) -> None:
        """Gives memory back: the lease holds ``vram_mb`` per GPU (MiB or a size such as
        ``2G``) from now on; the memory goes to others once the probe shows it free. It
        never grows back: more memory takes a new lease."""
        self._lease = self._arbiter._shrink(self.id, parse_mb(vram_mb))

    async def release(self) -> None:
        self._arbiter._release(self._lease.id)

    def _notify_revoked(self, reason: str) -> None:
        self.revoke_reason = reason
        if self._revoked is not None:
            self._revoked.set()
        if self._task is not None and not self._task.done() and not self._cancelled_by_arbiter:
            self._cancelled_by_arbiter = True
            self._task.cancel(f"gpu-arbiter revoked lease {self.id}: {reason}")

    def __repr__(self) -> str:
        gpus = ",".join(map(str, self.gpus))
        return f"<LeaseHandle {self.id} {self.vram_mb} MiB on {gpus} token={self.token}>"


class Arbiter:
    """An in-process arbiter over ``gpus``: ``async with Arbiter(gpus=[...]) as arbiter``.

    ``clock``: where time comes from (TTLs, ``max_wait_s``, the grace, the probe's
    interval); the running event loop's by default."""

    def __init__(
        self,
        gpus: Sequence[Gpu] = (),
        *,
        policy: Policy | None = None,
        probe: Probe | None = None,
        probe_interval_s: float = 2.0,
        hooks: Sequence[Hook] = (),
        clock: Clock | None = None,
    ) -> None:
        self.policy = policy or Policy()
        self._clock: Clock = clock or LoopClock()
        self._now: Callable[[], float] = self._clock.now  # the loop's own, once started
        self._loop: asyncio.AbstractEventLoop  # the running loop, from start()
        self._scheduler = Scheduler(self.policy)
        by_worker: dict[str, list[Gpu]] = {}
        for gpu in gpus:
            by_worker.setdefault(gpu.worker, []).append(gpu)
        for name, worker_gpus in by_worker.items():
            self._scheduler.put_worker(Worker(name), worker_gpus)
        self._probe = probe
        self._probe_interval_s = probe_interval_s
        self._hooks = list(hooks)
        self._waiters: dict[str, asyncio.Future[Lease]] = {}
        self._handles: dict[str, LeaseHandle] = {}
        self._carried = _Carried(self)
        self._ids = itertools.count(1)
        self._alarm = Alarm(self._clock, self._cycle)  # the core's next deadline
        self._rearm: asyncio.Handle | None = None  # the timer's re-arming, due this turn
        self._grace_timers: dict[str, Timer] = {}
        self._probe_task: asyncio.Task[None] | None = None
        self._running = False
        self._stopped = False

    # ------------------------------------------------------------------ life cycle

    async def __aenter__(self) -> Arbiter:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._running or self._stopped:
            raise RuntimeError("an Arbiter starts once")
        self._loop = asyncio.get_running_loop()
        if type(self._clock) is LoopClock:  # the same time, without finding the loop each time
            self._now = self._loop.time
        self._running = True
        if self._probe is not None:
            self._probe_task = self._loop.create_task(self._probe_loop())
        self._cycle()

    async def stop(self) -> None:
        """Ends every waiting caller with ``ArbiterStopped`` (I8). Held leases stay with their
        holders, who may still release them."""
        if self._stopped:
            return
        self._stopped = True
        self._running = False
        self._alarm.cancel()
        if self._rearm is not None:
            self._rearm.cancel()
        for grace_timer in self._grace_timers.values():
            grace_timer.cancel()
        self._grace_timers.clear()
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        waiters, self._waiters = self._waiters, {}
        for request_id, future in waiters.items():
            if request_id in self._scheduler.queue:
                self._scheduler.cancel(request_id)
            if not future.done():
                future.set_exception(ArbiterStopped("the arbiter stopped"))

    # ------------------------------------------------------------------ leases

    def lease(
        self,
        vram_mb: int | str,
        *,
        gpus: int | None = None,
        priority: int | str = "normal",
        preemptible: bool | None = None,
        holder: str = "",
        metadata: Mapping[str, Any] | None = None,
        max_wait_s: float | None = None,
        load_timeout_s: float = 300.0,
        **constraints: Any,
    ) -> _LeaseBlock:
        """``async with arbiter.lease(6000, priority="interactive") as lease:`` — waits for a
        grant, holds it for the block, releases it on the way out. Constraints as keywords:
        ``vendor``, ``min_compute_capability``, ``gpu_arch``, ``gpu_model``, ``worker``,
        ``labels``, ``gpu_ids`` (exact GPUs: ``gpus`` defaults to their number),
        ``workers`` (any of them), ``prefer_workers`` (placed there first when it fits).
        The lease has no TTL: it lives exactly as long as the block.

        Revoked, the block's task is cancelled and its memory is freed when the block is
        left. A task that catches the cancellation and carries on holds the memory, and
        keeps its preemptor waiting, until it leaves the block: past ``policy.grace_s``
        this is logged as a warning and shown in the preemptor's pending reason and in
        ``stats().overdue_revocations``."""
        request = self._request(
            vram_mb,
            gpus=gpus,
            priority=priority,
            preemptible=preemptible,
            holder=holder,
            metadata=metadata,
            max_wait_s=max_wait_s,
            load_timeout_s=load_timeout_s,
            ttl_s=None,
            constraints=constraints,
        )
        return _LeaseBlock(self, request)

    async def acquire(
        self,
        vram_mb: int | str,
        *,
        gpus: int | None = None,
        priority: int | str = "normal",
        preemptible: bool | None = None,
        holder: str = "",
        metadata: Mapping[str, Any] | None = None,
        ttl_s: float = 30.0,
        max_wait_s: float | None = None,
        load_timeout_s: float = 300.0,
        **constraints: Any,
    ) -> LeaseHandle:
        """A lease that outlives one block: renew it within ``ttl_s`` or it lapses; end it
        with :meth:`release`. Revocation is signalled on the handle, not by cancellation;
        a revoked lease can be renewed only within ``policy.grace_s`` (then renewing
        raises :class:`Conflict`) and lapses at most grace + TTL after its revocation."""
        request = self._request(
            vram_mb,
            gpus=gpus,
            priority=priority,
            preemptible=preemptible,
            holder=holder,
            metadata=metadata,
            max_wait_s=max_wait_s,
            load_timeout_s=load_timeout_s,
            ttl_s=ttl_s,
            constraints=constraints,
        )
        return await self._wait_for_grant(request, task=None)

    async def release(self, lease_id: str) -> None:
        """Releases a held lease; releasing one that already ended does nothing (idempotent)."""
        self._release(lease_id)

    def _release(self, lease_id: str) -> None:
        """:meth:`release`, which never waits (a handle's release calls it directly)."""
        self._handles.pop(lease_id, None)
        grace_timer = self._grace_timers.pop(lease_id, None)
        if grace_timer is not None:
            grace_timer.cancel()
        if lease_id not in self._scheduler.leases:
            return
        now = self._now()
        self._scheduler.release(lease_id, now)
        if self._hooks:
            self._emit("released", lease_id, {"state": "released"})
        if not self._running:
            return
        if self._scheduler.queue:  # memory freed goes to requests waiting, if any
            self._cycle(now)
        else:  # nothing to grant: the cycle would decide nothing, only the timer moves
            self._arm_timer_soon()

    def revoke(self, lease_id: str, reason: str = "revoked") -> None:
        """Takes a lease back: its holder is told (its block cancelled); the memory stays
        committed until the holder has stopped."""
        lease = self._scheduler.revoke(lease_id, reason, self._now())
        self._revoked([lease])
        self._cycle()

    def pause(self) -> None:
        self._scheduler.pause()
        self._emit("paused", None)

    def resume(self) -> None:
        self._scheduler.resume()
        self._emit("resumed", None)
        self._cycle()

    def set_probe(self, gpu_id: GpuId, probe: GpuProbe | None) -> None:
        """A probe reading for one GPU (None: the probe failed; the GPU is stale)."""
        self._scheduler.set_probe(gpu_id, probe)
        self._cycle()

    # ------------------------------------------------------------------ introspection

    def pending(self) -> list[PendingInfo]:
        now = self._now()
        return [
            PendingInfo(
                position,
                request,
                effective,
                now - request.submitted_at,
                self._scheduler.explain(request.id, now),
            )
            for position, request, effective in self._scheduler.pending(now)
        ]

    def leases(self) -> list[Lease]:
        return sorted(self._scheduler.leases.values(), key=lambda lease: lease.token)

    def stats(self) -> ArbiterStats:
        states: dict[str, int] = {}
        for lease in self._scheduler.leases.values():
            states[str(lease.state)] = states.get(str(lease.state), 0) + 1
        return ArbiterStats(
            paused=self._scheduler.paused,
            pending=len(self._scheduler.queue),
            pending_by_priority=self._scheduler.queue.count_by_priority(),
            leases_by_state=states,
            gpus=tuple(self._scheduler.figures(g) for g in self._scheduler.gpu_ids()),
            counters=dict(self._scheduler.counters),
            overdue_revocations=dict(self._scheduler.overdue_revocations(self._now())),
        )

    # ------------------------------------------------------------------ internals

    def _request(  # every field by name: no keyword dict to build and unpack per request
        self,
        vram_mb: int | str,
        *,
        gpus: int | None,
        priority: int | str,
        preemptible: bool | None,
        holder: str,
        metadata: Mapping[str, Any] | None,
        ttl_s: float | None,
        max_wait_s: float | None,
        load_timeout_s: float,
        constraints: Mapping[str, Any],
    ) -> Request:
        return Request.build(
            f"lease-{next(self._ids)}",
            vram_mb=vram_mb,
            gpus=gpus,
            priority=priority,
            preemptible=preemptible,
            holder=holder,
            metadata=metadata,
            ttl_s=ttl_s,
            max_wait_s=max_wait_s,
            load_timeout_s=load_timeout_s,
            constraints=Constraints.build(**constraints) if constraints else None,
        )

    def _current(self, lease: Lease) -> Lease:
        return self._scheduler.leases.get(lease.id) or replace(lease, state=LeaseState.RELEASED)

    def _shrink(self, lease_id: str, vram_mb: int) -> Lease:
        lease = self._scheduler.shrink(lease_id, vram_mb, self._now())
        self._cycle()
        return lease

    def _call(self, lease_id: str, verb: str, arg: float | None = None) -> None:
        now = self._now()
        if verb == "ready":
            self._scheduler.ready(lease_id, now)
        elif verb == "renew":
            self._scheduler.renew(lease_id, now, arg)
        else:
            self._scheduler.set_idle(lease_id, verb == "idle", now)
        self._cycle()

    async def _wait_for_grant(
        self, request: Request, task: asyncio.Task[Any] | None
    ) -> LeaseHandle:
        if not self._running:
            raise ArbiterStopped("the arbiter is not running")
        now = self._now()
        request = self._scheduler.submit(request, now)
        future: asyncio.Future[Lease] = self._loop.create_future()
        self._waiters[request.id] = future
        self._cycle(now)
        try:
            lease = await future
        except BaseException:
            self._give_up(request.id, future)
            raise
        handle = LeaseHandle(self, lease, task)
        self._handles[request.id] = handle  # the lease's id is its request's
        current = self._scheduler.leases.get(request.id, lease)
        if current.state is LeaseState.REVOKING:  # revoked between grant and wake-up
            handle._notify_revoked(current.revoke_reason or "revoked")
        return handle

    def _give_up(self, request_id: str, future: asyncio.Future[Lease]) -> None:
        """A waiter left (cancelled, timed out): nothing of its request may remain."""
        self._waiters.pop(request_id, None)
        if request_id in self._scheduler.queue:
            self._scheduler.cancel(request_id)
            self._emit("cancelled", request_id)
        elif request_id in self._scheduler.leases:  # granted, but the waiter never woke for it
            self._scheduler.release(request_id, self._now())
            self._emit("released", request_id, {"state": "released"})
            self._cycle()

    def _cycle(self, now: float | None = None) -> None:
        """Runs the core until it has nothing more to decide now, and carries it out."""
        if not self._running:
            return
        try:
            decisions = self._scheduler.decide(self._now() if now is None else now)
        except Exception:  # a bug in the core must not wedge every waiter
            log.exception("scheduling cycle failed")
            decisions = Decisions()
        self._apply(decisions)
        self._arm_timer_soon()

    def _arm_timer_soon(self) -> None:
        if self._rearm is None:
            self._rearm = self._loop.call_soon(self._arm_timer)

    def _apply(self, decisions: Decisions) -> None:
        if decisions:
            hand_over(decisions, self._carried)

    def _granted(self, lease: Lease) -> None:
        future = self._waiters.pop(lease.id, None)
        if self._hooks:  # the detail is for hooks only
            gpus = [str(g) for g in lease.gpus]
            self._emit("granted", lease.id, {"gpus": gpus, "token": lease.token})
        if future is not None and not future.done():
            future.set_result(lease)

    def _expired(self, lease: Lease) -> None:
        self._emit("expired", lease.id)
        handle = self._handles.pop(lease.id, None)
        if handle is not None:
            handle._notify_revoked("expired")

    def _fail_waiter(self, request_id: str, error: Exception) -> None:
        future = self._waiters.pop(request_id, None)
        if future is not None and not future.done():
            future.set_exception(error)

    def _revoked(self, leases: Sequence[Lease]) -> None:
        for lease in leases:
            self._emit(
                "revoked",
                lease.id,
                {"reason": lease.revoke_reason, "for_request": lease.preempted_for},
            )
            handle = self._handles.get(lease.id)
            if handle is not None:
                handle._notify_revoked(lease.revoke_reason or "revoked")
            if lease.revoked_at is not None and lease.id not in self._grace_timers:
                self._grace_timers[lease.id] = self._clock.call_at(
                    lease.revoked_at + self.policy.grace_s,
                    functools.partial(self._grace_over, lease.id),
                )

    def _grace_over(self, lease_id: str) -> None:
        """A revoked lease's grace ended: still held, its holder ignores the revocation."""
        self._grace_timers.pop(lease_id, None)
        lease = self._scheduler.leases.get(lease_id)
        if lease is None or lease.revoked_at is None:
            return
        ignored_s = self._now() - lease.revoked_at
        log.warning(
            "lease %s (holder %r) was revoked (%s) %.1f s ago and still holds %d MiB on %s: "
            "its holder ignores the revocation (a task that swallows its cancellation cannot "
            "be stopped from outside); %s waits until it leaves its block",
            lease_id,
            lease.request.holder,
            lease.revoke_reason,
            ignored_s,
            lease.vram_mb,
            ",".join(map(str, lease.gpus)),
            lease.preempted_for or "the memory",
        )
        self._emit("revocation_ignored", lease_id, {"ignored_s": round(ignored_s, 3)})
        self._scheduler.counters["revocations_ignored"] += 1

    def _arm_timer(self) -> None:
        """Moves the alarm to the core's next deadline. It runs once per turn of the event
        loop, after the turn's events: a turn that acquires and releases a lease arms and
        cancels nothing, and no deadline is missed, as timers fire between turns."""
        self._rearm = None
        if self._running:
            self._alarm.set(self._scheduler.next_deadline())

    def _emit(
        self, kind: str, lease_id: str | None, detail: Mapping[str, Any] | None = None
    ) -> None:
        if not self._hooks:
            return
        event = ArbiterEvent(kind, self._now(), lease_id, detail)
        for hook in self._hooks:
            try:
                hook(event)
            except Exception:
                log.exception("hook %r failed on %s", hook, kind)

    async def _probe_loop(self) -> None:
        assert self._probe is not None
        while True:
            try:
                readings = await self._probe()
            except Exception:
                log.exception("GPU probe failed; marking every GPU stale")
                readings = {gpu_id: None for gpu_id in self._scheduler.gpu_ids()}
            for gpu_id, reading in readings.items():
                try:
                    self._scheduler.set_probe(gpu_id, reading)
                except NotFound:
                    log.warning("probe reported unknown GPU %s", gpu_id)
            self._cycle()
            await self._sleep(self._probe_interval_s)

    async def _sleep(self, seconds: float) -> None:
        """Sleeps ``seconds`` on the arbiter's clock."""
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        timer = self._clock.call_at(self._now() + seconds, wake)
        try:
            await woken
        finally:
            timer.cancel()


class _Carried:
    """The engine's :class:`~.core.Outcomes`: each decision carried out on the loop (a
    waiter woken or failed, a holder told, the hooks called)."""

    __slots__ = ("_arbiter",)

    def __init__(self, arbiter: Arbiter) -> None:
        self._arbiter = arbiter

    def granted(self, lease: Lease) -> None:
        self._arbiter._granted(lease)

    def revoked(self, leases: Sequence[Lease]) -> None:
        self._arbiter._revoked(leases)

    def expired(self, lease: Lease) -> None:
        self._arbiter._expired(lease)

    def loaded(self, lease: Lease) -> None:
        self._arbiter._emit("loaded", lease.id, {"reason": "load_timeout"})

    def rejected(self, request: Request, reason: PendingReason) -> None:
        self._arbiter._emit("rejected", request.id, {"reason": reason.code})
        self._arbiter._fail_waiter(request.id, Unschedulable(reason))

    def unclaimed(self, lease: Lease) -> None:  # never: presence is off in-process
        self._arbiter._expired(lease)

    def abandoned(self, request: Request) -> None:  # never: presence is off in-process
        self._arbiter._emit("abandoned", request.id)
        self._arbiter._fail_waiter(
            request.id, WaitTimeout("its asker is gone", request_id=request.id)
        )

    def timed_out(self, request: Request) -> None:
        self._arbiter._emit("timed_out", request.id)
        error = WaitTimeout(
            f"no grant within max_wait_s={request.max_wait_s}", request_id=request.id
        )
        self._arbiter._fail_waiter(request.id, error)

    def drained(self, worker: str, previous: WorkerStatus, status: WorkerStatus) -> None:
        pass  # in-process GPUs are never drained


class _LeaseBlock:
    """``async with arbiter.lease(...)``: see :meth:`Arbiter.lease`."""

    def __init__(self, arbiter: Arbiter, request: Request) -> None:
        self._arbiter = arbiter
        self._request = request
        self._handle: LeaseHandle | None = None

    async def __aenter__(self) -> LeaseHandle:
        if self._handle is not None:
            raise RuntimeError("a lease block is entered once")
        task = asyncio.current_task()
        self._handle = await self._arbiter._wait_for_grant(self._request, task)
        return self._handle

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        handle = self._handle
        assert handle is not None
        try:
            if handle._cancelled_by_arbiter and exc_type is asyncio.CancelledError:
                task = handle._task
                if task is not None and task.uncancel() == 0:
                    error = LeasePreempted if handle.revoke_reason == "preempted" else LeaseRevoked
                    raise error(handle.id, handle.revoke_reason or "revoked") from exc
        finally:
            self._arbiter._release(handle.id)
