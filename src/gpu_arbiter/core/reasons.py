"""Why a request is still pending: structured, and one human line.

Codes (Kubernetes' split between "does not match" and "does not fit"):

    paused            the arbiter is paused; nothing is granted
    no_workers        no worker is registered yet
    workers_draining  the only matching GPUs are on draining/drained/offline workers
    no_matching_gpu   no GPU matches the constraints, or a GPU named in gpu_ids is not
                      registered (also a rejection reason)
    too_large         matching GPUs exist but none is big enough (a rejection reason)
    insufficient_vram matching GPUs are too full right now
    load_in_progress  the best GPU has memory, but its load gate is busy
    nominated_for     memory is held for a request ahead in the queue
    preempting        victims are being revoked for this request

The last three name what is in the way (a :class:`Blocker`: the loading lease, the
preempted lease still stopping, the request ahead), with its holder and when it ends
at the latest, in the structured fields and in the sentence alike.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .model import GpuId
from .units import format_mb, format_s

__all__ = ["Blocker", "GpuVerdict", "PendingReason"]

#  Per-GPU verdicts. "Does not match" codes first, "does not fit" after.
MISMATCH_CODES = (
    "worker_mismatch",
    "gpu_mismatch",
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
class Blocker:
    """What a pending request waits on, by name.

    ``kind``: ``loading`` (a lease whose load holds the GPU's load gate), ``revoking`` (a
    preempted lease whose holder has not stopped yet) or ``request`` (a request ahead in
    the queue that holds the memory). ``since``: loading since, revoked at, or waiting
    since. ``until``: when it ends at the latest (the load timeout; the end of the
    grace). ``expires_at``: its TTL, which ends it sooner unless it is renewed."""

    kind: str
    id: str
    holder: str | None
    gpus: tuple[GpuId, ...]
    since: float
    until: float | None = None
    expires_at: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "id": self.id,
            "holder": self.holder,
            "gpus": [str(g) for g in self.gpus],
            "since": self.since,
            "until": self.until,
            "expires_at": self.expires_at,
        }

    @property
    def who(self) -> str:
        """``lease L (holder 'chat')``, ``request R (holder 'big-train')``."""
        noun = "request" if self.kind == "request" else "lease"
        return f"{noun} {self.id}" + (f" (holder {self.holder!r})" if self.holder else "")


@dataclass(frozen=True, slots=True)
class PendingReason:
    """Why a request waits: a ``code``, the sentence (``message``), each GPU's verdict,
    the GPUs nominated for it, and what is in the way: ``blocker`` (named, with its
    holder and times) and ``blocked_by``, its id (for ``preempting``, only once the
    victim has let its grace pass)."""

    code: str
    message: str
    gpus: tuple[GpuVerdict, ...] = ()
    nominated: tuple[GpuId, ...] = ()
    blocked_by: str | None = None
    blocker: Blocker | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "code": self.code,
            "message": self.message,
            "gpus": [v.as_dict() for v in self.gpus],
            "nominated": [str(g) for g in self.nominated],
            "blocked_by": self.blocked_by,
            "blocker": None if self.blocker is None else self.blocker.as_dict(),
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


def _gpus(blocker: Blocker) -> str:
    return ", ".join(map(str, blocker.gpus))


def loading_sentence(blocker: Blocker, now: float) -> str:
    """'lease L (holder 'chat') has been loading on vm:0 for 12s; the gate opens when it is
    ready, at the latest in 4.8m (its load timeout), or in 18s if its TTL lapses unrenewed'."""
    text = (
        f"{blocker.who} has been loading on {_gpus(blocker)} for "
        f"{format_s(now - blocker.since)}; the gate opens when it is ready"
    )
    if blocker.until is not None:
        text += f", at the latest in {format_s(blocker.until - now)} (its load timeout)"
    if blocker.expires_at is not None and (
        blocker.until is None or blocker.expires_at < blocker.until
    ):
        text += f", or in {format_s(blocker.expires_at - now)} if its TTL lapses unrenewed"
    return text


def revoking_sentence(blocker: Blocker, now: float, grace_s: float) -> str:
    """'lease V (holder 'batch') was preempted 3s ago; 7.0s of its 10s grace left to stop', or,
    past its grace, 'lease V has ignored its revocation for 24s (grace 10s)'."""
    ago = format_s(now - blocker.since)
    if blocker.until is not None and now > blocker.until:
        return f"{blocker.who} has ignored its revocation for {ago} (grace {format_s(grace_s)})"
    text = f"{blocker.who} was preempted {ago} ago"
    if blocker.until is None:
        return text
    left = format_s(blocker.until - now)
    return f"{text}; {left} of its {format_s(grace_s)} grace left to stop"


def holding_sentence(blocker: Blocker, held_mb: int) -> str:
    """'up to 20.0 GiB of vm:0 is held for request R (holder 'big-train'), ahead in the
    queue'."""
    where = _gpus(blocker)
    return f"up to {format_mb(held_mb)} of {where} is held for {blocker.who}, ahead in the queue"
