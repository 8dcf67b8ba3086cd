"""Rejection at submit: the cached fast path agrees with the full diagnosis."""

from __future__ import annotations

import pytest

from gpu_arbiter.core import Constraints, Gpu, Request, Scheduler, Unschedulable, Worker


def _scheduler() -> Scheduler:
    scheduler = Scheduler()
    for name, count in (("a", 2), ("b", 1)):
        gpus = [Gpu(index=i, total_mb=24576, arch="sm_86", worker=name) for i in range(count)]
        scheduler.put_worker(Worker(name), gpus)
    return scheduler


@pytest.mark.parametrize(
    ("vram_mb", "gpus", "constraints", "code"),
    [
        (1024, 1, Constraints(), None),
        (1024, 2, Constraints(), None),
        (1024, 3, Constraints(), "too_few_gpus"),
        (1024, 2, Constraints(worker="b"), "too_few_gpus"),
        (30000, 1, Constraints(), "too_large"),
        (1024, 1, Constraints(gpu_arch=("sm_90",)), "no_matching_gpu"),
    ],
)
def test_rejection(vram_mb: int, gpus: int, constraints: Constraints, code: str | None) -> None:
    scheduler = _scheduler()
    request = Request.build("r", vram_mb=vram_mb, gpus=gpus, constraints=constraints)
    reason = scheduler.rejection_for(request)
    assert (reason and reason.code) == code
    if code is not None:
        with pytest.raises(Unschedulable):
            scheduler.submit(request, 0.0)
    # asked twice (the second time from the cache), the answer is the same
    again = scheduler.rejection_for(request)
    assert (again and again.code) == code
