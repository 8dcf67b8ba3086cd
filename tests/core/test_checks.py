"""Checks of human input (core/checks.py); the values built from them are tested in
test_model.py."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_arbiter.core import InvalidInput, checks, model
from gpu_arbiter.core._slots import evolve, slot_init
from gpu_arbiter.core.checks import (
    check_gpus,
    gpu_id_parts,
    is_arch,
    parse_archs,
    parse_capability,
    parse_gpu_ids,
    parse_labels,
)
from gpu_arbiter.core.policy import Policy


def _refusal(fn: Any, *args: Any) -> tuple[str, str]:
    with pytest.raises(InvalidInput) as caught:
        fn(*args)
    return caught.value.field, caught.value.reason


def test_what_was_defined_in_the_model_is_still_importable_from_it() -> None:
    """The checks, the policy and the slot machinery moved out of model.py; code that
    imports them from there gets the very same objects."""
    moved = {name: getattr(checks, name) for name in checks.__all__ if hasattr(model, name)}
    assert set(moved) >= {"MAX_TEXT", "check_metadata", "validate_worker_name"}
    for name, value in moved.items():
        assert getattr(model, name) is value, name
    assert (model.evolve, model.slot_init, model.Policy) == (evolve, slot_init, Policy)


def test_a_gpu_id_is_split_exactly_on_its_colon() -> None:
    assert gpu_id_parts("Box-1:12") == ("box-1", 12)
    for bad in ("box-1", "box-1:0:1", "box-1:", "box-1:٣", "box 1:0"):
        with pytest.raises(InvalidInput):
            gpu_id_parts(bad)


def test_gpu_ids_are_sorted_pairs_on_one_worker() -> None:
    assert parse_gpu_ids(["w:3", "W:1"], None) == (("w", 1), ("w", 3))
    field = "constraints.gpu_ids"
    assert _refusal(parse_gpu_ids, ["w:1", "w:1"], None) == (field, "names a GPU twice")
    assert _refusal(parse_gpu_ids, ["a:1", "b:1"], None)[1].startswith("must all be on one")
    assert _refusal(parse_gpu_ids, ["a:1"], "b")[1].endswith("not constraints.worker")
    assert _refusal(parse_gpu_ids, ["a:1"], None, ("b",))[0] == field
    assert _refusal(parse_gpu_ids, "a:1", None)[0] == field


def test_capability_archs_and_labels() -> None:
    assert parse_capability(None) is None
    assert parse_capability(8.6) == parse_capability(" 8.6 ") == (8, 6)
    field = "constraints.min_compute_capability"
    assert _refusal(parse_capability, True)[0] == _refusal(parse_capability, "8")[0] == field
    assert parse_archs(None) == ()
    assert parse_archs("sm_86") == ("sm_86",)
    assert parse_archs(["sm_89", "sm_86", "sm_89"]) == ("sm_86", "sm_89")
    assert _refusal(parse_archs, ["sm_86", "SM 8"])[0] == "constraints.gpu_arch"
    assert parse_labels(None) == parse_labels({}) == ()
    assert parse_labels({"b": "2", "a": "1"}) == (("a", "1"), ("b", "2"))
    assert _refusal(parse_labels, {"a": 1})[0] == "constraints.labels"


@given(st.text(max_size=12))
def test_an_arch_is_what_a_gpu_and_a_constraint_accept(text: str) -> None:
    gpu_accepts = True
    try:
        model.Gpu(index=0, total_mb=1024, arch=text)
    except InvalidInput:
        gpu_accepts = False
    assert gpu_accepts == (text == "" or is_arch(text))


@given(st.none() | st.integers(-2, 70) | st.booleans(), st.integers(0, 4))
def test_the_gpu_count_is_given_or_that_of_the_exact_gpus(gpus: Any, exact: int) -> None:
    not_as_named = exact and gpus != exact
    if gpus is None:
        assert check_gpus(gpus, exact) == (exact or 1)
    elif isinstance(gpus, bool) or not 1 <= gpus <= checks.MAX_GPUS_PER_REQUEST or not_as_named:
        assert _refusal(check_gpus, gpus, exact)[0] == "gpus"
    else:
        assert check_gpus(gpus, exact) == gpus
