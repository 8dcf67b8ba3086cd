"""Choosing a probe: by name, and by detection with PATH holding real stand-in tools."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from gpu_arbiter.agent.probes import (
    FakeProbe,
    NvidiaSmiProbe,
    NvmlProbe,
    ProbeUnavailable,
    RocmSmiProbe,
    detect,
    open_probe,
)
from gpu_arbiter.core.errors import InvalidInput


class NoDriverNvml:
    """An NVML module on a host without the NVIDIA driver."""

    NVMLError = pynvml.NVMLError

    def nvmlInit(self) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)


class OneGpuNvml:
    NVMLError = pynvml.NVMLError

    def __init__(self, count: int = 1) -> None:
        self.count = count
        self.shut_down = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlSystemGetDriverVersion(self) -> str:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)


@pytest.fixture
def path_is(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH holds only ``bin_dir``."""
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


async def test_nvml_first_when_it_initialises(
    path_is: Path, fake_nvidia_smi: Callable[..., Path]
) -> None:
    fake_nvidia_smi("nvidia_smi_query_gpu.csv", "nvidia_smi_compute_apps.csv")

    probe = await detect(nvml=OneGpuNvml())

    assert isinstance(probe, NvmlProbe)  # a lost GPU is still a GPU: it is reported


async def test_nvml_without_gpus_is_passed_over(path_is: Path) -> None:
    nvml = OneGpuNvml(count=0)
    skipped: list[str] = []

    assert await detect(nvml=nvml, skipped=skipped) is None
    assert nvml.shut_down
    assert skipped[0] == "nvml: no GPU found"


async def test_nvidia_smi_when_nvml_has_no_driver(
    path_is: Path, fake_nvidia_smi: Callable[..., Path], fake_rocm_smi: Callable[..., Path]
) -> None:
    fake_nvidia_smi("nvidia_smi_query_gpu.csv", "nvidia_smi_compute_apps.csv")
    fake_rocm_smi("rocm_smi_two_cards.json")

    probe = await detect(nvml=NoDriverNvml())

    assert isinstance(probe, NvidiaSmiProbe)
    snap = await probe.snapshot()
    assert [g.model for g in snap.gpus][-1] == "NVIDIA GeForce RTX 4090"


async def test_rocm_smi_when_no_nvidia_tool(
    path_is: Path, fake_rocm_smi: Callable[..., Path]
) -> None:
    fake_rocm_smi("rocm_smi_two_cards.json")
    skipped: list[str] = []

    probe = await detect(nvml=NoDriverNvml(), skipped=skipped)

    assert isinstance(probe, RocmSmiProbe)
    assert skipped == [
        "NVML: cannot initialise: Driver Not Loaded",
        "nvidia-smi: not found on PATH",
    ]


async def test_nvidia_smi_that_finds_no_driver_is_passed_over(
    path_is: Path, make_tool: Callable[[str, str], Path], fake_rocm_smi: Callable[..., Path]
) -> None:
    message = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    make_tool("nvidia-smi", f"import sys\nprint({message!r})\nsys.exit(9)\n")
    fake_rocm_smi("rocm_smi_two_cards.json")
    skipped: list[str] = []

    probe = await detect(nvml=NoDriverNvml(), skipped=skipped)

    assert isinstance(probe, RocmSmiProbe)
    assert skipped[1].startswith(f"nvidia-smi: no GPU found; nvidia-smi: {message}")


async def test_none_when_nothing_works(path_is: Path) -> None:
    skipped: list[str] = []

    assert await detect(nvml=NoDriverNvml(), skipped=skipped) is None
    assert skipped == [
        "NVML: cannot initialise: Driver Not Loaded",
        "nvidia-smi: not found on PATH",
        "rocm-smi: not found on PATH",
    ]


async def test_an_explicit_path_wins_over_the_environment(
    path_is: Path, fake_rocm_smi: Callable[..., Path], tmp_path: Path
) -> None:
    fake_rocm_smi("rocm_smi_two_cards.json")
    assert await detect(nvml=NoDriverNvml(), path=str(tmp_path)) is None


async def test_open_by_name(
    path_is: Path,
    fake_nvidia_smi: Callable[..., Path],
    fake_rocm_smi: Callable[..., Path],
    tmp_path: Path,
) -> None:
    fake_nvidia_smi("nvidia_smi_query_gpu.csv", "nvidia_smi_compute_apps.csv")
    fake_rocm_smi("rocm_smi_two_cards.json")
    spec_file = tmp_path / "gpus.toml"
    spec_file.write_text('[[gpus]]\ntotal = "8G"\n')

    assert isinstance(await open_probe("nvml", nvml=OneGpuNvml()), NvmlProbe)
    assert isinstance(await open_probe("nvidia-smi"), NvidiaSmiProbe)
    assert isinstance(await open_probe("rocm-smi"), RocmSmiProbe)
    fake = await open_probe("fake:2x24G:sm_86")
    assert isinstance(fake, FakeProbe)
    assert len(fake.gpus) == 2
    from_file = await open_probe(f"fake:{spec_file}")
    assert isinstance(from_file, FakeProbe)
    assert from_file.gpus[0].total_mb == 8192


async def test_open_by_name_errors(path_is: Path) -> None:
    with pytest.raises(ProbeUnavailable, match="NVML: cannot initialise"):
        await open_probe("nvml", nvml=NoDriverNvml())
    with pytest.raises(ProbeUnavailable, match="nvidia-smi: not found on PATH"):
        await open_probe("nvidia-smi")
    with pytest.raises(InvalidInput, match="'cuda' is not one of nvml, nvidia-smi"):
        await open_probe("cuda")
    with pytest.raises(InvalidInput, match="simulate"):
        await open_probe("fake:2xlots")
