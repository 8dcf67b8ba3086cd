"""The events of the cluster's shape: workers come, change, drain, go offline, leave;
GPUs are probed. And the writes every event shares: a lease replaced (its victim counts
kept), a lease revoked.

A GPU that vanished from its worker but still holds leases stays, stale, until they end.
Draining stops new work on a worker (I7); ``force`` revokes its leases now, a deadline
later (the plan's :mod:`.endings`). A worker that goes offline while draining has its
drain finished: its leases are revoked.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import Conflict, InvalidInput, NotFound
from .model import Gpu, GpuId, GpuProbe, Lease, LeaseState, Worker, WorkerStatus, evolve
from .state import State
from .timers import TimerKind

__all__ = ["WorkerEvents"]


class WorkerEvents(State):
    def put_worker(self, worker: Worker, gpus: Sequence[Gpu]) -> None:
        """Registers a worker or replaces its GPUs.

        A GPU that vanished but still holds leases stays, stale, until they end. A GPU
        registered smaller than its leases is accepted, over-committed: it gets no grant
        until they are back under its capacity (refusing it would leave the worker unable
        to come back, e.g. after a driver change)."""
        for gpu in gpus:
            if gpu.worker != worker.name:
                raise InvalidInput("gpus", f"GPU {gpu.id} does not belong to worker {worker.name}")
        if len({gpu.index for gpu in gpus}) != len(gpus):
            raise InvalidInput("gpus", "GPU indexes must be unique")
        self._reshaped |= self._reshapes(worker, gpus)
        self.workers[worker.name] = worker
        new_ids = [gpu.id for gpu in gpus]
        for old in self._worker_gpus.get(worker.name, []):
            if old not in new_ids:
                if self.ledger.lease_ids(old):
                    self.ledger.set_probe(old, None)
                    new_ids.append(old)
                else:
                    self.ledger.drop_gpu(old)
        for gpu in gpus:
            self.ledger.put_gpu(gpu)
        self._worker_gpus[worker.name] = sorted(new_ids)
        self._worker_leases.setdefault(worker.name, set())
        self._changed_workers()

    def _reshapes(self, worker: Worker, gpus: Sequence[Gpu]) -> bool:
        """Whether re-registering ``worker`` changes its labels or GPUs (so pending requests
        may no longer be satisfiable); a new worker only adds room."""
        old = self.workers.get(worker.name)
        if old is None:
            return False
        before = {self.ledger.gpu(g) for g in self._worker_gpus.get(worker.name, ())}
        return dict(old.labels) != dict(worker.labels) or before != set(gpus)

    def remove_worker(self, name: str) -> None:
        """Forgets a worker and its GPUs. Its leases must have ended first."""
        self._worker(name)
        if self._worker_leases.get(name):
            raise Conflict(f"worker {name} still holds {len(self._worker_leases[name])} lease(s)")
        self._reshaped = True
        for gpu_id in self._worker_gpus.pop(name, []):
            self.ledger.drop_gpu(gpu_id)
        del self.workers[name]
        self._worker_leases.pop(name, None)
        self._drain_deadlines.pop(name, None)
        self._changed_workers()

    def set_worker_status(self, name: str, status: WorkerStatus) -> WorkerStatus:
        """Sets a status as is (restoring state); returns the previous one."""
        worker = self._worker(name)
        self.workers[name] = evolve(worker, status=status)
        self._drain_check.add(name)
        self._workers_changed()
        return worker.status

    def drain(
        self, name: str, now: float, *, force: bool = False, deadline_s: float | None = None
    ) -> list[Lease]:
        """No new work on ``name``; ``force`` revokes its leases now, ``deadline_s`` later."""
        worker = self._worker(name)
        if worker.status is WorkerStatus.OFFLINE:
            raise Conflict(f"worker {name} is offline")
        if worker.status is WorkerStatus.ONLINE:
            self.workers[name] = evolve(worker, status=WorkerStatus.DRAINING)
            self._workers_changed()
        self._drain_check.add(name)
        if force:
            return self._revoke_worker(name, "drain", now)
        if deadline_s is not None:
            self._drain_deadlines[name] = now + deadline_s
            self._timers.push(now + deadline_s, TimerKind.DRAIN, name)
        return []

    def cancel_drain(self, name: str) -> WorkerStatus:
        worker = self._worker(name)
        if worker.status not in (WorkerStatus.DRAINING, WorkerStatus.DRAINED):
            raise Conflict(f"worker {name} is {worker.status}, not draining")
        self.workers[name] = evolve(worker, status=WorkerStatus.ONLINE)
        self._drain_deadlines.pop(name, None)
        self._workers_changed()
        return worker.status

    def set_offline(self, name: str, now: float) -> list[Lease]:
        """Heartbeat lost. A draining worker has its drain finished: its leases are revoked."""
        worker = self._worker(name)
        revoked: list[Lease] = []
        if worker.status is WorkerStatus.DRAINING:
            revoked = self._revoke_worker(name, "drain", now)
        self.workers[name] = evolve(worker, status=WorkerStatus.OFFLINE)
        self._drain_deadlines.pop(name, None)
        self._workers_changed()
        return revoked

    def _revoke_worker(self, name: str, reason: str, now: float) -> list[Lease]:
        """Revokes the worker's leases not already being revoked; returns those."""
        return [
            self.revoke(lid, reason, now)
            for lid in sorted(self._worker_leases.get(name, ()))
            if self.leases[lid].state is not LeaseState.REVOKING
        ]

    def set_probe(self, gpu_id: GpuId, probe: GpuProbe | None) -> None:
        if gpu_id not in self.ledger:
            raise NotFound(f"no GPU {gpu_id}")
        if (probe is None) != self.ledger.stale(gpu_id):
            self._workers_changed()
        self.ledger.set_probe(gpu_id, probe)

    def _changed_workers(self) -> None:
        self._match_cache.clear()
        self._mismatch_cache.clear()
        self._workers_changed()

    def revoke(
        self, lease_id: str, reason: str, now: float, *, for_request: str | None = None
    ) -> Lease:
        """Starts taking a lease back. Its memory stays committed until it ends (I4)."""
        lease = self.lease(lease_id)
        if lease.state is LeaseState.REVOKING:
            return lease
        return self._put_revoked(lease, self.revoked(lease, reason, now, for_request))

    # ------------------------------------------------------------------ bookkeeping

    def _put_revoked(self, lease: Lease, revoked: Lease) -> Lease:
        self.counters[f"revoked:{revoked.revoke_reason}"] += 1
        if revoked.expires_at != lease.expires_at:
            self._timers.push(revoked.expires_at, TimerKind.TTL, lease.id)
        return self._put(lease, revoked)

    def _put(self, old: Lease, new: Lease) -> Lease:
        self._count_victim(old, -1)
        self.leases[new.id] = new
        self._count_victim(new, 1)
        return new

    def _forget_lease(self, lease: Lease) -> None:
        self._count_victim(lease, -1)

    def _count_victim(self, lease: Lease, delta: int) -> None:
        if lease.state is LeaseState.REVOKING or not (lease.idle or lease.request.preemptible):
            return
        counter = self._idle if lease.idle else self._victims
        priority = lease.request.priority
        count = counter.pop(priority, 0) + delta
        if count > 0:
            counter[priority] = count

    def _worker(self, name: str) -> Worker:
        try:
            return self.workers[name]
        except KeyError:
            raise NotFound(f"no worker {name!r}") from None
