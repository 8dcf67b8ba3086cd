"""The rocm-smi JSON parser against captured outputs, and the probe running a real tool."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_arbiter.agent.probes import (
    ROCM_SMI_ARGS,
    KnownGpus,
    ProbeUnavailable,
    RocmSmiProbe,
    parse_rocm_smi,
)

DATA = Path(__file__).resolve().parent.parent / "data"


def data(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def test_two_cards_bytes_become_mib_and_gfx_becomes_arch() -> None:
    snap = parse_rocm_smi(data("rocm_smi_two_cards.json"))

    assert snap.ok
    assert snap.probe == "rocm-smi"
    mi210, rx7900 = snap.gpus
    assert (mi210.index, mi210.model, mi210.arch, mi210.uuid) == (
        0,
        "AMD Instinct MI210",
        "gfx90a",
        "0x2a5c1e0f8b3d4c71",
    )
    assert (mi210.total_mb, mi210.used_mb) == (65520, 11)
    # capitalised keys of a later release; used rounded up; "N/A" uuid is empty
    assert (rx7900.model, rx7900.arch, rx7900.uuid) == ("Radeon RX 7900 XTX", "gfx1100", "")
    assert (rx7900.total_mb, rx7900.used_mb) == (24560, 1025)
    assert {g.vendor for g in snap.gpus} == {"amd"}
    assert {g.driver_version for g in snap.gpus} == {"6.7.0"}
    assert all(g.processes is None for g in snap.gpus)


def test_malformed_json_is_an_error_not_an_exception() -> None:
    snap = parse_rocm_smi(data("rocm_smi_malformed.json"))

    assert snap.gpus == ()
    [error] = snap.errors
    assert error.startswith("rocm-smi: output is not JSON")


def test_card_without_memory_fails_and_na_gfx_is_empty() -> None:
    snap = parse_rocm_smi(data("rocm_smi_card_without_memory.json"))

    assert [g.index for g in snap.gpus] == [0]
    [failure] = snap.failures
    assert failure.index == 1
    assert failure.uuid == "0x7b1d2e3f4a5c6d80"
    assert failure.error == "rocm-smi: no memory reading (VRAM total missing, used missing)"


def test_warnings_before_the_json_are_skipped() -> None:
    text = "WARNING: AMD GPU device(s) is/are in a low-power state.\n" + data(
        "rocm_smi_two_cards.json"
    )
    assert [g.index for g in parse_rocm_smi(text).gpus] == [0, 1]


@pytest.mark.parametrize("text", ["", "ERROR: no AMD GPU found\n", "[1, 2]"])
def test_output_without_an_object_is_an_error(text: str) -> None:
    snap = parse_rocm_smi(text)
    assert snap.gpus == ()
    assert len(snap.errors) == 1


def test_unknown_gfx_and_non_card_keys_are_ignored() -> None:
    text = (
        '{"card3": {"VRAM Total Memory (B)": "1048576", "VRAM Total Used Memory (B)": "0",'
        ' "GFX Version": "gfx9010abc"}, "cardX": {}, "system": "odd"}'
    )
    [gpu] = parse_rocm_smi(text).gpus
    assert (gpu.index, gpu.total_mb, gpu.used_mb, gpu.arch) == (3, 1, 0, "")


def test_card_that_is_not_an_object_fails() -> None:
    snap = parse_rocm_smi('{"card0": "gone"}')
    assert [(f.index, f.error) for f in snap.failures] == [(0, "rocm-smi: card0 is not an object")]


def test_a_card_that_vanished_is_reported() -> None:
    known = KnownGpus()
    parse_rocm_smi(data("rocm_smi_two_cards.json"), known=known)

    later = parse_rocm_smi(data("rocm_smi_malformed.json"), known=known)

    assert later.stale_indices == (0, 1)
    assert all(f.error.startswith("rocm-smi: output is not JSON") for f in later.failures)


async def test_probe_runs_rocm_smi_with_its_arguments(
    make_tool: Callable[[str, str], Path], tmp_path: Path
) -> None:
    log = tmp_path / "argv"
    body = f"""
import pathlib, sys
pathlib.Path({str(log)!r}).write_text(" ".join(sys.argv[1:]))
sys.stdout.write(pathlib.Path({str(DATA / "rocm_smi_two_cards.json")!r}).read_text())
"""
    snap = await RocmSmiProbe(str(make_tool("rocm-smi", body))).snapshot()

    assert [g.model for g in snap.gpus] == ["AMD Instinct MI210", "Radeon RX 7900 XTX"]
    assert log.read_text() == " ".join(ROCM_SMI_ARGS)


async def test_probe_non_zero_exit_and_missing_binary(
    fake_rocm_smi: Callable[..., Path],
) -> None:
    tool = fake_rocm_smi("rocm_smi_two_cards.json", rc=2)
    probe = RocmSmiProbe(str(tool))

    first = await probe.snapshot()
    tool.unlink()
    second = await probe.snapshot()

    assert len(first.gpus) == 2
    assert first.errors[0].startswith("rocm-smi exited with status 2")
    assert second.stale_indices == (0, 1)
    assert second.errors == (f"{tool}: not found",)


def test_open_says_when_rocm_smi_is_not_on_path(tmp_path: Path) -> None:
    with pytest.raises(ProbeUnavailable, match="rocm-smi: not found on PATH"):
        RocmSmiProbe.open(path=str(tmp_path))
