"""The slot machinery: ``evolve``, ``slot_init`` and ``HashedOnce`` (core/_slots.py)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_arbiter.core import Gpu, GpuId, InvalidInput, Lease, LeaseState, Request
from gpu_arbiter.core._slots import HashedOnce, evolve, slot_init

SLOTS = Path(__file__).resolve().parents[2] / "src" / "gpu_arbiter" / "core" / "_slots.py"


def test_the_slot_machinery_knows_no_value_of_the_core() -> None:
    """It imports only the standard library, so the values can import it (no cycle)."""
    tree = ast.parse(SLOTS.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, node.module
            assert not (node.module or "").startswith("gpu_arbiter"), node.module


@slot_init
@dataclass(frozen=True, slots=True)
class _Pair:
    left: int
    right: int = 2
    tags: list[str] = field(default_factory=list)


def test_slot_init_keeps_defaults_factories_and_refusals() -> None:
    first, second = _Pair(1), _Pair(1)
    assert (first.left, first.right, first.tags) == (1, 2, [])
    assert first.tags is not second.tags
    assert _Pair(1, 3, ["a"]) == _Pair(left=1, right=3, tags=["a"])
    with pytest.raises(TypeError):
        _Pair()  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        first.left = 5  # type: ignore[misc]
    with pytest.raises(TypeError, match="is final"):
        type("Sub", (_Pair,), {})


def test_slot_init_refuses_a_class_that_validates_or_takes_keywords_only() -> None:
    @dataclass(frozen=True, slots=True)
    class Checked:
        value: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class KeywordOnly:
        value: int = field(kw_only=True)

    with pytest.raises(TypeError, match="validates in __post_init__"):
        slot_init(Checked)
    with pytest.raises(TypeError, match="not a plain __init__ argument"):
        slot_init(KeywordOnly)


def test_evolve_refuses_a_field_the_value_does_not_have() -> None:
    request = Request("r", 1)
    with pytest.raises(TypeError, match="Request has no field nonsense"):
        evolve(request, nonsense=1)
    assert request == Request("r", 1)


def test_evolve_does_not_validate_again() -> None:
    """The core's own changes are valid by construction: a validating value is filled
    slot by slot, its ``__post_init__`` not run (``replace`` runs it)."""
    gpu = Gpu(index=0, total_mb=1024, worker="Box-1")
    copied = evolve(gpu, worker="Not A Name")
    assert copied.worker == "Not A Name" and gpu.worker == "box-1"
    with pytest.raises(InvalidInput):
        replace(gpu, worker="Not A Name")


_LEASE = Lease(Request("r", 1), (GpuId("w", 0),), 1, LeaseState.LOADING, 0.0, 30.0, 300.0)


@given(
    token=st.integers(0, 2**63),
    idle=st.booleans(),
    state=st.sampled_from(LeaseState),
    revoked_at=st.none() | st.floats(allow_nan=False),
    shrunk_to_mb=st.none() | st.integers(1, 10**6),
)
def test_evolve_is_replace_without_validation(**changes: Any) -> None:
    assert evolve(_LEASE, **changes) == replace(_LEASE, **changes)
    moved = evolve(_LEASE.request, vram_mb=changes["token"] + 1)
    assert moved == replace(_LEASE.request, vram_mb=changes["token"] + 1)
    assert type(moved) is Request


@dataclass(frozen=True, slots=True)
class _Key(HashedOnce):
    name: str
    number: int

    __hash__ = HashedOnce.cached_hash


@given(st.text(max_size=8), st.integers(), st.integers())
def test_a_remembered_hash_follows_the_fields(name: str, number: int, other: int) -> None:
    key = _Key(name, number)
    assert hash(key) == hash((name, number)) == hash(key)
    changed = evolve(key, number=other)
    assert hash(changed) == hash((name, other))
