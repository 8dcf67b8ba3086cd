"""``Controller``: the facade the service talks to; each call is one line into the
module that owns it, but for pause, resume and the status summary, which concern the
whole arbiter and are a change (or a read) of the core alone.

Builds :mod:`.change`, :mod:`.leases`, :mod:`.workers`, :mod:`.updates`,
:mod:`.events`, :mod:`.timer` and :mod:`.roles`, connects them (the change's sweeps,
encoders and callbacks; the workers' listener) and calls only their public calls; it
holds no state of its own beyond its configuration.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core import Gpu, GpuFigures, Lease, LeaseState, Policy, Scheduler
from ..store import Event, LeaseRecord, OperationRecord, Store, WorkerRecord
from .change import Changes
from .events import Events
from .leases import Leases
from .roles import Roles
from .timer import Timer
from .updates import Updates
from .values import (
    UPDATE_TIMEOUT_S,
    DrainOutcome,
    GpuProbeReport,
    Histogram,
    Limits,
    PendingView,
)
from .workers import Workers

__all__ = ["Controller"]


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
        self._changes = changes = Changes(store, Scheduler(self.policy), clock)
        self._events = Events(
            store,
            self.limits,
            changes.gate,
            clock,
            flush_s=self.EVENT_FLUSH_S,
            tick_s=self.EVENT_TICK_S,
        )
        self._leases = Leases(changes, store, self.limits)
        self._workers = Workers(changes, self._leases, self.limits, heartbeat_timeout_s)
        self._updates = Updates(changes, store, self._leases, self._workers)
        self._workers.listen(self._updates)
        self._timer = Timer(
            changes,
            [
                lambda: changes.scheduler.next_deadline(),
                self._workers.next_deadline,
                self._updates.next_deadline,
            ],
        )
        self._roles = Roles(
            changes,
            policy=self.policy,
            events=self._events,
            leases=self._leases,
            workers=self._workers,
            updates=self._updates,
            timer=self._timer,
            simulated=simulated,
        )
        changes.connect(
            sweeps=[self._workers.offline_sweep, self._updates.sweep],
            absorb=self._leases.absorb,
            encoders=[
                self._leases.encode,
                self._workers.encode,
                self._updates.encode,
                self._events.encode,
            ],
            stored=self._events.stored,
            recover=self._roles.recover,
            committed=self._timer.arm,
        )

    # ------------------------------------------------------------------ state, role

    @property
    def scheduler(self) -> Scheduler:
        return self._changes.scheduler

    @property
    def broken(self) -> str | None:
        return self._changes.gate.broken

    @property
    def started(self) -> bool:
        return self._changes.gate.started

    @property
    def standby(self) -> bool:
        return self._changes.gate.standby

    @property
    def leader_url(self) -> str | None:
        return self._changes.gate.leader_url

    @property
    def stopping(self) -> asyncio.Event:
        return self._changes.gate.stopping

    @property
    def wait_times(self) -> Histogram:
        return self._changes.wait_times

    @property
    def grant_latency(self) -> Histogram:
        return self._changes.grant_latency

    def start(self) -> None:
        self._roles.start()

    def mirror(self, leader_url: str | None = None) -> None:
        self._roles.mirror(leader_url)

    def demote(self, leader_url: str | None = None) -> None:
        self._roles.demote(leader_url)

    def close(self) -> None:
        self._roles.close()

    # ------------------------------------------------------------------ group commit

    def commit_in_groups(self) -> None:
        """Changes are stored in groups on a thread of their own from now on, and an
        answer must await :meth:`settled` (see :mod:`.change`)."""
        self._changes.commit_in_groups()

    @property
    def failed_changes(self) -> int:
        return self._changes.failures

    async def settled(self, failed_changes: int) -> None:
        """Every change made so far is stored; ServiceUnavailable if one failed since
        :attr:`failed_changes` read ``failed_changes``."""
        await self._changes.settled(failed_changes)

    async def flush(self) -> None:
        """At a stop: waits for the commits in flight."""
        await self._changes.flush()

    # ------------------------------------------------------------------ leases

    def submit(
        self, owner: str | None, fields: Mapping[str, Any], constraints: Mapping[str, Any]
    ) -> tuple[LeaseRecord, bool]:
        return self._leases.submit(owner, fields, constraints)

    def lease(self, lease_id: str) -> LeaseRecord:
        return self._leases.lease(lease_id)

    def leases(
        self,
        *,
        state: LeaseState | None = None,
        worker: str | None = None,
        holder: str | None = None,
    ) -> list[LeaseRecord]:
        return self._leases.leases(state=state, worker=worker, holder=holder)

    def pending_view(self, lease_id: str) -> PendingView | None:
        return self._leases.pending_view(lease_id)

    def positions(self) -> dict[str, tuple[int, int]]:
        return self._leases.positions()

    def queue(self, limit: int = 100) -> list[tuple[LeaseRecord, PendingView]]:
        return self._leases.queue(limit)

    def renew(self, lease_id: str, ttl_s: float | None = None) -> LeaseRecord:
        return self._leases.held_verb(lease_id, "renew", ttl_s)

    def ready(self, lease_id: str) -> LeaseRecord:
        return self._leases.held_verb(lease_id, "ready")

    def set_idle(self, lease_id: str, idle: bool) -> LeaseRecord:
        return self._leases.held_verb(lease_id, "idle" if idle else "busy")

    def shrink(self, lease_id: str, vram_mb: int | str) -> LeaseRecord:
        return self._leases.shrink(lease_id, vram_mb)

    def release(self, lease_id: str) -> LeaseRecord:
        return self._leases.release(lease_id)

    def revoke(self, lease_id: str, reason: str = "revoked_by_admin") -> LeaseRecord:
        return self._leases.revoke(lease_id, reason)

    # ------------------------------------------------------------------ workers

    def workers(self) -> list[WorkerRecord]:
        return self._workers.workers()

    def worker(self, name: str) -> WorkerRecord:
        return self._workers.worker(name)

    def worker_leases(self, name: str) -> list[Lease]:
        return self._workers.worker_leases(name)

    def gpu_figures(self, name: str) -> list[GpuFigures]:
        return self._workers.gpu_figures(name)

    def last_seen(self, name: str) -> float | None:
        return self._workers.last_seen(name)

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
        return self._workers.register(
            name, gpus, labels=labels, url=url, agent_version=agent_version, simulated=simulated
        )

    def heartbeat(
        self,
        name: str,
        probes: Sequence[GpuProbeReport] = (),
        *,
        stopped: Sequence[str] = (),
        stale: Sequence[int] = (),
        supervised: Sequence[str] | None = None,
    ) -> WorkerRecord:
        return self._workers.heartbeat(
            name, probes, stopped=stopped, stale=stale, supervised=supervised
        )

    def drain(
        self, name: str, *, force: bool = False, deadline_s: float | None = None
    ) -> DrainOutcome:
        return self._workers.drain(name, force=force, deadline_s=deadline_s)

    def cancel_drain(self, name: str) -> DrainOutcome:
        return self._workers.cancel_drain(name)

    def remove(self, name: str, *, force: bool = False) -> DrainOutcome:
        return self._workers.remove(name, force=force)

    # ------------------------------------------------------------------ updates

    def start_update(
        self,
        name: str,
        *,
        timeout_s: float = UPDATE_TIMEOUT_S,
        drain_deadline_s: float | None = None,
    ) -> OperationRecord:
        return self._updates.start_update(
            name, timeout_s=timeout_s, drain_deadline_s=drain_deadline_s
        )

    def operation(self, operation_id: str) -> OperationRecord:
        return self._updates.operation(operation_id)

    def update_for(self, name: str) -> dict[str, Any] | None:
        return self._updates.update_for(name)

    def report_operation(
        self, operation_id: str, step: str, outcome: str, detail: str
    ) -> OperationRecord:
        return self._updates.report_operation(operation_id, step, outcome, detail)

    def running_update(self, name: str) -> OperationRecord | None:
        return self._updates.running_update(name)

    # ------------------------------------------------------------------ arbiter

    def pause(self) -> None:
        self._changes.gate.check_available()
        with self._changes.change() as change:
            if not self.scheduler.paused:
                change.event("arbiter.paused")
            self.scheduler.pause()

    def resume(self) -> None:
        self._changes.gate.check_available()
        with self._changes.change() as change:
            if self.scheduler.paused:
                change.event("arbiter.resumed")
            self.scheduler.resume()

    def status(self) -> dict[str, Any]:
        scheduler = self.scheduler
        leases: Counter[str] = Counter(str(lease.state) for lease in scheduler.leases.values())
        workers: Counter[str] = Counter(str(w.status) for w in scheduler.workers.values())
        return {
            "paused": scheduler.paused,
            "pending": len(scheduler.queue),
            "pending_by_priority": {
                str(p): n for p, n in sorted(scheduler.queue.count_by_priority().items())
            },
            "leases_by_state": dict(leases),
            "workers_by_state": dict(workers),
            "counters": dict(scheduler.counters),
            "next_token": scheduler.next_token,
            "last_event": self._events.last_seq,
            "role": "standby" if self.standby else "leader",
            "leader": self.leader_url,
        }

    # ------------------------------------------------------------------ events

    async def wait_lease(self, lease_id: str, state: LeaseState, timeout_s: float) -> LeaseRecord:
        """The lease once its state differs from ``state``, or as it is after ``timeout_s``."""
        return await self._events.wait_lease(lease_id, state, timeout_s, self.lease)

    def events_after(self, seq: int, limit: int = 500) -> list[Event]:
        return self._events.events_after(seq, limit)

    async def wait_events(self, seq: int) -> bool:
        return await self._events.wait_events(seq)

    def wake_event_streams(self) -> None:
        """Wakes every :meth:`wait_events` now."""
        self._events.wake_streams()

    @property
    def last_event_seq(self) -> int:
        return self._events.last_seq
