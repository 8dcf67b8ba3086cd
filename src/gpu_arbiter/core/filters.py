"""Feasibility checks: does a GPU match a request's constraints at all?

Each check returns a rejection code or None ("a no is a value"). These are the
"does not match" checks; whether a matching GPU has room right now is the
ledger's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

from .model import Constraints, Gpu, compute_capability

__all__ = ["mismatch"]


def mismatch(gpu: Gpu, labels: Mapping[str, str], c: Constraints, vram_mb: int) -> str | None:
    """The first reason ``gpu`` (on a worker with ``labels``) can never take the request."""
    if c.worker is not None and gpu.worker != c.worker:
        return "worker_mismatch"
    if c.workers and gpu.worker not in c.workers:
        return "worker_mismatch"
    if c.gpu_ids and gpu.id not in c.gpu_ids:
        return "gpu_mismatch"
    if c.vendor is not None and gpu.vendor != c.vendor:
        return "vendor_mismatch"
    if c.gpu_arch and gpu.arch not in c.gpu_arch:
        return "arch_mismatch"
    if c.min_compute_capability is not None:
        capability = compute_capability(gpu.arch)
        if capability is None or capability < c.min_compute_capability:
            return "compute_capability_too_low"
    if c.gpu_model is not None and not fnmatchcase(gpu.model.lower(), c.gpu_model.lower()):
        return "model_mismatch"
    if any(labels.get(key) != value for key, value in c.labels):
        return "label_mismatch"
    if gpu.capacity_mb < vram_mb:
        return "too_small"
    return None
