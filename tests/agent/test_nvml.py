"""The NVML probe, run against a stand-in NVML module with pynvml's names and errors."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from gpu_arbiter.agent.probes import NvmlProbe, ProbeUnavailable, load_nvml

GiB = 1024**3


@dataclass
class FakeDevice:
    uuid: str
    name: str
    total: int
    used: int
    capability: tuple[int, int] = (8, 6)
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    lost: bool = False
    processes_error: int | None = None


class FakeNvml:
    """The pynvml functions the probe calls, over a list of devices. Errors are pynvml's
    own ``NVMLError`` (which maps each code to its subclass)."""

    NVMLError = pynvml.NVMLError

    def __init__(self, devices: list[FakeDevice], *, init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.count_error: int | None = None
        self.calls: list[str] = []
        self.before_count: Any = None

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        if self.before_count is not None:
            self.before_count()
        if self.count_error is not None:
            raise pynvml.NVMLError(self.count_error)
        return len(self.devices)

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        device = self.devices[index]
        if device.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return device

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> Any:
        free = handle.total - handle.used
        return SimpleNamespace(total=handle.total, used=handle.used, free=free)

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeDevice) -> bytes:
        return handle.name.encode()  # older nvidia-ml-py releases return bytes

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeDevice) -> tuple[int, int]:
        return handle.capability

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[Any]:
        if handle.processes_error is not None:
            raise pynvml.NVMLError(handle.processes_error)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.processes]


def three_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeDevice(
                "GPU-0000", "NVIDIA RTX A6000", 48 * GiB, 10 * GiB + 1, (8, 6), [(101, 4 * GiB)]
            ),
            FakeDevice("GPU-1111", "NVIDIA RTX A6000", 48 * GiB, 0, (8, 6), lost=True),
            FakeDevice(
                "GPU-2222", "NVIDIA H100 80GB HBM3", 80 * GiB, 2 * GiB, (9, 0), [(7, None), (8, 1)]
            ),
        ]
    )


async def test_reads_every_gpu_and_reports_the_lost_one() -> None:
    nvml = three_gpus()
    probe = await NvmlProbe.open(nvml)

    snap = await probe.snapshot()

    assert probe.name == "nvml"
    assert snap.probe == "nvml"
    assert [(g.index, g.uuid, g.model, g.arch) for g in snap.gpus] == [
        (0, "GPU-0000", "NVIDIA RTX A6000", "sm_86"),
        (2, "GPU-2222", "NVIDIA H100 80GB HBM3", "sm_90"),
    ]
    first = snap.reading(0)
    assert first is not None
    assert (first.total_mb, first.used_mb, first.driver_version) == (49152, 10241, "550.54.15")
    assert [(f.index, f.error) for f in snap.failures] == [(1, "NVML: GPU is lost")]
    assert snap.stale_indices == (1,)


async def test_per_process_memory_none_is_unknown() -> None:
    snap = await (await NvmlProbe.open(three_gpus())).snapshot()

    assert snap.reading(0).processes == {101: 4096}
    assert snap.reading(2).processes == {7: None, 8: 1}  # 1 byte counts as 1 MiB


async def test_process_listing_not_supported_leaves_processes_unknown() -> None:
    nvml = FakeNvml(
        [FakeDevice("GPU-a", "A", GiB, 0, processes_error=pynvml.NVML_ERROR_NOT_SUPPORTED)]
    )
    snap = await (await NvmlProbe.open(nvml)).snapshot()

    assert snap.ok
    assert snap.gpus[0].processes is None


async def test_gpu_lost_while_listing_processes_fails_the_gpu() -> None:
    nvml = FakeNvml(
        [FakeDevice("GPU-a", "A", GiB, 0, processes_error=pynvml.NVML_ERROR_GPU_IS_LOST)]
    )
    snap = await (await NvmlProbe.open(nvml)).snapshot()

    assert snap.gpus == ()
    assert snap.stale_indices == (0,)


async def test_a_gpu_that_vanishes_later_is_reported_not_dropped() -> None:
    nvml = three_gpus()
    probe = await NvmlProbe.open(nvml)
    await probe.snapshot()
    del nvml.devices[2]

    snap = await probe.snapshot()

    assert [g.index for g in snap.gpus] == [0]
    assert snap.stale_indices == (1, 2)
    assert snap.failure(2).uuid == "GPU-2222"


async def test_whole_nvml_failure_marks_every_known_gpu_failed() -> None:
    nvml = three_gpus()
    probe = await NvmlProbe.open(nvml)
    await probe.snapshot()
    nvml.count_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED

    snap = await probe.snapshot()

    assert snap.gpus == ()
    assert snap.stale_indices == (0, 1, 2)
    assert snap.errors == ("NVML: cannot count GPUs: Driver Not Loaded",)


async def test_no_driver_on_init_is_probe_unavailable() -> None:
    nvml = FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    with pytest.raises(ProbeUnavailable, match="NVML: cannot initialise: NVML Shared Library"):
        await NvmlProbe.open(nvml)


async def test_close_shuts_nvml_down_once() -> None:
    nvml = three_gpus()
    probe = await NvmlProbe.open(nvml)
    await probe.snapshot()

    await probe.aclose()
    await probe.aclose()
    snap = await probe.snapshot()

    assert nvml.calls == ["init", "shutdown"]
    assert snap.stale_indices == (0, 1, 2)
    assert snap.errors == ("NVML: probe is closed",)


def test_load_nvml_is_nvidia_ml_py() -> None:
    assert load_nvml() is pynvml


async def test_snapshot_does_not_block_the_event_loop() -> None:
    """NVML answers only once another coroutine has run: a probe calling NVML on the
    loop's thread would block that coroutine, and NVML would time out instead."""
    nvml = three_gpus()
    other_ran = threading.Event()

    def wait_for_other_coroutine() -> None:
        if not other_ran.wait(timeout=20):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    nvml.before_count = wait_for_other_coroutine
    probe = await NvmlProbe.open(nvml)
    events: list[str] = []

    async def other() -> None:
        events.append("other coroutine ran")
        other_ran.set()

    async def read() -> None:
        snap = await probe.snapshot()
        events.append(f"snapshot read {len(snap.gpus)} GPUs")

    await asyncio.gather(read(), other())

    assert events == ["other coroutine ran", "snapshot read 2 GPUs"]
