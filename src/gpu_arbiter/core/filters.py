"""Feasibility checks: does a GPU match a request's constraints at all?

:func:`mismatch` returns the first "does not match" :class:`~.outcomes.Outcome`, or None
("a no is a value"). Whether a matching GPU has room right now is the ledger's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

from .model import Constraints, Gpu, compute_capability
from .outcomes import Outcome

__all__ = ["mismatch"]


def mismatch(gpu: Gpu, labels: Mapping[str, str], c: Constraints, vram_mb: int) -> Outcome | None:
    """The first reason ``gpu`` (on a worker with ``labels``) can never take the request."""
    if c.worker is not None and gpu.worker != c.worker:
        return Outcome.WORKER_MISMATCH
    if c.workers and gpu.worker not in c.workers:
        return Outcome.WORKER_MISMATCH
    if c.gpu_ids and gpu.id not in c.gpu_ids:
        return Outcome.GPU_MISMATCH
    if c.vendor is not None and gpu.vendor != c.vendor:
        return Outcome.VENDOR_MISMATCH
    if c.gpu_arch and gpu.arch not in c.gpu_arch:
        return Outcome.ARCH_MISMATCH
    if c.min_compute_capability is not None:
        capability = compute_capability(gpu.arch)
        if capability is None or capability < c.min_compute_capability:
            return Outcome.COMPUTE_CAPABILITY_TOO_LOW
    if c.gpu_model is not None and not fnmatchcase(gpu.model.lower(), c.gpu_model.lower()):
        return Outcome.MODEL_MISMATCH
    if any(labels.get(key) != value for key, value in c.labels):
        return Outcome.LABEL_MISMATCH
    if gpu.capacity_mb < vram_mb:
        return Outcome.TOO_SMALL
    return None
