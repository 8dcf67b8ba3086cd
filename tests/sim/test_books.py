"""The baselines' books keep their figures as leases come, change and go: after every step of
a real simulated run, each figure equals a recount from the leases themselves, and the
queue is the pending requests in the policy's order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import pytest

from gpu_arbiter.core import GpuId
from gpu_arbiter.sim import Simulation, Step, generate, parse_cluster, summarize
from gpu_arbiter.sim.baselines import BASELINES, _Baseline, _Books


def _recount(books: _Books) -> dict[str, object]:
    """Every figure the books keep, counted again from the leases."""
    free = dict(books.capacity)
    loading = dict.fromkeys(books.capacity, 0)
    revoking_mb = dict.fromkeys(books.capacity, 0)
    idle_mb = dict.fromkeys(books.capacity, 0)
    busy_mb: dict[GpuId, Counter[int]] = {g: Counter() for g in books.capacity}
    busy: Counter[int] = Counter()
    workers: Counter[str] = Counter()
    for lease in books.leases.values():
        preemptible = lease.attempt.item.preemptible
        for g in lease.gpus:
            free[g] -= lease.reserved_mb
            loading[g] += lease.loading
            workers[g.worker] += lease.loading
            if lease.revoking:
                revoking_mb[g] += lease.reserved_mb
            elif lease.idle:
                idle_mb[g] += lease.reserved_mb
            elif preemptible:
                busy_mb[g][lease.priority] += lease.reserved_mb
        if not lease.revoking and not lease.idle and preemptible:
            busy[lease.priority] += 1
    leases = books.leases.values()
    return {
        "free_mb": free,
        "loading": loading,
        "loading_workers": +workers,
        "revoking_mb": revoking_mb,
        "revoking_count": sum(lease.revoking for lease in leases),
        "idle_mb": idle_mb,
        "idle_count": sum(lease.idle and not lease.revoking for lease in leases),
        "busy_mb": {g: +c for g, c in busy_mb.items()},
        "busy_priorities": busy,
        "models": Counter(lease.attempt.item.model for lease in leases),
        "by_gpu": {g: {i for i, le in books.leases.items() if g in le.gpus} for g in free},
    }


def _kept(books: _Books) -> dict[str, object]:
    """The same figures as the books keep them."""
    return {
        "free_mb": books.free_mb,
        "loading": books.loading,
        "loading_workers": +books.loading_workers,
        "revoking_mb": books.revoking_mb,
        "revoking_count": books.revoking_count,
        "idle_mb": books.idle_mb,
        "idle_count": books.idle_count,
        "busy_mb": {g: +c for g, c in books.busy_mb.items()},
        "busy_priorities": books.busy_priorities,
        "models": books.models,
        "by_gpu": {g: set(leases) for g, leases in books.by_gpu.items()},
    }


def _checked(cls: type[_Baseline]) -> type[_Baseline]:
    class Checked(cls):  # type: ignore[valid-type,misc]
        def check(
            self, now: float, step: Step, present: Mapping[str, tuple[GpuId, ...]]
        ) -> list[str]:
            problems = [
                f"{now}: {name} kept {kept!r}, recounted {counted!r}"
                for (name, kept), counted in zip(
                    _kept(self.books).items(), _recount(self.books).values(), strict=True
                )
                if kept != counted
            ]
            ordered = sorted(self.pending.values(), key=self._queue_key)
            if self._order() != ordered:
                problems.append(f"{now}: the queue is out of order")
            return problems

    return Checked


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_kept_figures_equal_a_recount_after_every_step(name: str) -> None:
    cluster = parse_cluster("medium")
    trace = generate("mixed", 5, cluster, hours=0.5)
    checked = Simulation(trace, cluster, _checked(BASELINES[name])(cluster)).run()
    assert checked.violations == []
    assert checked.steps > 100
    plain = Simulation(trace, cluster, BASELINES[name](cluster)).run()
    assert summarize(checked) == summarize(plain)
