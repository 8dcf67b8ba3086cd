"""What the controller's callers see besides records: its errors, its limits, the
views it answers with, its histograms and its time constants.

Owns no state and calls nothing; every other module of the package may import it.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..core import ArbiterError, PendingReason
from ..store import LeaseRecord

__all__ = [
    "GRANT_LATENCY_BOUNDS_S",
    "RELOAD_RETRY_MAX_S",
    "UPDATE_TIMEOUT_S",
    "WAIT_BOUNDS_S",
    "DrainOutcome",
    "GpuProbeReport",
    "Histogram",
    "Limits",
    "NotLeader",
    "PendingView",
    "ServiceUnavailable",
    "Submitted",
    "TooManyRequests",
]


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
class Submitted:
    """What a submit answers with, made once, in its change: the record as the cycle
    left it, whether the request is new (False: an earlier one with the same
    idempotency key, as it is now), and, while it is pending, its place in the queue
    and its reason. The answer needs nothing more from the controller."""

    record: LeaseRecord
    new: bool
    pending: PendingView | None = None


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
