"""Workers: registration, heartbeats (probe readings, stopped and supervised leases),
the offline sweep, drains, cancelled drains and removals.

Owns the worker records, when each worker was last heard from, and the heap of
heartbeat deadlines. Its part of every change (a :class:`~.change.Participant`):
:meth:`Workers.sweep` (the offline sweep) before the core decides, :meth:`Workers.encode`
for the workers a change touched. Other modules
drain a worker or cancel its drain only in a change, through :meth:`Workers.drain_in`
and :meth:`Workers.cancel_drain_in` (what :meth:`Workers.drain` and
:meth:`Workers.cancel_drain` run for an operator).

Calls the core through ``changes.scheduler``, records ended and revoked leases and
a cycle's decisions through :class:`~.leases.Leases`' public calls, and tells a
:class:`WorkerListener` (the update operations) of registrations, cancelled drains and
removals; it never imports them.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from ..core import (
    Conflict,
    Gpu,
    GpuFigures,
    GpuId,
    GpuProbe,
    Lease,
    LeaseState,
    NotFound,
    Scheduler,
    Worker,
    WorkerStatus,
)
from ..store import Batch, WorkerRecord
from .change import Change, Changes, Participant
from .leases import Leases
from .values import DrainOutcome, GpuProbeReport, Limits, TooManyRequests

__all__ = ["WorkerListener", "Workers"]

log = logging.getLogger("gpu_arbiter.controller")


class WorkerListener(Protocol):
    """What a worker's life means to the update operations."""

    def check_cancel_drain(self, name: str) -> None:
        """Raises :class:`Conflict` when the drain of ``name`` may not be cancelled now."""

    def registered(self, change: Change, name: str, version: str) -> None:
        """``name`` registered (again) with agent ``version``, in ``change``."""

    def drain_cancelled(self, change: Change, name: str) -> None:
        """An operator cancelled the drain of ``name``, in ``change``."""

    def removed(self, change: Change, name: str) -> None:
        """``name`` is being removed, in ``change`` (its leases already ended)."""


