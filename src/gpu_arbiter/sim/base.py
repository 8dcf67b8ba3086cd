"""What every simulated policy implements, and the values passed to and from it.

The simulated world (:mod:`.world`) owns the clock and the holders' processes;
a policy (an :class:`Allocator`) only decides: which pending attempt gets
which GPUs, and which leases to take back. The world reports each event with
the time, then asks ``decide(now)`` — the calling convention of
:class:`gpu_arbiter.core.Scheduler`, so that "ours" is the core itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from ..core import GpuId
from .trace import TraceRequest

__all__ = ["Allocator", "Attempt", "Step", "priority_class"]


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try at running a trace request: the first, or a re-queue after preemption.

    ``id`` is the request id in the policy, and the lease id once granted."""

    id: str
    index: int
    item: TraceRequest
    submitted_at: float
    seq: int


@dataclass(frozen=True, slots=True)
class Step:
    """What one ``decide`` returned: grants (lease id, GPUs) and revocations (lease id,
    reason)."""

    grants: tuple[tuple[str, tuple[GpuId, ...]], ...] = ()
    revocations: tuple[tuple[str, str], ...] = ()


class Allocator(Protocol):
    """A scheduling policy under simulation.

    ``keeps_warm``: a finished run leaves the model loaded (``set_idle``) for the
    next request for it, instead of releasing the lease."""

    name: ClassVar[str]
    keeps_warm: ClassVar[bool]

    def submit(self, attempt: Attempt, now: float) -> str | None:
        """Queues an attempt; returns why it can never run (rejected) or None."""
        ...

    def cancel(self, attempt_id: str) -> None: ...

    def ready(self, lease_id: str, now: float) -> None: ...

    def set_idle(self, lease_id: str, idle: bool, now: float) -> None: ...

    def release(self, lease_id: str, now: float) -> None: ...

    def decide(self, now: float) -> Step: ...

    def next_deadline(self) -> float | None: ...

    def check(self, now: float, step: Step, present: Mapping[str, tuple[GpuId, ...]]) -> list[str]:
        """Invariant violations in the policy's own books after ``step`` ([] when none).
        ``present``: the leases whose processes hold memory now, and where."""
        ...


def priority_class(priority: int) -> str:
    """The class a priority is reported under: interactive (>= 800), normal (>= 500),
    background (>= 300), batch."""
    if priority >= 800:
        return "interactive"
    if priority >= 500:
        return "normal"
    if priority >= 300:
        return "background"
    return "batch"
