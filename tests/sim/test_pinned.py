"""One small run's decisions, pinned: a speed-up of the simulator or of a policy must not change
a single one.

``pinned_summaries.json`` holds, for every policy on ``--generate mixed --seed 11 --hours 0.5
--cluster medium``, the run's summary (every figure ``gpu-arbiter simulate -o json`` prints)
and a SHA-256 of its whole schedule (each attempt's wait and grant, and the memory timeline).
It was written by the code before the simulator's speed-up (commit d6be41a). A change that
is meant to change decisions writes it again, and says so::

    PYTHONPATH=src python tests/sim/test_pinned.py > tests/sim/pinned_summaries.json
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from gpu_arbiter.sim import POLICIES, Recording, compare, generate, parse_cluster, summarize

PINNED = Path(__file__).with_name("pinned_summaries.json")


def _digest(rec: Recording) -> str:
    """Every decision's trace in the run: who waited how long, and memory over time."""
    waits = [(w.attempt_id, w.queue_s, w.wait_s, w.warm) for w in rec.waits]
    return hashlib.sha256(repr((waits, rec.timeline)).encode()).hexdigest()


def _runs() -> dict[str, dict[str, Any]]:
    cluster = parse_cluster("medium")
    trace = generate("mixed", 11, cluster, hours=0.5)
    return {
        rec.policy: {"summary": summarize(rec), "schedule_sha256": _digest(rec)}
        for rec in compare(trace, cluster, list(POLICIES))
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    return _runs()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_small_run_makes_the_pinned_decisions(
    runs: dict[str, dict[str, Any]], policy: str
) -> None:
    pinned = json.loads(PINNED.read_text(encoding="utf-8"))
    assert runs[policy]["summary"] == pinned[policy]["summary"]
    assert runs[policy]["schedule_sha256"] == pinned[policy]["schedule_sha256"]


def test_the_pinned_run_exercises_what_a_speed_up_could_break(
    runs: dict[str, dict[str, Any]],
) -> None:
    """Preemption, eviction, warm starts, sleeps and wakes all happen in it, so the pin
    covers the paths that caches and counters shortcut."""
    figures = {name: run["summary"] for name, run in runs.items()}
    assert all(f["completed"] > 0 and f["unfinished"] == 0 for f in figures.values())
    for name in ("priority", "slots", "prio-warm", "ours"):
        assert figures[name]["preemptions"] > 0, name
    for name in ("lru", "prio-warm", "ollama", "ours"):
        assert figures[name]["evictions"] > 0 and figures[name]["warm_starts"] > 0, name
    assert figures["ours-sleep"]["wakes"] > 0 and figures["ours-sleep"]["wakes_abandoned"] > 0


if __name__ == "__main__":
    print(json.dumps(_runs(), indent=1, sort_keys=True))
