"""The stages that decide whether a GPU may take a request, built in one place.

A cycle asks, for each request in queue order, GPU by GPU::

    feasible    does it match at all?       the constraints, enough such GPUs on one
                                            worker (cached per shape: workers rarely change)
                may it take new work now?   its worker online (I7), its probe fresh (I2)
    fit         does it fit now?            free memory (I1, I2), the holds of the
                                            nominations ahead of it (I6), the load gate (I3)
    rank        which of those?             binpack or spread (:mod:`.cycle`)
    post-filter none fits: what would help? preemption and keep-warm reclaim (I5, in
                                            :mod:`.cycle` and :mod:`.preemption`), else a
                                            nomination on its best GPU (:mod:`.nominations`)

The order is the order of the questions an operator asks ("does it match? is the machine
up? is there room? is someone ahead of me? is a load running?"), so the first "no" is the
most useful one. Each stage returns an outcome code when it says no and None when it
passes. Placement asks them (:func:`outcome` is None), and "why is it pending" is the
codes they returned (:func:`outcome` for every GPU, summarized in :mod:`.reasons`):
one set of rules for both, so the why cannot drift from the what. Codes:

    does not match (nothing will help)      worker_mismatch gpu_mismatch vendor_mismatch
                                            arch_mismatch compute_capability_too_low
                                            model_mismatch label_mismatch too_small
                                            too_few_gpus_on_worker
    not now (an event may help)             worker_draining worker_drained worker_offline
                                            probe_stale
    does not fit (preemption may help)      insufficient_vram nominated_for
                                            load_in_progress

A new rule (MIG slices, NUMA, a warm model's affinity) is one more function here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from .filters import mismatch
from .ledger import Ledger
from .model import GpuId, Policy, Request, Worker, WorkerStatus

__all__ = ["FEASIBLE", "FIT", "STAGES", "State", "fits", "outcome", "usable"]


class State(Protocol):
    """What the stages read: the scheduler's state."""

    @property
    def policy(self) -> Policy: ...
    @property
    def workers(self) -> Mapping[str, Worker]: ...
    @property
    def ledger(self) -> Ledger: ...
    def matching(self, request: Request) -> frozenset[GpuId]: ...


Holds = Mapping[GpuId, int]
Stage = Callable[[State, Request, GpuId, Holds], str | None]


def matches(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> str | None:
    """The constraints, and enough matching GPUs on the worker (the cached set per shape
    answers at once; the code is worked out only for a GPU that does not match)."""
    if gpu_id in state.matching(request):
        return None
    worker = state.workers[gpu_id.worker]
    gpu = state.ledger.gpu(gpu_id)
    return mismatch(gpu, worker.labels, request.constraints, request.vram_mb) or (
        "too_few_gpus_on_worker"
    )


def worker_online(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> str | None:
    """I7: nothing new on a worker that is draining, drained or offline."""
    status = state.workers[gpu_id.worker].status
    return None if status is WorkerStatus.ONLINE else f"worker_{status}"


def probe_fresh(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> str | None:
    """I2: a GPU whose probe failed has unknown memory."""
    return "probe_stale" if state.ledger.stale(gpu_id) else None


def memory(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> str | None:
    """I1, I2: capacity less what is committed or observed, whichever is more."""
    return "insufficient_vram" if state.ledger.free_mb(gpu_id) < request.vram_mb else None


def nominations_ahead(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> str | None:
    """I6: only the memory beyond the holds of the requests ahead of it."""
    room = state.ledger.free_mb(gpu_id) - holds.get(gpu_id, 0)
    return "nominated_for" if room < request.vram_mb else None


def load_gate(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> str | None:
    """I3: at most ``max_concurrent_loads`` loads at once per GPU."""
    open_ = state.ledger.loading(gpu_id) < state.policy.max_concurrent_loads
    return None if open_ else "load_in_progress"


FEASIBLE: tuple[Stage, ...] = (matches, worker_online, probe_fresh)
FIT: tuple[Stage, ...] = (memory, nominations_ahead, load_gate)
STAGES: tuple[Stage, ...] = FEASIBLE + FIT


def outcome(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> str | None:
    """The first stage that says no, by its code; None when the request fits on the GPU."""
    for stage in STAGES:
        code = stage(state, request, gpu_id, holds)
        if code is not None:
            return code
    return None


def fits(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> bool:
    return gpu_id in state.ledger and outcome(state, request, gpu_id, holds) is None


def usable(state: State, gpu_id: GpuId) -> bool:
    """A GPU that may take new work: the stages after the match that do not depend on the
    request (worker online, probe fresh)."""
    return state.workers[gpu_id.worker].status is WorkerStatus.ONLINE and not state.ledger.stale(
        gpu_id
    )
