"""Small builders shared by the decision-core tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpu_arbiter.core import Gpu, GpuId, Policy, Request, Scheduler, Worker

GiB = 1024


def gpu(index: int = 0, total_mb: int = 24 * GiB, worker: str = "w1", **fields: Any) -> Gpu:
    return Gpu(index=index, total_mb=total_mb, worker=worker, **fields)


def gid(text: str) -> GpuId:
    return GpuId.parse(text)


def scheduler(
    *gpus: Gpu,
    policy: Policy | None = None,
    labels: Mapping[str, Mapping[str, str]] | None = None,
) -> Scheduler:
    """A scheduler with ``gpus`` registered, one worker per distinct ``gpu.worker``."""
    sched = Scheduler(policy or Policy())
    by_worker: dict[str, list[Gpu]] = {}
    for g in gpus:
        by_worker.setdefault(g.worker, []).append(g)
    for name, worker_gpus in by_worker.items():
        sched.put_worker(Worker(name, labels=dict((labels or {}).get(name, {}))), worker_gpus)
    return sched


def req(request_id: str, vram_mb: int | str, **fields: Any) -> Request:
    """A validated request; no TTL unless ``ttl_s`` is given (time in these tests jumps)."""
    fields.setdefault("ttl_s", None)
    return Request.build(request_id, vram_mb=vram_mb, **fields)


def granted_ids(decisions: Any) -> list[str]:
    return [lease.id for lease in decisions.grants]


def revoked_ids(decisions: Any) -> list[str]:
    return [lease.id for lease in decisions.revocations]


def grant_now(sched: Scheduler, request: Request, now: float = 0.0, *, ready: bool = True) -> str:
    """Submits ``request``, runs a cycle that must grant it, and marks it loaded."""
    sched.submit(request, now)
    decisions = sched.decide(now)
    assert request.id in granted_ids(decisions), decisions
    if ready:
        sched.ready(request.id, now)
    return request.id
