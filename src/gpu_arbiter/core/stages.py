"""The stages that decide whether a GPU may take a request, built in one place.

A cycle asks, for each request in queue order, GPU by GPU::

    feasible    does it match at all?       the constraints, enough such GPUs on one
                                            worker (cached per shape: workers rarely change)
                may it take new work now?   its worker online (I7), its probe fresh (I2)
    fit         does it fit now?            free memory (I1, I2), the holds of the
                                            nominations ahead of it (I6), the load gate (I3)
    rank        which of those?             its own nomination, its preferred workers, then
                                            binpack or spread (:mod:`.rank`): an order,
                                            never a "no"
    post-filter none fits: what would help? its victims still stopping, preemption and
                                            keep-warm reclaim (I5), else a nomination on
                                            its best GPU (:mod:`.postfilter`)

The order is the order of the questions an operator asks ("does it match? is the machine
up? is there room? is someone ahead of me? is a load running?"), so the first "no" is the
most useful one. Each stage returns an outcome code when it says no and None when it
passes: an :class:`Outcome`, typed, whose value is the code the API shows, and which
says what could help (:attr:`Outcome.helped_by`). Placement asks them, and "why is it
pending" counts what they say of the GPUs (:mod:`.diagnosis`, without asking every GPU:
the fit rules on figures already read are :func:`fit_code`, the one place they are
written): one set of rules for both, so the why cannot drift from the what. Codes
(:class:`~.outcomes.Outcome`):

    does not match (nothing helps)          worker_mismatch gpu_mismatch vendor_mismatch
                                            arch_mismatch compute_capability_too_low
                                            model_mismatch label_mismatch too_small
                                            too_few_gpus_on_worker
    not now (an event may help)             worker_draining worker_drained worker_offline
                                            probe_stale
    does not fit (room helps; preemption    insufficient_vram nominated_for
    may make it)                            load_in_progress

A new filter (MIG slices, NUMA) is one more function here, and shows in every "why".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from .filters import mismatch
from .model import Gpu, GpuId, Policy, Request, Worker, WorkerStatus
from .outcomes import Outcome

__all__ = [
    "FEASIBLE",
    "FIT",
    "STAGES",
    "Memory",
    "Outcome",
    "State",
    "fit_code",
    "fits",
    "outcome",
    "taking_work",
    "usable",
]


class Memory(Protocol):
    """What the stages read of memory: the ledger, or the ledger under a plan's own
    changes (:class:`~.overlay.Overlay`)."""

    def __contains__(self, gpu_id: object) -> bool: ...
    def gpu(self, gpu_id: GpuId) -> Gpu: ...
    def stale(self, gpu_id: GpuId) -> bool: ...
    def free_mb(self, gpu_id: GpuId) -> int: ...
    def loading(self, gpu_id: GpuId) -> int: ...


class State(Protocol):
    """What the stages read: the policy, the workers, the memory, the matching GPUs."""

    @property
    def policy(self) -> Policy: ...
    @property
    def workers(self) -> Mapping[str, Worker]: ...
    @property
    def ledger(self) -> Memory: ...
    def matching(self, request: Request) -> frozenset[GpuId]: ...


Holds = Mapping[GpuId, int]
Stage = Callable[[State, Request, GpuId, Holds], Outcome | None]


_ANY = Request.build("any", vram_mb=1)  # what stages that ask nothing of the request get


def matches(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> Outcome | None:
    """The constraints, and enough matching GPUs on the worker (the cached set per shape
    answers at once; the code is worked out only for a GPU that does not match)."""
    if gpu_id in state.matching(request):
        return None
    worker = state.workers[gpu_id.worker]
    gpu = state.ledger.gpu(gpu_id)
    code = mismatch(gpu, worker.labels, request.constraints, request.vram_mb)
    return Outcome.TOO_FEW_GPUS_ON_WORKER if code is None else code


def worker_online(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> Outcome | None:
    """I7: nothing new on a worker that is draining, drained or offline."""
    status = state.workers[gpu_id.worker].status
    return None if status is WorkerStatus.ONLINE else Outcome(f"worker_{status}")


def probe_fresh(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> Outcome | None:
    """I2: a GPU whose probe failed has unknown memory."""
    return Outcome.PROBE_STALE if state.ledger.stale(gpu_id) else None


def fit_code(free: int, held: int, loading: int, need: int, limit: int) -> Outcome | None:
    """The fit rules, in their order, on one GPU's figures: I1, I2 (``free``: capacity less
    what is committed or observed, whichever is more), I6 (only the memory beyond what is
    ``held`` for the requests ahead), I3 (at most ``limit`` loads at once). The one place
    they are written: the stage below reads the figures for them, the walk's index scans
    and the diagnosis pass figures they already read."""
    if free < need:
        return Outcome.INSUFFICIENT_VRAM
    if free - held < need:
        return Outcome.NOMINATED_FOR
    if loading >= limit:
        return Outcome.LOAD_IN_PROGRESS
    return None


def fit(state: State, request: Request, gpu_id: GpuId, holds: Holds) -> Outcome | None:
    """Does it fit now: memory, the holds ahead, the load gate (:func:`fit_code`)."""
    ledger = state.ledger
    return fit_code(
        ledger.free_mb(gpu_id),
        holds.get(gpu_id, 0),
        ledger.loading(gpu_id),
        request.vram_mb,
        state.policy.max_concurrent_loads,
    )


FEASIBLE: tuple[Stage, ...] = (matches, worker_online, probe_fresh)
FIT: tuple[Stage, ...] = (fit,)
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


def taking_work(state: State, gpu_id: GpuId) -> Outcome | None:
    """The feasible stages that do not depend on the request: may the GPU take new work
    at all (its worker online, its probe fresh)? None when it may."""
    return worker_online(state, _ANY, gpu_id, {}) or probe_fresh(state, _ANY, gpu_id, {})


def usable(state: State, gpu_id: GpuId) -> bool:
    """A GPU that may take new work (:func:`taking_work`)."""
    return taking_work(state, gpu_id) is None
