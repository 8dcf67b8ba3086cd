"""What a probe reports, the interface every probe implements, and the bridge to the core.

A snapshot holds one :class:`GpuReading` per GPU that answered and one
:class:`GpuFailure` per GPU that did not. A GPU is never dropped silently: once a
probe has seen a GPU, a later snapshot that cannot read it reports it as failed
(the agent marks it stale: no grants there, I2).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from ...core.errors import ArbiterError
from ...core.model import Gpu, GpuProbe

__all__ = [
    "DEFAULT_HEADROOM_MB",
    "GpuFailure",
    "GpuReading",
    "Probe",
    "ProbeSnapshot",
    "ProbeUnavailable",
    "to_gpu_probes",
    "to_gpus",
]

DEFAULT_HEADROOM_MB = 256
"""MiB kept free on a probed GPU for driver and context memory (DESIGN section 2)."""


class ProbeUnavailable(ArbiterError):
    """A probe cannot start on this machine (no driver, tool not on PATH, bad spec file)."""

    code = "probe_unavailable"


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU as a probe saw it. Memory in MiB; ``used_mb`` rounded up, ``total_mb`` down.

    ``processes`` maps pid -> used MiB on this GPU; a value is ``None`` where the tool
    lists the process but not its memory, and the whole mapping is ``None`` where the
    tool cannot list processes at all.
    """

    index: int
    total_mb: int
    used_mb: int
    uuid: str = ""
    model: str = ""
    vendor: str = "nvidia"
    arch: str = ""
    driver_version: str = ""
    processes: Mapping[int, int | None] | None = None

    def __post_init__(self) -> None:
        if self.processes is not None:
            object.__setattr__(self, "processes", MappingProxyType(dict(self.processes)))

    @property
    def free_mb(self) -> int:
        return max(0, self.total_mb - self.used_mb)


@dataclass(frozen=True, slots=True)
class GpuFailure:
    """A GPU the probe knows of but could not read this time; ``error`` says why."""

    index: int
    error: str
    uuid: str = ""


@dataclass(frozen=True, slots=True)
class ProbeSnapshot:
    """One probe pass: readings and failures by GPU index, plus messages tied to no GPU
    (``errors``: the tool failed as a whole, a line that names no index)."""

    probe: str
    gpus: tuple[GpuReading, ...] = ()
    failures: tuple[GpuFailure, ...] = ()
    errors: tuple[str, ...] = ()
    taken_at: float = field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        """Every GPU answered and the tool reported nothing wrong."""
        return not self.failures and not self.errors

    def reading(self, index: int) -> GpuReading | None:
        return next((gpu for gpu in self.gpus if gpu.index == index), None)

    def failure(self, index: int) -> GpuFailure | None:
        return next((fail for fail in self.failures if fail.index == index), None)

    @property
    def stale_indices(self) -> tuple[int, ...]:
        return tuple(sorted(fail.index for fail in self.failures))


@runtime_checkable
class Probe(Protocol):
    """Reads the GPUs of this host. ``snapshot`` never blocks the event loop and never
    raises for a broken GPU or tool: it reports failures inside the snapshot."""

    @property
    def name(self) -> str: ...

    async def snapshot(self) -> ProbeSnapshot: ...

    async def aclose(self) -> None: ...


class KnownGpus:
    """Remembers every GPU a probe has seen, so a vanished one is reported, not dropped."""

    def __init__(self) -> None:
        self._uuids: dict[int, str] = {}

    def broken(self, probe: str, error: str) -> ProbeSnapshot:
        """A snapshot of a probe that failed as a whole: every known GPU fails with ``error``."""
        return self.complete(probe, [], errors=[error], missing_error=error)

    def complete(
        self,
        probe: str,
        gpus: Iterable[GpuReading],
        failures: Iterable[GpuFailure] = (),
        errors: Iterable[str] = (),
        missing_error: str = "missing from the probe's output",
    ) -> ProbeSnapshot:
        """A snapshot where each known GPU that neither answered nor failed is failed."""
        readings = tuple(sorted(gpus, key=lambda gpu: gpu.index))
        failed = {fail.index: fail for fail in failures}
        seen = {gpu.index for gpu in readings}
        for index, uuid in self._uuids.items():
            if index not in seen and index not in failed:
                failed[index] = GpuFailure(index, missing_error, uuid)
        for gpu in readings:
            self._uuids[gpu.index] = gpu.uuid
        for fail in failed.values():
            self._uuids.setdefault(fail.index, fail.uuid)
        return ProbeSnapshot(
            probe=probe,
            gpus=readings,
            failures=tuple(sorted(failed.values(), key=lambda fail: fail.index)),
            errors=tuple(errors),
        )


def to_gpus(
    snapshot: ProbeSnapshot, worker: str, *, headroom_mb: int = DEFAULT_HEADROOM_MB
) -> tuple[Gpu, ...]:
    """The core's GPU specs of the GPUs that answered, for ``worker``.

    Raises :class:`~gpu_arbiter.core.errors.InvalidInput` for a bad worker name or a
    headroom not below a GPU's total.
    """
    return tuple(
        Gpu(
            index=gpu.index,
            total_mb=gpu.total_mb,
            arch=gpu.arch,
            worker=worker,
            vendor=gpu.vendor,
            model=gpu.model,
            uuid=gpu.uuid,
            headroom_mb=headroom_mb,
        )
        for gpu in snapshot.gpus
    )


def to_gpu_probes(
    snapshot: ProbeSnapshot, lease_pids: Mapping[str, Iterable[int]] | None = None
) -> dict[int, GpuProbe]:
    """The core's probe value per GPU index that answered (a failed GPU is absent: stale).

    With ``lease_pids`` (lease id -> pids the agent runs for it), ``lease_used_mb`` gives
    each lease's MiB on that GPU, which makes I2 exact. It is ``None`` where the probe
    cannot say per process, or some process's memory on that GPU is unknown.
    """
    return {gpu.index: GpuProbe(gpu.used_mb, _lease_used(gpu, lease_pids)) for gpu in snapshot.gpus}


def _lease_used(
    gpu: GpuReading, lease_pids: Mapping[str, Iterable[int]] | None
) -> dict[str, int] | None:
    if lease_pids is None or gpu.processes is None:
        return None
    if any(mb is None for mb in gpu.processes.values()):
        return None
    used: dict[str, int] = {}
    for lease_id, pids in lease_pids.items():
        mbs = [gpu.processes[pid] for pid in set(pids) if pid in gpu.processes]
        used[lease_id] = sum(mb for mb in mbs if mb is not None)
    return used


_MIB = 1024 * 1024


def mb_floor(n_bytes: int) -> int:
    """Bytes -> whole MiB, rounded down (a total never claims memory that is not there)."""
    return n_bytes // _MIB


def mb_ceil(n_bytes: int) -> int:
    """Bytes -> whole MiB, rounded up (used memory is never under-counted)."""
    return -(-n_bytes // _MIB)
