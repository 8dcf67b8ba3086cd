"""The codes of every "no" and every "why": one enum for what a GPU says of a request
(:class:`Outcome`, one per stage of :mod:`.stages`), one for why a request waits or is
refused (:class:`Why`). Both are texts: the API shows their values.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Outcome", "Why"]


class Outcome(StrEnum):
    """Why a GPU cannot take a request, by the first stage that says no; ``fits`` when
    none does (in the stages' order: does not match, not now, does not fit)."""

    WORKER_MISMATCH = "worker_mismatch"
    GPU_MISMATCH = "gpu_mismatch"
    VENDOR_MISMATCH = "vendor_mismatch"
    ARCH_MISMATCH = "arch_mismatch"
    COMPUTE_CAPABILITY_TOO_LOW = "compute_capability_too_low"
    MODEL_MISMATCH = "model_mismatch"
    LABEL_MISMATCH = "label_mismatch"
    TOO_SMALL = "too_small"
    TOO_FEW_GPUS_ON_WORKER = "too_few_gpus_on_worker"
    WORKER_DRAINING = "worker_draining"
    WORKER_DRAINED = "worker_drained"
    WORKER_OFFLINE = "worker_offline"
    PROBE_STALE = "probe_stale"
    INSUFFICIENT_VRAM = "insufficient_vram"
    NOMINATED_FOR = "nominated_for"
    LOAD_IN_PROGRESS = "load_in_progress"
    FITS = "fits"

    @property
    def helped_by(self) -> str:
        """What could change it: ``nothing`` (the GPU never matches: a request every GPU
        says this of is rejected), ``an event`` (the worker comes back, the probe reads
        again), ``room`` (memory freed, a hold ahead granted, a load finished; preemption
        may make it), or, for ``fits``, ``a cycle``."""
        if self in _NOT_NOW:
            return "an event"
        if self in _NO_ROOM:
            return "room"
        return "a cycle" if self is Outcome.FITS else "nothing"


_NOT_NOW = frozenset(
    {Outcome.WORKER_DRAINING, Outcome.WORKER_DRAINED, Outcome.WORKER_OFFLINE, Outcome.PROBE_STALE}
)
_NO_ROOM = frozenset({Outcome.INSUFFICIENT_VRAM, Outcome.NOMINATED_FOR, Outcome.LOAD_IN_PROGRESS})


class Why(StrEnum):
    """Why a request waits (a pending reason's ``code``) or is refused (a rejection's).

    Kubernetes' split between "does not match" and "does not fit"::

        paused            the arbiter is paused; nothing is granted
        no_workers        no worker is registered yet
        workers_draining  the only matching GPUs are on draining/drained/offline workers
                          or have a stale probe
        no_matching_gpu   no GPU matches the constraints, or a GPU named in gpu_ids is
                          not registered (also a rejection)
        too_large         GPUs match but none is big enough (a rejection)
        too_few_gpus      GPUs match, but no worker has enough of them (a rejection)
        insufficient_vram matching GPUs are too full right now
        load_in_progress  the best GPU has memory, but its load gate is busy
        nominated_for     memory is held for a request ahead in the queue
        preempting        victims are being revoked for this request
        queued            a GPU fits: the next cycle grants it
    """

    PAUSED = "paused"
    NO_WORKERS = "no_workers"
    WORKERS_DRAINING = "workers_draining"
    NO_MATCHING_GPU = "no_matching_gpu"
    TOO_LARGE = "too_large"
    TOO_FEW_GPUS = "too_few_gpus"
    INSUFFICIENT_VRAM = "insufficient_vram"
    LOAD_IN_PROGRESS = "load_in_progress"
    NOMINATED_FOR = "nominated_for"
    PREEMPTING = "preempting"
    QUEUED = "queued"
