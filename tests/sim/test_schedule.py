"""A trace small enough to schedule by hand: each policy must give exactly that schedule.

One 24 GiB GPU; a preempted holder takes 2 s to stop; idle models stay warm 30 s.

    t=0  r0 batch        16 GiB, load 10 s, run 100 s (preemptible)
    t=5  r1 interactive  16 GiB, load 4 s,  run 10 s
    t=6  r2 normal        4 GiB, load 2 s,  run 10 s

Each expectation is {attempt: (seconds to grant, seconds to run start)}.
"""

from __future__ import annotations

import pytest

from gpu_arbiter.sim import POLICIES, Simulation, parse_cluster, parse_trace, summarize
from gpu_arbiter.sim.metrics import Recording

TRACE = [
    '{"arrival_s": 0, "model": "tune", "vram_mb": "16G", "priority": "batch",'
    ' "load_s": 10, "run_s": 100}',
    '{"arrival_s": 5, "model": "chat", "vram_mb": "16G", "priority": "interactive",'
    ' "load_s": 4, "run_s": 10}',
    '{"arrival_s": 6, "model": "embed", "vram_mb": "4G", "priority": "normal",'
    ' "load_s": 2, "run_s": 10}',
]

EXPECTED = {
    # r0 runs; r1 waits for it (no preemption) and r2 waits behind r1 (no overtaking);
    # at 110 both are granted together: r2's load overlaps r1's.
    "fifo": ({"r0": (0, 10), "r1": (105, 109), "r2": (104, 106)}, 0, 1),
    # r1 preempts r0 while it loads; r2 overtakes into the free 8 GiB at once; r1 gets
    # the GPU when r0 has stopped (7), while r2 still loads; r0 is re-queued and runs last.
    "priority": ({"r2": (0, 2), "r1": (2, 6), "r0.2": (14, 24)}, 1, 1),
    # the same with 6 GiB slots: 3 + 3 + 1 slots fit the same way.
    "slots": ({"r2": (0, 2), "r1": (2, 6), "r0.2": (14, 24)}, 1, 1),
    # r0 runs to the end and stays warm; r1 evicts it (stopped at 112); r2 waits for
    # r1's load to finish (one load at a time).
    "lru": ({"r0": (0, 10), "r1": (107, 111), "r2": (110, 112)}, 0, 0),
    # r1 preempts r0 and holds the memory it frees: r2 cannot take it; r2 waits for
    # r1's load (the load gate); r0 is re-queued and waits until the idle (warm) r1
    # and r2 are released after 30 s of keep-alive: batch may not reclaim them.
    "ours": ({"r1": (2, 6), "r2": (5, 7), "r0.2": (44, 54)}, 1, 0),
}


def _schedule(rec: Recording) -> dict[str, tuple[float, float]]:
    return {w.attempt_id: (round(w.queue_s, 6), round(w.wait_s, 6)) for w in rec.waits}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_hand_made_trace_gives_the_known_schedule(policy: str) -> None:
    cluster = parse_cluster("1x24G")
    trace = parse_trace(TRACE)
    rec = Simulation(trace, cluster, POLICIES[policy](cluster), stop_s=2, keep_alive_s=30).run()
    schedule, preemptions, concurrent = EXPECTED[policy]
    assert _schedule(rec) == schedule
    assert rec.preemptions == preemptions
    assert rec.concurrent_loads == concurrent
    assert summarize(rec)["concurrent_loads_by_gpu"] == ({"w1:0": 1} if concurrent else {})
    assert rec.completed == 3
    assert rec.unfinished == 0
    assert rec.overcommits == 0
    assert rec.violations == []


def test_slots_round_up_to_whole_slots() -> None:
    """Three 7 GiB requests fit 24 GiB by memory, but take 2 of 4 slots each."""
    lines = [
        f'{{"arrival_s": {t}, "model": "m{t}", "vram_mb": "7G", "load_s": 1, "run_s": 10}}'
        for t in (0, 1, 2)
    ]
    cluster = parse_cluster("1x24G")
    waits = {}
    for policy in ("priority", "slots"):
        rec = Simulation(parse_trace(lines), cluster, POLICIES[policy](cluster)).run()
        waits[policy] = _schedule(rec)
    assert waits["priority"] == {"r0": (0, 1), "r1": (0, 1), "r2": (0, 1)}
    assert waits["slots"] == {"r0": (0, 1), "r1": (0, 1), "r2": (9, 10)}


def test_warm_model_is_reused_without_a_load() -> None:
    lines = [
        '{"arrival_s": 0, "model": "chat", "vram_mb": "8G", "load_s": 5, "run_s": 10}',
        '{"arrival_s": 20, "model": "chat", "vram_mb": "8G", "load_s": 5, "run_s": 10}',
        '{"arrival_s": 21, "model": "chat", "vram_mb": "8G", "load_s": 5, "run_s": 10}',
    ]
    cluster = parse_cluster("1x24G")
    for policy in ("ours", "lru"):
        rec = Simulation(parse_trace(lines), cluster, POLICIES[policy](cluster)).run()
        # r1 reuses r0's warm model; r2 loads a second copy, then nothing else runs.
        assert _schedule(rec) == {"r0": (0, 5), "r1": (0, 0), "r2": (0, 5)}, policy
        assert rec.warm_starts == 1
        assert rec.loads_started == 2
    rec = Simulation(parse_trace(lines), cluster, POLICIES["fifo"](cluster)).run()
    assert rec.warm_starts == 0
    assert rec.loads_started == 3


def test_strict_priority_without_nominations_can_livelock_where_ours_does_not() -> None:
    """On 20 GiB, r1 (20 GiB, interactive) preempts r0 (10 GiB); without a nomination r2
    takes the other 10 GiB at once; when r0 has stopped, r1 still does not fit, preempts
    r2, and the re-queued r0 takes the freed memory; and so on, until the horizon."""
    lines = [
        '{"arrival_s": 0, "model": "a", "vram_mb": "10G", "load_s": 1, "run_s": 100}',
        '{"arrival_s": 5, "model": "c", "vram_mb": "20G", "priority": "interactive",'
        ' "load_s": 1, "run_s": 10}',
        '{"arrival_s": 5.5, "model": "d", "vram_mb": "10G", "load_s": 1, "run_s": 100}',
    ]
    cluster = parse_cluster("1x20G")
    stuck = Simulation(
        parse_trace(lines), cluster, POLICIES["priority"](cluster), stop_s=2, horizon_s=600
    ).run()
    assert stuck.unfinished == 3
    assert stuck.preemptions > 250
    assert max(w.wait_s for w in stuck.waits if w.priority == 800) > 590  # still waiting
    ours = Simulation(parse_trace(lines), cluster, POLICIES["ours"](cluster), stop_s=2).run()
    assert ours.unfinished == 0
    assert ours.completed == 3
    assert ours.preemptions == 1
    assert _schedule(ours)["r1"] == (2, 3)  # granted when r0 has stopped, then loads 1 s
