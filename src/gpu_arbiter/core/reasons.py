"""Why a request is still pending: structured, and one human line.

Codes (Kubernetes' split between "does not match" and "does not fit"):

    paused            the arbiter is paused; nothing is granted
    no_workers        no worker is registered yet
    workers_draining  the only matching GPUs are on draining/drained/offline workers
    no_matching_gpu   no GPU matches the constraints (also a rejection reason)
    too_large         matching GPUs exist but none is big enough (a rejection reason)
    insufficient_vram matching GPUs are too full right now
    load_in_progress  the best GPU has memory, but its load gate is busy
    nominated_for     memory is held for a request ahead in the queue
    preempting        victims are being revoked for this request
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .model import GpuId
from .units import format_mb

__all__ = ["GpuVerdict", "PendingReason"]

#  Per-GPU verdicts. "Does not match" codes first, "does not fit" after.
MISMATCH_CODES = (
    "worker_mismatch",
    "vendor_mismatch",
    "arch_mismatch",
    "compute_capability_too_low",
    "model_mismatch",
    "label_mismatch",
    "too_small",
    "too_few_gpus_on_worker",
)
UNAVAILABLE_CODES = ("worker_draining", "worker_drained", "worker_offline", "probe_stale")
FIT_CODES = ("insufficient_vram", "load_in_progress", "nominated_for")


@dataclass(frozen=True, slots=True)
class GpuVerdict:
    """Why one GPU could not take the request (or ``fits``)."""

    gpu: GpuId
    code: str
    need_mb: int = 0
    free_mb: int = 0
    committed_mb: int = 0
    observed_mb: int = 0
    held_mb: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "gpu": str(self.gpu),
            "code": self.code,
            "need_mb": self.need_mb,
            "free_mb": self.free_mb,
            "committed_mb": self.committed_mb,
            "observed_mb": self.observed_mb,
            "held_mb": self.held_mb,
        }


@dataclass(frozen=True, slots=True)
class PendingReason:
    code: str
    message: str
    gpus: tuple[GpuVerdict, ...] = ()
    nominated: tuple[GpuId, ...] = ()
    blocked_by: str | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "code": self.code,
            "message": self.message,
            "gpus": [v.as_dict() for v in self.gpus],
            "nominated": [str(g) for g in self.nominated],
            "blocked_by": self.blocked_by,
        }

    @staticmethod
    def simple(code: str, message: str) -> PendingReason:
        return PendingReason(code, message)


def summarize(verdicts: tuple[GpuVerdict, ...], need_mb: int) -> str:
    """'0/12 GPUs fit: 8 insufficient_vram (need 20480, most free 16384), 4 arch_mismatch'."""
    counts = Counter(v.code for v in verdicts)
    parts = []
    for code, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        text = f"{count} {code}"
        if code == "insufficient_vram":
            most = max(v.free_mb for v in verdicts if v.code == code)
            text += f" (need {format_mb(need_mb)}, most free {format_mb(max(most, 0))})"
        elif code == "nominated_for":
            held = max(v.held_mb for v in verdicts if v.code == code)
            text += f" (up to {format_mb(held)} held for requests ahead)"
        parts.append(text)
    return f"0/{len(verdicts)} GPUs fit: " + ", ".join(parts)
