"""The front door bench's order of interleaved requests (``bench/bench_frontdoor.py``):
a request's latency depends on the one before it, so every path must follow every path
alike, or the comparison of two clusters leans on the order."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_frontdoor.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_frontdoor", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_each_path_follows_each_path_once_per_cycle(bench: ModuleType, n: int) -> None:
    order = bench.balanced(n)
    assert sorted(order) == sorted(list(range(n)) * n)  # each path n times
    follows = Counter(zip(order, order[1:] + order[:1], strict=True))  # taken as a cycle
    assert follows == {(a, b): 1 for a in range(n) for b in range(n)}


def test_four_paths(bench: ModuleType) -> None:
    assert bench.balanced(4) == [0, 0, 1, 0, 2, 0, 3, 1, 1, 2, 1, 3, 2, 2, 3, 3]
