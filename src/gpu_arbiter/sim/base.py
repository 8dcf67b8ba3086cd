"""What every simulated policy implements, and the values passed to and from it.

The simulated world (:mod:`.world`) owns the clock and the holders' processes;
a policy (an :class:`Allocator`) only decides: which pending attempt gets
which GPUs, and which leases to take back. The world reports each event with
the time, then asks ``decide(now)`` — the calling convention of
:class:`gpu_arbiter.core.Scheduler`, so that "ours" is the core itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from ..core import GpuId, InvalidInput
from .trace import TraceRequest

__all__ = ["Allocator", "Attempt", "SleepTier", "Sleeper", "Step", "priority_class"]


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


@dataclass(frozen=True, slots=True)
class SleepTier:
    """How a model server sleeps (vLLM level 1, SGLang, llama.cpp): an idle-warm model
    idle ``after_s`` is put to sleep; it keeps its process and ``resident`` x its size
    (what stays on the GPU: CUDA graphs, the context) and gives the rest back, which the
    probe shows free ``sleep_s`` later. A request for it asks for the difference on the
    same GPUs and, once granted, runs ``wake_s`` later instead of after a cold load; not
    granted within the model's load time (others hold that memory now), it gives up:
    the sleeping model stops and the request starts cold, anywhere."""

    after_s: float = 60.0
    resident: float = 0.15
    sleep_s: float = 2.0
    wake_s: float = 1.0

    def __post_init__(self) -> None:
        for name, value, high in (
            ("sleep-after", self.after_s, 86400.0),
            ("sleep-s", self.sleep_s, 3600.0),
            ("wake-s", self.wake_s, 3600.0),
        ):
            if not (math.isfinite(value) and 0 <= value <= high):
                raise InvalidInput(name, f"{value!r} is outside 0..{high:g} seconds")
        if not (math.isfinite(self.resident) and 0 < self.resident < 1):
            raise InvalidInput("sleep-resident", f"{self.resident!r} is not a fraction in (0, 1)")

    def resident_mb(self, vram_mb: int) -> int:
        """What a sleeping model of ``vram_mb`` keeps per GPU: at least 1 MiB (a lease's
        least), at most all of it (then it does not sleep)."""
        return max(1, min(vram_mb, math.ceil(vram_mb * self.resident)))


@runtime_checkable
class Sleeper(Allocator, Protocol):
    """A policy whose models sleep (:class:`SleepTier`). The world tells it what each
    process holds on a GPU (``observe``: the probe), so that memory a sleeping process has
    not given back yet is never granted (I2, I4)."""

    tier: SleepTier

    def sleep(self, lease_ids: tuple[str, ...], vram_mb: int, now: float) -> None:
        """The model of these leases (its own, then its wake's) goes to sleep, keeping
        ``vram_mb`` per GPU on the first."""
        ...

    def wake(
        self, attempt: Attempt, asleep: str, gpus: tuple[GpuId, ...], vram_mb: int, now: float
    ) -> str | None:
        """Asks for ``vram_mb`` more on exactly ``gpus`` for ``attempt`` (its id is the
        request's), never taking the sleeping lease ``asleep`` it extends: None, or why it
        can never be granted."""
        ...

    def observe(self, gpu_id: GpuId, used_mb: Mapping[str, int]) -> None:
        """A probe of ``gpu_id``: what each lease's process holds there now."""
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
