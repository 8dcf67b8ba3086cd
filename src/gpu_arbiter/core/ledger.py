"""Memory accounting per GPU: what is committed, what the probe saw, the load gate.

Availability (I2)::

    free = capacity - occupied
    occupied = committed                                 no probe (GPUs declared by hand)
             = max(committed, observed_used)             probe with a GPU total only
             = sum_i max(reserved_i, used_i) + external  probe with per-lease usage

``committed`` counts leases in ``loading``, ``active`` and ``revoking`` (I1, I4).

The ledger keeps every GPU in a list sorted by free memory, so placement finds
the best fit by bisection instead of scanning every GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from .model import Gpu, GpuId, GpuProbe, Lease

__all__ = ["GpuFigures", "Ledger"]


@dataclass(frozen=True, slots=True)
class GpuFigures:
    """A frozen snapshot of one GPU's accounting. ``free_mb`` is never negative;
    ``overcommitted_mb`` is how far the leases exceed the capacity (a GPU registered again
    smaller than its leases): no grant goes there until they end."""

    gpu: Gpu
    committed_mb: int
    used_mb: int | None
    free_mb: int
    loading: int
    stale: bool
    lease_ids: tuple[str, ...]
    overcommitted_mb: int = 0


class _Slot:
    __slots__ = (
        "capacity_mb",
        "committed_mb",
        "gpu",
        "id",
        "indexed",
        "loading",
        "occupied_mb",
        "probe",
        "probe_seq",
        "reserved",
        "stale",
    )

    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.capacity_mb = gpu.capacity_mb  # read at every change: kept, not derived
        self.id = gpu.id  # the one GpuId of this GPU: the index's entries are this very key
        self.committed_mb = 0
        self.loading = 0
        self.reserved: dict[str, int] = {}
        self.probe: GpuProbe | None = None
        self.probe_seq = 0
        self.stale = False
        self.occupied_mb = 0
        self.indexed: tuple[int, GpuId] | None = None

    def refresh(self) -> None:
        probe = self.probe
        if probe is None:
            self.occupied_mb = self.committed_mb
        elif probe.lease_used_mb is None:
            self.occupied_mb = max(self.committed_mb, probe.used_mb)
        else:
            per_lease = probe.lease_used_mb
            attributed = total = 0
            for lease_id, reserved in self.reserved.items():
                used = per_lease.get(lease_id, 0)
                attributed += used
                total += max(reserved, used)
            self.occupied_mb = total + max(0, probe.used_mb - attributed)


class Ledger:
    def __init__(self) -> None:
        self._slots: dict[GpuId, _Slot] = {}
        self.by_free: list[tuple[int, GpuId]] = []  # (free_mb, GPU), ascending; read-only
        self.loading_ids: set[GpuId] = set()  # GPUs with a load in progress; read-only
        self.stale_ids: set[GpuId] = set()  # GPUs whose probe failed; read-only
        self.version = 0  # moves at every change: what was read of it is then stale

    def _refresh(self, slot: _Slot) -> None:
        self.version += 1
        slot.refresh()
        entry = (slot.capacity_mb - slot.occupied_mb, slot.id)
        if entry == slot.indexed:
            return
        if slot.indexed is not None:
            del self.by_free[bisect.bisect_left(self.by_free, slot.indexed)]
        bisect.insort(self.by_free, entry)
        slot.indexed = entry

    def __contains__(self, gpu_id: object) -> bool:
        return gpu_id in self._slots

    def __iter__(self) -> Iterator[GpuId]:
        return iter(self._slots)

    def ids(self) -> list[GpuId]:
        return list(self._slots)

    def gpu(self, gpu_id: GpuId) -> Gpu:
        return self._slots[gpu_id].gpu

    def put_gpu(self, gpu: Gpu) -> None:
        slot = self._slots.get(gpu.id)
        if slot is None:
            slot = _Slot(gpu)
            self._slots[slot.id] = slot
        slot.gpu = gpu
        slot.capacity_mb = gpu.capacity_mb
        self._refresh(slot)

    def drop_gpu(self, gpu_id: GpuId) -> None:
        slot = self._slots[gpu_id]
        if slot.reserved:
            raise ValueError(f"GPU {gpu_id} still has leases")
        self.version += 1
        if slot.indexed is not None:
            del self.by_free[bisect.bisect_left(self.by_free, slot.indexed)]
        self.loading_ids.discard(gpu_id)
        self.stale_ids.discard(gpu_id)
        del self._slots[gpu_id]

    def commit(self, lease: Lease) -> None:
        vram_mb = lease.vram_mb
        for gpu_id in lease.gpus:
            slot = self._slots[gpu_id]
            slot.reserved[lease.id] = vram_mb
            slot.committed_mb += vram_mb
            slot.loading += lease.loading
            if slot.loading:
                self.loading_ids.add(gpu_id)
            self._refresh(slot)

    def shrink(self, lease: Lease, vram_mb: int) -> None:
        """A held lease now holds ``vram_mb`` per GPU (no more than before). Committed memory
        drops at once (I1); occupied memory drops only as far as the latest probe allows:
        ``max(committed, observed_used)``, or ``max(reserved, used)`` for this lease where the
        probe reports per lease (I2), so what its process still holds is not granted (I4)."""
        for gpu_id in lease.gpus:
            slot = self._slots[gpu_id]
            before = slot.reserved.get(lease.id)
            if before is None or vram_mb > before:
                raise ValueError(f"lease {lease.id} cannot grow on {gpu_id}")
            slot.reserved[lease.id] = vram_mb
            slot.committed_mb -= before - vram_mb
            self._refresh(slot)

    def uncommit(self, lease: Lease) -> None:
        """Releases a lease's memory: what it reserved on each GPU, exactly once (a second
        call for the same lease does nothing)."""
        for gpu_id in lease.gpus:
            slot = self._slots.get(gpu_id)
            reserved = None if slot is None else slot.reserved.pop(lease.id, None)
            if slot is None or reserved is None:
                continue
            slot.committed_mb -= reserved
            slot.loading -= lease.loading
            if not slot.loading:
                self.loading_ids.discard(gpu_id)
            self._refresh(slot)

    def finish_loading(self, lease: Lease) -> None:
        self.version += 1
        for gpu_id in lease.gpus:
            slot = self._slots[gpu_id]
            slot.loading -= 1
            if not slot.loading:
                self.loading_ids.discard(gpu_id)

    def set_probe(self, gpu_id: GpuId, probe: GpuProbe | None) -> None:
        """A reading, or None when the probe failed: the GPU is stale until the next one."""
        slot = self._slots[gpu_id]
        self.version += 1
        slot.stale = probe is None
        if slot.stale:
            self.stale_ids.add(gpu_id)
        else:
            self.stale_ids.discard(gpu_id)
        if probe is not None:
            slot.probe = probe
            slot.probe_seq += 1
            self._refresh(slot)

    def probe_seq(self, gpu_id: GpuId) -> int:
        return self._slots[gpu_id].probe_seq

    def has_probe(self, gpu_id: GpuId) -> bool:
        return self._slots[gpu_id].probe is not None

    def stale(self, gpu_id: GpuId) -> bool:
        return self._slots[gpu_id].stale

    def free_mb(self, gpu_id: GpuId) -> int:
        """Capacity less occupied memory: negative on an over-committed GPU (placement
        compares it; what is shown goes through :meth:`figures`)."""
        slot = self._slots[gpu_id]
        return slot.capacity_mb - slot.occupied_mb

    def committed_mb(self, gpu_id: GpuId) -> int:
        return self._slots[gpu_id].committed_mb

    def loading(self, gpu_id: GpuId) -> int:
        return self._slots[gpu_id].loading

    def lease_ids(self, gpu_id: GpuId) -> tuple[str, ...]:
        return tuple(self._slots[gpu_id].reserved)

    def observed_mb(self, gpu_id: GpuId) -> int:
        probe = self._slots[gpu_id].probe
        return 0 if probe is None else probe.used_mb

    def free_after(self, gpu_id: GpuId, without: Collection[str]) -> int:
        """Free memory once the leases ``without`` are gone and the probe shows it."""
        return self.free_planned(gpu_id, (), 0, without)

    def free_planned(
        self,
        gpu_id: GpuId,
        ended: Collection[str],
        added_mb: int,
        without: Collection[str] = (),
    ) -> int:
        """Free memory as a plan leaves the GPU, read without changing anything: the
        leases ``ended`` uncommitted and ``added_mb`` more committed, exactly as
        :meth:`uncommit` and :meth:`commit` would leave it (the latest probe still counts
        what an ended lease's process used until it reads again: I2, I4); then, as
        :meth:`free_after` says, once the leases ``without`` are gone and the probe shows
        it (what a preemption plans for)."""
        slot = self._slots[gpu_id]
        probe, reserved = slot.probe, slot.reserved
        gone = [lid for lid in reserved if lid in ended] if ended else []
        out = [lid for lid in reserved if lid in without and lid not in gone] if without else []
        gone_mb = sum(reserved[lid] for lid in gone)
        out_mb = sum(reserved[lid] for lid in out)
        committed = slot.committed_mb - gone_mb + added_mb
        if probe is None:
            occupied = committed - out_mb
        elif probe.lease_used_mb is None:
            occupied = max(committed - out_mb, probe.used_mb - out_mb)
        else:
            per_lease = probe.lease_used_mb
            if gone:  # as _Slot.refresh works it out without them
                kept = [lid for lid in reserved if lid not in gone]
                total = sum(max(reserved[lid], per_lease.get(lid, 0)) for lid in kept)
                attributed = sum(per_lease.get(lid, 0) for lid in kept)
                occupied = total + max(0, probe.used_mb - attributed)
            else:
                occupied = slot.occupied_mb
            occupied += added_mb - sum(max(reserved[lid], per_lease.get(lid, 0)) for lid in out)
        return slot.capacity_mb - occupied

    def reserved_mb(self, gpu_id: GpuId, lease_id: str) -> int:
        """What one lease holds on one GPU (0: none)."""
        return self._slots[gpu_id].reserved.get(lease_id, 0)

    def figures(self, gpu_id: GpuId) -> GpuFigures:
        slot = self._slots[gpu_id]
        return GpuFigures(
            gpu=slot.gpu,
            committed_mb=slot.committed_mb,
            used_mb=None if slot.probe is None else slot.probe.used_mb,
            free_mb=max(0, slot.capacity_mb - slot.occupied_mb),
            loading=slot.loading,
            stale=slot.stale,
            lease_ids=tuple(slot.reserved),
            overcommitted_mb=max(0, slot.committed_mb - slot.capacity_mb),
        )
