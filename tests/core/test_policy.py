"""A policy refuses any setting that is not what it says, naming the field: arbitrary
values, not only the expected wrong ones."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_arbiter.core import Constraints, InvalidInput, Policy

SECONDS = ("aging_interval_s", "preempt_exempt_s", "grace_s", "idle_reclaim_s",
           "starvation_s", "preempt_patience_s", "claim_s")  # fmt: skip
INTEGERS = ("max_concurrent_loads", "aging_step", "aging_cap")
ANYTHING = st.one_of(
    st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1), st.just(math.nan),
    st.just(-1), st.just(-0.5), st.builds(object),
)  # fmt: skip


@given(st.sampled_from(SECONDS + INTEGERS), ANYTHING)
def test_a_setting_that_is_not_a_number_of_its_kind_is_refused_by_name(
    name: str, value: object
) -> None:
    with pytest.raises(InvalidInput) as refused:
        Policy(**{name: value})
    assert refused.value.field == name


@pytest.mark.parametrize("name", SECONDS)
def test_seconds_take_ints_and_floats(name: str) -> None:
    assert getattr(Policy(**{name: 5}), name) == 5
    assert getattr(Policy(**{name: 7.5}), name) == 7.5


def test_a_bool_is_not_a_count_of_loads() -> None:
    with pytest.raises(InvalidInput, match="max_concurrent_loads: must be an integer >= 1"):
        Policy(max_concurrent_loads=True)


@given(st.one_of(st.booleans(), st.integers(), st.floats(), st.builds(object)))
def test_an_architecture_that_is_not_text_or_a_list_is_refused_by_name(value: object) -> None:
    with pytest.raises(InvalidInput) as refused:
        Constraints.build(gpu_arch=value)
    assert refused.value.field == "constraints.gpu_arch"
