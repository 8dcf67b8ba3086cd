"""What a plan reads: the state, as a read-only view.

:func:`~.cycle.plan` is typed on :class:`View`, never on the scheduler: the scheduler
(:mod:`.scheduler`) is one view, a copy of it another, and nothing a plan is made from is
written while it is made (Nomad's planner reads the state's allocations, less its planned
evictions, plus its planned placements; :class:`~.overlay.Overlay` keeps those).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Protocol

from .ledger import Ledger
from .model import GpuId, Lease, Policy, Request, Worker
from .nominations import Nomination
from .outcomes import Outcome
from .queue import PendingQueue
from .reasons import PendingReason
from .timers import TimerKind

__all__ = ["View"]


class View(Protocol):
    @property
    def policy(self) -> Policy: ...
    @property
    def paused(self) -> bool: ...
    @property
    def next_token(self) -> int: ...
    @property
    def workers(self) -> Mapping[str, Worker]: ...
    @property
    def leases(self) -> Mapping[str, Lease]: ...
    @property
    def queue(self) -> PendingQueue: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def nominations(self) -> Mapping[str, Nomination]: ...
    @property
    def reshaped(self) -> bool:
        """The cluster lost GPUs or changed them: pending requests are checked again."""
        ...

    @property
    def drain_check(self) -> Set[str]:
        """Draining workers that may have become empty."""
        ...

    def due(self, now: float) -> list[tuple[TimerKind, str]]:
        """The live timers due at ``now``, in order."""
        ...

    def matching(self, request: Request) -> frozenset[GpuId]: ...
    def gpu_ids(self, worker: str | None = None) -> list[GpuId]: ...
    def worker_lease_ids(self, name: str) -> set[str]: ...
    def victim_counts(self, *, copy: bool = True) -> tuple[dict[int, int], dict[int, int]]: ...
    def revoked(
        self, lease: Lease, reason: str, now: float, for_request: str | None = None
    ) -> Lease: ...
    def retry_pending(self, at: float) -> bool: ...
    def claimed_at_grant(self, request_id: str) -> bool: ...
    def rejection_for(self, request: Request) -> PendingReason | None: ...
    def mismatches(self, request: Request) -> Mapping[Outcome, tuple[int, GpuId]]:
        """The GPUs that never match the request, by outcome: how many, and one of them."""
        ...

    def unusable(self) -> Mapping[GpuId, Outcome]:
        """GPUs that may take no new work, and why."""
        ...
