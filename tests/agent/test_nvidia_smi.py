"""The nvidia-smi parsers against captured outputs, and the probe running a real tool."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_arbiter.agent.probes import (
    KnownGpus,
    NvidiaSmiProbe,
    ProbeUnavailable,
    nvidia_smi_snapshot,
    parse_compute_apps,
    parse_query_gpu,
)

DATA = Path(__file__).resolve().parent.parent / "data"
A100_0 = "GPU-4f3e9b1a-6c2d-8e7f-1a2b-3c4d5e6f7a8b"
A100_1 = "GPU-9a8b7c6d-5e4f-3a2b-1c0d-e9f8a7b6c5d4"
RTX4090 = "GPU-1b2c3d4e-5f6a-7b8c-9d0e-1f2a3b4c5d6e"


def data(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


# --- parse_query_gpu -------------------------------------------------------------------


def test_query_gpu_reads_every_field_of_several_gpus() -> None:
    parsed = parse_query_gpu(data("nvidia_smi_query_gpu.csv"))

    assert parsed.failures == ()
    assert parsed.errors == ()
    assert [(g.index, g.uuid, g.model, g.total_mb, g.used_mb, g.arch) for g in parsed.readings] == [
        (0, A100_0, "NVIDIA A100-SXM4-80GB", 81920, 4, "sm_80"),
        (1, A100_1, "NVIDIA A100-SXM4-80GB", 81920, 39425, "sm_80"),
        (2, RTX4090, "NVIDIA GeForce RTX 4090", 24564, 1123, "sm_89"),
    ]
    assert {g.driver_version for g in parsed.readings} == {"535.104.05"}
    assert {g.vendor for g in parsed.readings} == {"nvidia"}


def test_query_gpu_na_fields_are_empty_but_na_memory_fails_the_gpu() -> None:
    parsed = parse_query_gpu(data("nvidia_smi_query_gpu_na.csv"))

    by_index = {g.index: g for g in parsed.readings}
    assert sorted(by_index) == [0, 2, 3]
    assert by_index[0].arch == ""  # compute_cap [N/A]
    assert by_index[2].driver_version == ""  # [Not Supported]
    assert (by_index[2].uuid, by_index[2].model) == (
        "GPU-7c6b5a49-3827-1605-f4e3-d2c1b0a99887",
        "NVIDIA H100 80GB HBM3",
    )  # extra spaces around every field
    assert (by_index[2].total_mb, by_index[2].arch) == (81559, "sm_90")
    assert (by_index[3].uuid, by_index[3].model, by_index[3].arch) == ("", "", "sm_75")
    [failure] = parsed.failures
    assert failure.index == 1
    assert failure.uuid == RTX4090
    assert "memory.total" in failure.error
    assert "[N/A]" in failure.error


def test_query_gpu_lost_gpu_lines_become_failures_and_errors() -> None:
    parsed = parse_query_gpu(data("nvidia_smi_query_gpu_lost.txt"))

    assert [g.index for g in parsed.readings] == [0]
    assert [(f.index, f.error) for f in parsed.failures] == [
        (2, "nvidia-smi: memory.total: [GPU is lost]"),
        (3, "nvidia-smi: memory.used: [Unknown Error]"),
    ]
    [error] = parsed.errors
    assert "Unable to determine the device handle" in error
    assert "GPU is lost" in error


def test_query_gpu_name_with_commas_is_parsed_from_the_known_column_count() -> None:
    line = "0, GPU-abc, Tesla Board, Rev. 2, Model X, 16384, 100, 7.0, 470.57.02\n"

    [gpu] = parse_query_gpu(line).readings

    assert gpu.model == "Tesla Board, Rev. 2, Model X"
    assert (gpu.total_mb, gpu.used_mb, gpu.arch, gpu.driver_version) == (
        16384,
        100,
        "sm_70",
        "470.57.02",
    )


@pytest.mark.parametrize(
    ("capability", "arch"), [("8.6", "sm_86"), ("10.0", "sm_100"), ("12.0", "sm_120")]
)
def test_query_gpu_compute_capability_becomes_sm_arch(capability: str, arch: str) -> None:
    [gpu] = parse_query_gpu(f"0, GPU-a, X, 100, 1, {capability}, 1.0\n").readings
    assert gpu.arch == arch


def test_query_gpu_short_lines_and_blank_lines() -> None:
    parsed = parse_query_gpu("\n   \n0, GPU-a, X, 100\nNo devices were found\n")

    assert parsed.readings == ()
    assert parsed.failures == ()
    assert parsed.errors == ("nvidia-smi: 0, GPU-a, X, 100", "nvidia-smi: No devices were found")


# --- parse_compute_apps ----------------------------------------------------------------


def test_compute_apps_several_processes_and_na_memory() -> None:
    apps, errors = parse_compute_apps(data("nvidia_smi_compute_apps.csv"))

    assert errors == ()
    assert apps == {
        A100_0: {31337: 20480, 31402: 512},
        A100_1: {40001: 38912, 31337: 1024},
        RTX4090: {50210: None},
    }


def test_compute_apps_empty_output_means_no_process() -> None:
    assert parse_compute_apps(data("nvidia_smi_compute_apps_empty.csv")) == ({}, ())
    assert parse_compute_apps("No running processes found\n") == ({}, ())


def test_compute_apps_same_process_twice_on_one_gpu_is_summed() -> None:
    apps, _ = parse_compute_apps("GPU-a, 7, 100\nGPU-a, 7, 50\nGPU-b, 8, 1\nGPU-b, 8, [N/A]\n")
    assert apps == {"GPU-a": {7: 150}, "GPU-b": {8: None}}


def test_compute_apps_garbage_line_is_reported() -> None:
    apps, errors = parse_compute_apps("GPU-a, 7, 100\nGPU-a, seven, 100\n")
    assert apps == {"GPU-a": {7: 100}}
    assert errors == ("nvidia-smi compute-apps: GPU-a, seven, 100",)


# --- nvidia_smi_snapshot ---------------------------------------------------------------


def test_snapshot_joins_processes_to_gpus_by_uuid() -> None:
    apps, _ = parse_compute_apps(data("nvidia_smi_compute_apps.csv"))
    snap = nvidia_smi_snapshot(data("nvidia_smi_query_gpu.csv"), apps)

    assert snap.ok
    assert snap.probe == "nvidia-smi"
    assert [dict(g.processes or {}) for g in snap.gpus] == [
        {31337: 20480, 31402: 512},
        {40001: 38912, 31337: 1024},
        {50210: None},
    ]


def test_snapshot_without_apps_has_unknown_processes_and_with_no_apps_empty() -> None:
    unknown = nvidia_smi_snapshot(data("nvidia_smi_query_gpu.csv"), None)
    empty = nvidia_smi_snapshot(data("nvidia_smi_query_gpu.csv"), {})

    assert all(g.processes is None for g in unknown.gpus)
    assert all(g.processes == {} for g in empty.gpus)


def test_snapshot_reports_a_gpu_that_vanished_from_the_output() -> None:
    known = KnownGpus()
    nvidia_smi_snapshot(data("nvidia_smi_query_gpu.csv"), {}, known=known)

    later = nvidia_smi_snapshot(data("nvidia_smi_query_gpu.csv").splitlines()[0], {}, known=known)

    assert [g.index for g in later.gpus] == [0]
    assert later.stale_indices == (1, 2)
    assert later.failure(1) is not None
    assert later.failure(1).uuid == A100_1


# --- NvidiaSmiProbe: a real program run as a subprocess ---------------------------------


async def test_probe_runs_the_documented_queries(
    fake_nvidia_smi: Callable[..., Path], tmp_path: Path
) -> None:
    log = tmp_path / "argv.log"
    probe = NvidiaSmiProbe(
        str(fake_nvidia_smi("nvidia_smi_query_gpu.csv", "nvidia_smi_compute_apps.csv", log=log))
    )

    snap = await probe.snapshot()

    assert snap.ok
    assert [g.index for g in snap.gpus] == [0, 1, 2]
    assert snap.reading(0).processes == {31337: 20480, 31402: 512}
    assert log.read_text().splitlines() == [
        "--query-gpu=index,uuid,name,memory.total,memory.used,compute_cap,driver_version"
        " --format=csv,noheader,nounits",
        "--query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits",
    ]


async def test_probe_keeps_readings_of_a_failing_exit_with_a_lost_gpu(
    fake_nvidia_smi: Callable[..., Path],
) -> None:
    tool = fake_nvidia_smi(
        "nvidia_smi_query_gpu_lost.txt", "nvidia_smi_compute_apps_empty.csv", gpu_rc=15
    )

    snap = await NvidiaSmiProbe(str(tool)).snapshot()

    assert [g.index for g in snap.gpus] == [0]
    assert snap.stale_indices == (2, 3)
    assert any("exited with status 15" in e for e in snap.errors)


async def test_probe_failing_apps_query_leaves_processes_unknown(
    fake_nvidia_smi: Callable[..., Path],
) -> None:
    tool = fake_nvidia_smi("nvidia_smi_query_gpu.csv", "nvidia_smi_compute_apps.csv", apps_rc=6)

    snap = await NvidiaSmiProbe(str(tool)).snapshot()

    assert [g.processes for g in snap.gpus] == [None, None, None]
    assert any("--query-compute-apps exited with status 6" in e for e in snap.errors)


async def test_probe_driver_failure_message_is_kept(make_tool: Callable[[str, str], Path]) -> None:
    message = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    tool = make_tool("nvidia-smi", f"import sys\nprint({message!r})\nsys.exit(9)\n")

    snap = await NvidiaSmiProbe(str(tool)).snapshot()

    assert snap.gpus == ()
    assert snap.failures == ()
    assert f"nvidia-smi: {message}" in snap.errors
    assert f"nvidia-smi exited with status 9: {message}" in snap.errors


async def test_probe_missing_binary_marks_known_gpus_failed(
    fake_nvidia_smi: Callable[..., Path],
) -> None:
    tool = fake_nvidia_smi("nvidia_smi_query_gpu.csv", "nvidia_smi_compute_apps.csv")
    probe = NvidiaSmiProbe(str(tool))
    await probe.snapshot()
    tool.unlink()

    snap = await probe.snapshot()

    assert snap.gpus == ()
    assert snap.stale_indices == (0, 1, 2)
    assert snap.errors == (f"{tool}: not found",)
    assert snap.failure(0).error == f"{tool}: not found"


async def test_probe_that_hangs_is_given_up(make_tool: Callable[[str, str], Path]) -> None:
    tool = make_tool("nvidia-smi", "import time\ntime.sleep(60)\n")

    snap = await NvidiaSmiProbe(str(tool), timeout_s=0.2).snapshot()

    assert snap.errors == (f"{tool}: no answer within 0.2 s",)


def test_open_finds_the_tool_on_path_or_says_it_is_missing(
    fake_nvidia_smi: Callable[..., Path], bin_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ProbeUnavailable, match="nvidia-smi: not found on PATH"):
        NvidiaSmiProbe.open(path=str(tmp_path))
    fake_nvidia_smi("nvidia_smi_query_gpu.csv", "nvidia_smi_compute_apps.csv")
    assert NvidiaSmiProbe.open(path=str(bin_dir)).name == "nvidia-smi"


async def test_snapshot_does_not_block_the_event_loop(
    make_tool: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """The tool prints its output only once another coroutine has run: a probe that
    blocked the loop would see the tool give up and report an error instead."""
    marker = tmp_path / "other-coroutine-ran"
    gpu_line = "0, GPU-a, NVIDIA A10, 23028, 0, 8.6, 550.54.15"
    tool = make_tool(
        "nvidia-smi",
        f"""
import pathlib, sys, time
if any(a.startswith("--query-gpu=") for a in sys.argv):
    for _ in range(2000):
        if pathlib.Path({str(marker)!r}).exists():
            print({gpu_line!r})
            sys.exit(0)
        time.sleep(0.01)
    print("marker never appeared")
    sys.exit(1)
""",
    )
    events: list[str] = []

    async def other() -> None:
        events.append("other coroutine ran")
        marker.touch()

    async def probe() -> None:
        snap = await NvidiaSmiProbe(str(tool)).snapshot()
        events.append(f"snapshot read {[g.model for g in snap.gpus]}")

    await asyncio.gather(probe(), other())

    assert events == ["other coroutine ran", "snapshot read ['NVIDIA A10']"]
