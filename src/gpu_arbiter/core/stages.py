"""The stages that decide whether a GPU may take a request, built in one place.

A cycle asks, for each request in queue order, GPU by GPU::

    feasible    does it match at all?       the constraints, enough such GPUs on one
                                            worker (cached per shape: workers rarely change)
                may it take new work now?   its worker online (I7), its probe fresh (I2)
    fit         does it fit now?            free memory (I1, I2), the holds of the
                                            nominations ahead of it (I6), the load gate (I3)
    rank        which of those?             the preferred workers' GPUs first when any
                                            fits (``constraints.prefer_workers``: where a
                                            model last ran), then binpack or spread
                                            (:mod:`.cycle`); an order, never a "no"
    post-filter none fits: what would help? preemption and keep-warm reclaim (I5, in
                                            :mod:`.cycle` and :mod:`.preemption`), else a
                                            nomination on its best GPU (:mod:`.nominations`)

The order is the order of the questions an operator asks ("does it match? is the machine
up? is there room? is someone ahead of me? is a load running?"), so the first "no" is the
most useful one. Each stage returns an outcome code when it says no and None when it
passes: an :class:`Outcome`, typed, whose value is the code the API shows, and which
says what could help (:attr:`Outcome.helped_by`). Placement asks them (:func:`outcome`
is None), and "why is it pending" is the codes they returned (:func:`outcome` for every
GPU, summarized in :mod:`.reasons`): one set of rules for both, so the why cannot drift
from the what. Codes:

    does not match (nothing helps)          worker_mismatch gpu_mismatch vendor_mismatch
                                            arch_mismatch compute_capability_too_low
                                            model_mismatch label_mismatch too_small
                                            too_few_gpus_on_worker
    not now (an event may help)             worker_draining worker_drained worker_offline
                                            probe_stale
    does not fit (room helps; preemption    insufficient_vram nominated_for
    may make it)                            load_in_progress

A new rule (MIG slices, NUMA) is one more function here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Protocol

from .filters import mismatch
from .ledger import Ledger
from .model import GpuId, Policy, Request, Worker, WorkerStatus

__all__ = ["FEASIBLE", "FIT", "STAGES", "Outcome", "State", "fits", "outcome", "usable"]


class Outcome(StrEnum):
    """Why a GPU cannot take a request (a text: the API and the verdicts show its value)."""

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

    @property
    def helped_by(self) -> str:
        """What could change it: ``nothing`` (the GPU never matches: the request is
        rejected if no GPU does), ``an event`` (the worker comes back, the probe reads
        again), ``room`` (memory freed, a hold ahead granted, a load finished; preemption
        may make it)."""
        if self in _NOT_NOW:
            return "an event"
        return "room" if self in _NO_ROOM else "nothing"


_NOT_NOW = frozenset(
    {Outcome.WORKER_DRAINING, Outcome.WORKER_DRAINED, Outcome.WORKER_OFFLINE, Outcome.PROBE_STALE}
)
_NO_ROOM = frozenset({Outcome.INSUFFICIENT_VRAM, Outcome.NOMINATED_FOR, Outcome.LOAD_IN_PROGRESS})


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
Stage = Callable[[State, Request, GpuId, Holds], Outcome | None]


def matches(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> Outcome | None:
    """The constraints, and enough matching GPUs on the worker (the cached set per shape
    answers at once; the code is worked out only for a GPU that does not match)."""
    if gpu_id in state.matching(request):
        return None
    worker = state.workers[gpu_id.worker]
    gpu = state.ledger.gpu(gpu_id)
    code = mismatch(gpu, worker.labels, request.constraints, request.vram_mb)
    return Outcome.TOO_FEW_GPUS_ON_WORKER if code is None else Outcome(code)


def worker_online(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> Outcome | None:
    """I7: nothing new on a worker that is draining, drained or offline."""
    status = state.workers[gpu_id.worker].status
    return None if status is WorkerStatus.ONLINE else Outcome(f"worker_{status}")


def probe_fresh(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> Outcome | None:
    """I2: a GPU whose probe failed has unknown memory."""
    return Outcome.PROBE_STALE if state.ledger.stale(gpu_id) else None


def memory(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> Outcome | None:
    """I1, I2: capacity less what is committed or observed, whichever is more."""
    free = state.ledger.free_mb(gpu_id)
    return Outcome.INSUFFICIENT_VRAM if free < request.vram_mb else None


def nominations_ahead(
    state: State, request: Request, gpu_id: GpuId, holds: Holds
) -> Outcome | None:
    """I6: only the memory beyond the holds of the requests ahead of it."""
    room = state.ledger.free_mb(gpu_id) - holds.get(gpu_id, 0)
    return Outcome.NOMINATED_FOR if room < request.vram_mb else None


def load_gate(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> Outcome | None:
    """I3: at most ``max_concurrent_loads`` loads at once per GPU."""
    open_ = state.ledger.loading(gpu_id) < state.policy.max_concurrent_loads
    return None if open_ else Outcome.LOAD_IN_PROGRESS


FEASIBLE: tuple[Stage, ...] = (matches, worker_online, probe_fresh)
FIT: tuple[Stage, ...] = (memory, nominations_ahead, load_gate)
STAGES: tuple[Stage, ...] = FEASIBLE + FIT


def outcome(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> Outcome | None:
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
