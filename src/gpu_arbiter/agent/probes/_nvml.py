"""The NVML probe (``nvidia-ml-py``, imported as ``pynvml``).

Every NVML call is blocking, so a snapshot runs in a worker thread. The NVML module
is injectable: tests pass a module-like object with the same function names and the
same ``NVMLError`` behaviour, and the very code below runs against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from ._snapshot import (
    GpuFailure,
    GpuReading,
    KnownGpus,
    ProbeSnapshot,
    ProbeUnavailable,
    mb_ceil,
    mb_floor,
)

__all__ = ["NvmlProbe", "load_nvml"]

_T = TypeVar("_T")

# NVML return codes (nvml.h) for which a per-GPU query has no answer, yet the GPU is fine.
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4


def load_nvml() -> Any:
    """The ``pynvml`` module of ``nvidia-ml-py``; :class:`ProbeUnavailable` if missing."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        raise ProbeUnavailable("NVML: the nvidia-ml-py package is not installed") from None


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


class NvmlProbe:
    """Reads every GPU through NVML; a GPU whose query fails is reported as failed."""

    def __init__(self, nvml: Any) -> None:
        """``nvml``: an NVML module on which ``nvmlInit`` already succeeded (see :meth:`open`)."""
        self._nvml = nvml
        self._known = KnownGpus()
        self._lock = asyncio.Lock()
        self._closed = False

    @classmethod
    async def open(cls, nvml: Any = None) -> NvmlProbe:
        """Initialises NVML in a thread; :class:`ProbeUnavailable` when there is no driver."""
        module = load_nvml() if nvml is None else nvml
        try:
            await asyncio.to_thread(module.nvmlInit)
        except module.NVMLError as err:
            raise ProbeUnavailable(f"NVML: cannot initialise: {err}") from None
        return cls(module)

    @property
    def name(self) -> str:
        return "nvml"

    async def snapshot(self) -> ProbeSnapshot:
        async with self._lock:
            return await asyncio.to_thread(self._read)

    async def aclose(self) -> None:
        """Shuts NVML down once; later snapshots report every GPU as failed."""
        async with self._lock:
            if not self._closed:
                self._closed = True
                await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()

    def _read(self) -> ProbeSnapshot:
        nvml = self._nvml
        if self._closed:
            return self._known.broken(self.name, "NVML: probe is closed")
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as err:
            return self._known.broken(self.name, f"NVML: cannot count GPUs: {err}")
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError:
            driver = ""
        readings: list[GpuReading] = []
        failures: list[GpuFailure] = []
        for index in range(count):
            try:
                readings.append(self._read_gpu(index, driver))
            except nvml.NVMLError as err:
                failures.append(GpuFailure(index, f"NVML: {err}"))
        return self._known.complete(self.name, readings, failures)

    def _read_gpu(self, index: int, driver: str) -> GpuReading:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        return GpuReading(
            index=index,
            total_mb=mb_floor(int(memory.total)),
            used_mb=mb_ceil(int(memory.used)),
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            model=_text(nvml.nvmlDeviceGetName(handle)),
            vendor="nvidia",
            arch=self._optional(lambda: self._arch(handle), ""),
            driver_version=driver,
            processes=self._optional(lambda: self._processes(handle), None),
        )

    def _arch(self, handle: Any) -> str:
        major, minor = self._nvml.nvmlDeviceGetCudaComputeCapability(handle)
        return f"sm_{int(major)}{int(minor)}"

    def _processes(self, handle: Any) -> dict[int, int | None]:
        processes: dict[int, int | None] = {}
        for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            used = getattr(proc, "usedGpuMemory", None)
            mb = None if used is None else mb_ceil(int(used))
            before = processes.get(int(proc.pid), 0)
            processes[int(proc.pid)] = None if mb is None or before is None else before + mb
        return processes

    def _optional(self, query: Callable[[], _T], default: _T) -> _T:
        """``query()``, or ``default`` where NVML says the query is not supported or not
        permitted; any other NVML error (such as a lost GPU) propagates."""
        try:
            return query()
        except self._nvml.NVMLError as err:
            if getattr(err, "value", None) in (_NOT_SUPPORTED, _NO_PERMISSION):
                return default
            raise
