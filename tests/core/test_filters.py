from __future__ import annotations

from typing import Any

import pytest

from gpu_arbiter.core import Constraints
from gpu_arbiter.core.filters import mismatch
from tests.core.support import gpu


def _check(
    constraints: dict[str, Any],
    labels: dict[str, str] | None = None,
    vram_mb: int = 1,
    **gpu_fields: Any,
) -> str | None:
    return mismatch(gpu(**gpu_fields), labels or {}, Constraints.build(**constraints), vram_mb)


def test_no_constraints_match_any_big_enough_gpu() -> None:
    assert _check({}) is None
    assert _check({}, vram_mb=24 * 1024, total_mb=24 * 1024) is None
    assert _check({}, vram_mb=24 * 1024 + 1, total_mb=24 * 1024) == "too_small"
    assert _check({}, vram_mb=24 * 1024, total_mb=24 * 1024, headroom_mb=256) == "too_small"


def test_vendor() -> None:
    assert _check({"vendor": "NVIDIA"}, vendor="nvidia") is None
    assert _check({"vendor": "amd"}, vendor="nvidia") == "vendor_mismatch"


@pytest.mark.parametrize(
    ("minimum", "arch", "matches"),
    [
        ("8.0", "sm_86", True),
        ("8.6", "sm_86", True),
        ("8.9", "sm_86", False),
        ("9.0", "sm_100", True),
        ("10.0", "sm_90", False),
        ("10.0", "sm_100", True),
        (8.0, "sm_75", False),
        ("7.5", "sm_75", True),
        ("8.0", "gfx1100", False),
        ("8.0", "", False),
    ],
)
def test_min_compute_capability_compares_numbers(
    minimum: str | float, arch: str, matches: bool
) -> None:
    verdict = _check({"min_compute_capability": minimum}, arch=arch)
    assert (verdict is None) is matches
    if not matches:
        assert verdict == "compute_capability_too_low"


def test_gpu_arch_is_exact() -> None:
    assert _check({"gpu_arch": ["sm_86", "sm_89"]}, arch="sm_86") is None
    assert _check({"gpu_arch": ["sm_86", "sm_89"]}, arch="sm_89") is None
    assert _check({"gpu_arch": ["sm_8"]}, arch="sm_86") == "arch_mismatch"
    assert _check({"gpu_arch": ["sm_86"]}, arch="sm_860") == "arch_mismatch"
    assert _check({"gpu_arch": ["gfx1100"]}, arch="gfx110") == "arch_mismatch"
    assert _check({"gpu_arch": ["sm_86"]}, arch="") == "arch_mismatch"


def test_gpu_model_is_a_case_insensitive_glob() -> None:
    model = "NVIDIA GeForce RTX 4090"
    assert _check({"gpu_model": "*rtx 4090*"}, model=model) is None
    assert _check({"gpu_model": "NVIDIA GEFORCE RTX 4090"}, model=model) is None
    assert _check({"gpu_model": "*RTX 40?0"}, model=model) is None
    assert _check({"gpu_model": "*A100*"}, model=model) == "model_mismatch"
    assert _check({"gpu_model": "RTX 4090"}, model=model) == "model_mismatch"


def test_worker_is_exact() -> None:
    assert _check({"worker": "foo"}, worker="foo") is None
    assert _check({"worker": "foo"}, worker="foo-bar") == "worker_mismatch"
    assert _check({"worker": "foo-bar"}, worker="foo") == "worker_mismatch"


def test_labels_must_all_match() -> None:
    labels = {"zone": "a", "disk": "ssd"}
    assert _check({"labels": {"zone": "a"}}, labels) is None
    assert _check({"labels": {"zone": "a", "disk": "ssd"}}, labels) is None
    assert _check({"labels": {"zone": "a", "disk": "hdd"}}, labels) == "label_mismatch"
    assert _check({"labels": {"rack": "1"}}, labels) == "label_mismatch"


def test_gpu_ids_are_exact_gpus_never_prefixes() -> None:
    wanted = {"gpu_ids": ["foo:1"]}
    assert _check(wanted, worker="foo", index=1) is None
    assert _check(wanted, worker="foo", index=0) == "gpu_mismatch"
    assert _check(wanted, worker="foo-bar", index=1) == "gpu_mismatch"
    assert _check({"gpu_ids": ["foo-bar:1"]}, worker="foo", index=1) == "gpu_mismatch"
    assert _check({"gpu_ids": ["foo:1"]}, worker="foo", index=11) == "gpu_mismatch"
