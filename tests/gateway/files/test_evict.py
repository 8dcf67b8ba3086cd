"""Which files the budget removes: pure, property-tested."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpu_arbiter.gateway.files.evict import Held, evictions

helds = st.lists(
    st.builds(
        Held,
        name=st.text("abcdef", min_size=1, max_size=3),
        size=st.integers(1, 1000),
        last_used=st.integers(0, 20).map(float),
        in_use=st.booleans(),
    ),
    max_size=8,
    unique_by=lambda h: h.name,
)


@given(helds, st.integers(1, 5000), st.integers(0, 1000))
def test_evictions(held: list[Held], budget: int, incoming: int) -> None:
    plan = evictions(held, budget, incoming)
    by_name = {h.name: h for h in held}
    removed = [by_name[n] for n in plan.remove]
    assert not any(h.in_use for h in removed)  # a used file never goes
    kept = sum(h.size for h in held if h.name not in plan.remove) + incoming
    assert plan.fits == (kept <= budget)
    unused = sorted((h for h in held if not h.in_use), key=lambda h: (h.last_used, h.name))
    assert removed == unused[: len(removed)]  # least recently used first, in that order
    if plan.fits and removed:  # no more than it takes: without the last it did not fit
        assert kept + removed[-1].size > budget
    if not plan.fits:
        assert removed == unused  # every unused file, and still beyond the budget


@given(helds, st.integers(0, 1000))
def test_no_budget_removes_nothing(held: list[Held], incoming: int) -> None:
    assert evictions(held, None, incoming).remove == ()


def test_example() -> None:
    held = [Held("a", 5, 3.0), Held("b", 5, 1.0, in_use=True), Held("c", 5, 2.0)]
    assert evictions(held, 10, incoming=5).remove == ("c", "a")
    assert evictions(held, 10).remove == ("c",)
    assert not evictions(held, 4).fits
