"""The ledger as a plan leaves it: the state's ledger, read only, under the plan's own
changes (Nomad's planner: existing allocations, less the planned evictions, plus the
planned placements).

A plan is made against the state as it is and changes nothing; what it has decided so
far (leases ended by their timers, loads past their timeout, its own grants) is kept
here, per GPU, and every read the stages and the walk make goes through it. The exact
accounting stays the ledger's (:meth:`~.ledger.Ledger.free_planned`: what an uncommit
and a commit would leave, read without making either: an ended lease's memory counts as
used for as long as the latest probe shows it, I2), so the walk sees what the state will
see once the plan is applied. Only the GPUs the plan touched differ from the ledger:
:attr:`touched` lists them, for the walk's index scans to take them one by one.
"""

from __future__ import annotations

from collections.abc import Callable

from .ledger import Ledger
from .model import Gpu, GpuId, Lease

__all__ = ["Overlay"]


class Overlay:
    __slots__ = (
        "_added",
        "_gone",
        "_loads",
        "gpu",
        "ledger",
        "loading",
        "observed_mb",
        "stale",
        "touched",
    )

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        # what a plan never changes: read from the ledger itself (no call in between)
        self.gpu: Callable[[GpuId], Gpu] = ledger.gpu
        self.stale: Callable[[GpuId], bool] = ledger.stale
        self.observed_mb: Callable[[GpuId], int] = ledger.observed_mb
        self.loading: Callable[[GpuId], int] = ledger.loading  # until the plan starts or ends one
        self._added: dict[GpuId, int] = {}  # MiB the plan's grants commit there
        self._loads: dict[GpuId, int] = {}  # loads the plan starts (+) or ends (-) there
        self._gone: dict[GpuId, set[str]] = {}  # leases the plan ends there
        self.touched: dict[GpuId, int] = {}  # GPUs whose memory or gate the plan changed: free

    # ------------------------------------------------------------------ the plan's changes

    def commit(self, lease: Lease) -> None:
        """A grant of the plan: its memory, and a load, on each of its GPUs."""
        for gpu_id in lease.gpus:
            self._added[gpu_id] = self._added.get(gpu_id, 0) + lease.vram_mb
            self._load(gpu_id, 1)
            self._refresh(gpu_id)

    def end(self, lease: Lease, *, loading: bool) -> None:
        """A held lease the plan ends: its memory is back (as the ledger's exact rule says),
        and its load, if ``loading`` (still counted by the ledger), no longer holds the gate."""
        for gpu_id in lease.gpus:
            if gpu_id in self.ledger:
                self._gone.setdefault(gpu_id, set()).add(lease.id)
                if loading:
                    self._load(gpu_id, -1)
                self._refresh(gpu_id)

    def finish_loading(self, lease: Lease) -> None:
        """A load the plan counts as done (its load timeout passed): the gate opens."""
        for gpu_id in lease.gpus:
            if gpu_id in self.ledger:
                self._load(gpu_id, -1)
                self._refresh(gpu_id)  # touched: its gate is not the ledger's any more

    def _refresh(self, gpu_id: GpuId) -> None:
        self.touched[gpu_id] = self.ledger.free_planned(
            gpu_id, self._gone.get(gpu_id, ()), self._added.get(gpu_id, 0)
        )

    # ------------------------------------------------------------------ reads

    def __contains__(self, gpu_id: object) -> bool:
        return gpu_id in self.ledger

    def free_mb(self, gpu_id: GpuId) -> int:
        free = self.touched.get(gpu_id)
        return self.ledger.free_mb(gpu_id) if free is None else free

    def _loading(self, gpu_id: GpuId) -> int:
        """Loads in progress on the GPU: the ledger's, and those the plan starts or ends."""
        return self.ledger.loading(gpu_id) + self._loads.get(gpu_id, 0)

    def _load(self, gpu_id: GpuId, delta: int) -> None:
        self._loads[gpu_id] = self._loads.get(gpu_id, 0) + delta
        self.loading = self._loading

    def loading_ids(self) -> set[GpuId]:
        """GPUs where a load may be in progress (the ledger's, and the plan's grants)."""
        if not self._loads:
            return self.ledger.loading_ids
        return self.ledger.loading_ids | self._loads.keys()

    def lease_ids(self, gpu_id: GpuId) -> tuple[str, ...]:
        """The state's leases on the GPU that the plan does not end (not its own grants)."""
        gone = self._gone.get(gpu_id)
        ids = self.ledger.lease_ids(gpu_id)
        return ids if not gone else tuple(lid for lid in ids if lid not in gone)

    def free_after(self, gpu_id: GpuId, without: set[str]) -> int:
        """Free memory once the leases ``without`` are gone and the probe shows it, on the
        GPU as the plan leaves it."""
        return self.ledger.free_planned(
            gpu_id, self._gone.get(gpu_id, ()), self._added.get(gpu_id, 0), without
        )

    def committed_mb(self, gpu_id: GpuId) -> int:
        gone = self._gone.get(gpu_id, ())
        ledger = self.ledger
        return (
            ledger.committed_mb(gpu_id)
            + self._added.get(gpu_id, 0)
            - sum(ledger.reserved_mb(gpu_id, lid) for lid in gone)
        )