class Workers(Participant):
    def __init__(
        self,
        changes: Changes,
        leases: Leases,
        limits: Limits,
        heartbeat_timeout_s: float,
    ) -> None:
        self._changes = changes
        self._leases = leases
        self._limits = limits
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._listener: WorkerListener | None = None
        self._workers: dict[str, WorkerRecord] = {}
        self._seen: dict[str, float] = {}
        self._offline_heap: list[tuple[float, str]] = []

    def listen(self, listener: WorkerListener) -> None:
        self._listener = listener

    @property
    def _scheduler(self) -> Scheduler:
        return self._changes.scheduler

    # ------------------------------------------------------------------ reading

    def all(self) -> list[WorkerRecord]:
        """Every registered worker as it is now, by name."""
        return [self.worker_now(name) for name in sorted(self._workers)]

    def get(self, name: str) -> WorkerRecord:
        """A registered worker as it is now. Raises NotFound."""
        if name not in self._workers:
            raise NotFound(f"no worker {name!r}", worker=name)
        return self.worker_now(name)

    def leases_on(self, name: str) -> list[Lease]:
        """The held leases on a worker, by fencing token."""
        leases = self._scheduler.leases
        return sorted(
            (leases[i] for i in self._scheduler.worker_lease_ids(name)), key=lambda x: x.token
        )

    def gpu_figures(self, name: str) -> list[GpuFigures]:
        return [self._scheduler.figures(g) for g in self._scheduler.gpu_ids(name)]

    def last_seen(self, name: str) -> float | None:
        return self._seen.get(name)

    def worker_now(self, name: str) -> WorkerRecord:
        record = self._workers[name]
        status = self._scheduler.workers[name].status
        return record if record.status is status else replace(record, status=status)

    # ------------------------------------------------------------------ registration

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
        self._changes.gate.check_available()
        existing = self._workers.get(name)
        if existing is None and len(self._workers) >= self._limits.max_workers:
            raise TooManyRequests(
                f"{len(self._workers)} workers are registered (the limit)",
                limit="max_workers",
                value=self._limits.max_workers,
                current=len(self._workers),
            )
        if existing is not None and existing.simulated:
            raise Conflict(f"worker {name} is simulated by this controller")
        with self._changes.change() as change:
            status = (
                WorkerStatus.ONLINE if existing is None else self._scheduler.workers[name].status
            )
            self._scheduler.put_worker(Worker(name, status, dict(labels or {})), gpus)
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
            if self._listener is not None:
                self._listener.registered(change, name, agent_version)
        return self.get(name), existing is None

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

    # ------------------------------------------------------------------ heartbeats

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
        self._changes.gate.check_available()
        record = self.get(name)
        if record.simulated:
            raise Conflict(f"worker {name} is simulated by this controller")
        scheduler = self._scheduler
        known = set(scheduler.gpu_ids(name))
        for index in [p.index for p in probes] + list(stale):
            if GpuId(name, index) not in known:
                raise NotFound(f"worker {name} has no GPU {index}; register it first")
        ending = [lid for lid in dict.fromkeys(stopped) if lid in scheduler.worker_lease_ids(name)]
        changed = self._apply_probes(name, probes)
        for index in stale:
            changed |= not scheduler.figures(GpuId(name, index)).stale
            scheduler.set_probe(GpuId(name, index), None)
        changed = changed and len(scheduler.queue) > 0
        offline = scheduler.workers[name].status is WorkerStatus.OFFLINE
        watched = self._supervision_changes(name, supervised, ending)
        if not (changed or ending or offline or watched):  # a reading matters to pending work
            self._seen[name] = self._changes.clock()  # nothing to decide, nothing to persist
            self._push_offline_deadline(name, self._seen[name])
            return record
        with self._changes.change() as change:
            self._seen_now(name, change)
            for lease_id, watched_now in watched.items():
                self._scheduler.set_supervised(lease_id, watched_now, change.now)
                change.leases.add(lease_id)
            for lease_id in ending:
                ended = self._scheduler.release(lease_id, change.now)
                self._leases.end(change, ended, LeaseState.RELEASED, "holder_stopped")
        return self.get(name)

    def _supervision_changes(
        self, name: str, supervised: Sequence[str] | None, ending: Sequence[str]
    ) -> dict[str, bool]:
        """The worker's leases whose ``supervised`` flag the heartbeat changes."""
        if supervised is None:
            return {}
        watched = set(supervised) - set(ending)
        changes = {}
        for lease_id in self._scheduler.worker_lease_ids(name):
            now_watched = lease_id in watched
            if self._scheduler.leases[lease_id].supervised != now_watched:
                changes[lease_id] = now_watched
        return changes

    def _apply_probes(self, name: str, probes: Sequence[GpuProbeReport]) -> bool:
        changed = False
        for report in probes:
            gpu_id = GpuId(name, report.index)
            figures = self._scheduler.figures(gpu_id)
            lease_used = None if report.lease_used_mb is None else dict(report.lease_used_mb)
            self._scheduler.set_probe(gpu_id, GpuProbe(report.used_mb, lease_used))
            changed |= figures.used_mb != report.used_mb or figures.stale or lease_used is not None
        return changed

    def _seen_now(self, name: str, change: Change) -> None:
        """A sign of life: an offline worker comes back (draining if it was)."""
        self._seen[name] = change.now
        self._push_offline_deadline(name, change.now)
        worker = self._scheduler.workers[name]
        if worker.status is not WorkerStatus.OFFLINE:
            return
        back = self._workers[name].status_after_offline
        self._scheduler.set_worker_status(name, WorkerStatus.ONLINE)
        if back is WorkerStatus.DRAINING:
            self._scheduler.drain(name, change.now)
        change.workers.add(name)
        change.event("worker.online", worker=name, previous="offline", state=str(back))

    # ------------------------------------------------------------------ drains, removal

    def drain(
        self, name: str, *, force: bool = False, deadline_s: float | None = None
    ) -> DrainOutcome:
        self._changes.gate.check_available()
        self.get(name)
        with self._changes.change() as change:
            outcome = self.drain_in(change, name, force=force, deadline_s=deadline_s)
        return replace(outcome, state=str(self._scheduler.workers[name].status))

    def drain_in(
        self, change: Change, name: str, *, force: bool, deadline_s: float | None
    ) -> DrainOutcome:
        """Drains ``name`` in ``change`` (after recording what the core decides first)."""
        scheduler = self._scheduler
        record = self.worker_now(name)
        before = set(scheduler.worker_lease_ids(name))
        self._leases.absorb(change, scheduler.decide(change.now))
        still = scheduler.worker_lease_ids(name)
        revoking = {lid for lid in still if scheduler.leases[lid].state is LeaseState.REVOKING}
        revoked = scheduler.drain(name, change.now, force=force, deadline_s=deadline_s)
        fresh = [lease for lease in revoked if lease.id not in revoking]
        self._leases.revoked(change, fresh)
        deadline = None if deadline_s is None else change.now + deadline_s
        self._workers[name] = replace(self._workers[name], drain_deadline=deadline)
        change.workers.add(name)
        outcome = DrainOutcome(
            worker=name,
            previous_state=str(record.status),
            state=str(scheduler.workers[name].status),
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
        self._changes.gate.check_available()
        self.get(name)
        if self._listener is not None:
            self._listener.check_cancel_drain(name)
        with self._changes.change() as change:
            previous = self.cancel_drain_in(change, name)
            if self._listener is not None:
                self._listener.drain_cancelled(change, name)
        return DrainOutcome(
            worker=name,
            previous_state=str(previous),
            state=str(self._scheduler.workers[name].status),
            leases_left=len(self._scheduler.worker_lease_ids(name)),
        )

    def cancel_drain_in(self, change: Change, name: str) -> WorkerStatus:
        """Cancels the drain of ``name`` in ``change``; returns its previous status."""
        previous = self._scheduler.cancel_drain(name)
        self._workers[name] = replace(self._workers[name], drain_deadline=None)
        change.workers.add(name)
        change.event("worker.online", worker=name, previous=str(previous), state="online")
        return previous

    def remove(self, name: str, *, force: bool = False) -> DrainOutcome:
        """Forgets a worker. Refused while it holds leases, unless ``force``: then its leases
        are revoked (reason ``worker_removed``) and end with it."""
        self._changes.gate.check_available()
        record = self.get(name)
        held = sorted(self._scheduler.worker_lease_ids(name))
        if held and not force:
            raise Conflict(
                f"worker {name} holds {len(held)} lease(s); drain it first or remove with force",
                leases=len(held),
            )
        with self._changes.change() as change:
            for lease_id in held:
                revoked = self._scheduler.revoke(lease_id, "worker_removed", change.now)
                change.event("lease.revoked", lease_id, name, reason="worker_removed")
                ended = self._scheduler.release(lease_id, change.now)
                self._leases.end(
                    change,
                    replace(ended, revoke_reason=revoked.revoke_reason),
                    LeaseState.RELEASED,
                    "worker_removed",
                )
            if self._listener is not None:
                self._listener.removed(change, name)
            self._scheduler.remove_worker(name)
            del self._workers[name]
            self._seen.pop(name, None)
            change.removed_workers.add(name)
            change.event(
                "worker.removed", worker=name, previous=str(record.status), revoked=len(held)
            )
        return DrainOutcome(name, str(record.status), "removed", revoked=len(held))

    # ------------------------------------------------------------------ in a change

    def encode(self, change: Change, batch: Batch) -> None:
        """The workers ``change`` touched, as they are now, and those it removed."""
        for name in change.workers - change.removed_workers:
            if name in self._workers:
                batch.workers[name] = self.worker_now(name)
                self._workers[name] = batch.workers[name]
        batch.removed_workers = set(change.removed_workers)

    def sweep(self, change: Change) -> None:
        """Workers silent for the heartbeat timeout go offline: exactly one event each."""
        heap = self._offline_heap
        while heap and heap[0][0] <= change.now:
            _, name = heapq.heappop(heap)
            seen = self._seen.get(name)
            if seen is None or seen + self._heartbeat_timeout_s > change.now:
                continue  # removed, or heard from since
            status = self._scheduler.workers[name].status
            if status is WorkerStatus.OFFLINE:
                continue
            revoked = self._scheduler.set_offline(name, change.now)
            self._leases.revoked(change, revoked)
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

    def next_deadline(self) -> float | None:
        """The earliest heartbeat deadline still current (stale heap entries dropped)."""
        heap = self._offline_heap
        while heap:
            at, name = heap[0]
            seen = self._seen.get(name)
            if seen is not None and seen + self._heartbeat_timeout_s == at:
                return at
            heapq.heappop(heap)
        return None

    def _push_offline_deadline(self, name: str, seen_at: float) -> None:
        heapq.heappush(self._offline_heap, (seen_at + self._heartbeat_timeout_s, name))

    # ------------------------------------------------------------------ restore

    def clear(self) -> None:
        self._workers.clear()
        self._seen.clear()
        self._offline_heap.clear()

    def restore(self, record: WorkerRecord, now: float) -> None:
        """Gives the (new) core a stored worker; its GPUs' memory is unknown until it
        reports again, and its heartbeat is expected from ``now``."""
        name = record.name
        self._scheduler.put_worker(Worker(name, record.status, record.labels), record.gpus)
        self._workers[name] = record
        if record.simulated:
            return
        for gpu in record.gpus:  # memory unknown until the worker reports again
            self._scheduler.set_probe(gpu.id, None)
        self._seen[name] = now
        self._push_offline_deadline(name, now)
        if record.status is WorkerStatus.DRAINING and record.drain_deadline is not None:
            self._scheduler.drain(name, now, deadline_s=max(0.0, record.drain_deadline - now))

    def put_simulated(self, change: Change, gpus: Sequence[Gpu]) -> None:
        """The controller's own simulated worker, with ``gpus``."""
        name = gpus[0].worker
        existing = self._workers.get(name)
        status = existing.status if existing is not None else WorkerStatus.ONLINE
        record = WorkerRecord(
            name=name,
            status=status,
            gpus=tuple(gpus),
            url="simulated",
            agent_version="simulated",
            registered_at=existing.registered_at if existing else change.now,
            simulated=True,
        )
        self._scheduler.put_worker(Worker(name, status), gpus)
        self._workers[name] = record
        change.workers.add(name)
        if existing is None:
            change.event("worker.registered", worker=name, gpus=len(gpus))
