"""Snapshot values, vanished-GPU tracking, and the bridge to the core's Gpu and GpuProbe."""

from __future__ import annotations

import pytest

from gpu_arbiter.agent.probes import (
    DEFAULT_HEADROOM_MB,
    FakeProbe,
    GpuFailure,
    GpuReading,
    KnownGpus,
    NvidiaSmiProbe,
    NvmlProbe,
    Probe,
    ProbeSnapshot,
    RocmSmiProbe,
    to_gpu_probes,
    to_gpus,
)
from gpu_arbiter.agent.probes._snapshot import mb_ceil, mb_floor
from gpu_arbiter.core.errors import InvalidInput
from gpu_arbiter.core.model import Gpu, GpuProbe


def snapshot() -> ProbeSnapshot:
    return ProbeSnapshot(
        "test",
        gpus=(
            GpuReading(0, 24576, 9000, "GPU-0", "RTX 3090", "nvidia", "sm_86", "550.1", {1: 4000}),
            GpuReading(2, 65520, 11, "0x2a5c", "MI210", "AMD", "gfx90a"),
            GpuReading(3, 24576, 500, processes={5: None, 6: 100}),
        ),
        failures=(GpuFailure(1, "NVML: GPU is lost", "GPU-1"),),
    )


def test_snapshot_lookups() -> None:
    snap = snapshot()

    assert snap.reading(2) is snap.gpus[1]
    assert snap.reading(1) is None
    assert snap.failure(1) == GpuFailure(1, "NVML: GPU is lost", "GPU-1")
    assert snap.stale_indices == (1,)
    assert not snap.ok
    assert ProbeSnapshot("test", gpus=snap.gpus).ok
    assert not ProbeSnapshot("test", errors=("tool failed",)).ok


def test_reading_processes_cannot_be_changed_and_free_never_negative() -> None:
    reading = GpuReading(0, 100, 150, processes={1: 150})
    with pytest.raises(TypeError):
        reading.processes[2] = 1  # type: ignore[index]
    assert reading.free_mb == 0


def test_to_gpus_builds_core_specs_with_probed_headroom() -> None:
    gpus = to_gpus(snapshot(), "Box-1")

    assert DEFAULT_HEADROOM_MB == 256
    assert gpus[0] == Gpu(
        index=0,
        total_mb=24576,
        arch="sm_86",
        worker="box-1",
        vendor="nvidia",
        model="RTX 3090",
        uuid="GPU-0",
        headroom_mb=256,
    )
    assert [g.index for g in gpus] == [0, 2, 3]  # the failed GPU has no spec
    assert (gpus[1].vendor, gpus[1].arch, gpus[1].capacity_mb) == ("amd", "gfx90a", 65264)
    assert {g.headroom_mb for g in to_gpus(snapshot(), "box-1", headroom_mb=1024)} == {1024}


def test_to_gpus_rejects_a_bad_worker_name() -> None:
    with pytest.raises(InvalidInput, match=r"gpu\.worker"):
        to_gpus(snapshot(), "box:1")


def test_to_gpu_probes_without_lease_knowledge() -> None:
    assert to_gpu_probes(snapshot()) == {0: GpuProbe(9000), 2: GpuProbe(11), 3: GpuProbe(500)}


def test_to_gpu_probes_per_lease_where_every_process_is_known() -> None:
    probes = to_gpu_probes(snapshot(), {"lease-a": [1, 1], "lease-b": [6], "lease-c": [99]})

    assert probes[0] == GpuProbe(9000, {"lease-a": 4000, "lease-b": 0, "lease-c": 0})
    assert probes[2].lease_used_mb is None  # rocm-smi lists no processes
    assert probes[3].lease_used_mb is None  # pid 5's memory is unknown


def test_known_gpus_report_a_gpu_missing_from_a_later_snapshot() -> None:
    known = KnownGpus()
    known.complete("t", [GpuReading(0, 10, 0, "u0"), GpuReading(1, 10, 0, "u1")])

    later = known.complete("t", [GpuReading(0, 10, 0, "u0")])
    broken = known.broken("t", "tool is gone")

    assert later.failures == (GpuFailure(1, "missing from the probe's output", "u1"),)
    assert broken.failures == (
        GpuFailure(0, "tool is gone", "u0"),
        GpuFailure(1, "tool is gone", "u1"),
    )
    assert broken.errors == ("tool is gone",)


def test_bytes_to_mib_rounds_totals_down_and_usage_up() -> None:
    mib = 1024 * 1024
    assert (mb_floor(0), mb_floor(mib - 1), mb_floor(mib), mb_floor(3 * mib + 1)) == (0, 0, 1, 3)
    assert (mb_ceil(0), mb_ceil(1), mb_ceil(mib), mb_ceil(mib + 1)) == (0, 1, 1, 2)


async def test_every_probe_implements_the_interface() -> None:
    probes: list[object] = [
        FakeProbe.from_spec("1x1G"),
        NvidiaSmiProbe(),
        RocmSmiProbe(),
        NvmlProbe(nvml=object()),
    ]
    assert all(isinstance(probe, Probe) for probe in probes)
