"""The sleep tier: what a sleeping model gives back, when that memory is granted, how it
wakes, and that it keeps every invariant (ours-sleep against ours and ours-stop)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_arbiter.core import GpuId, InvalidInput
from gpu_arbiter.sim import (
    Simulation,
    SleepTier,
    TraceRequest,
    compare,
    generate,
    make_policy,
    parse_cluster,
    parse_trace,
    summarize,
)
from gpu_arbiter.sim.base import Attempt
from gpu_arbiter.sim.metrics import Recording
from gpu_arbiter.sim.ours import OursSleep

from .test_schedule import TRACE


def _schedule(rec: Recording) -> dict[str, tuple[float, float]]:
    return {w.attempt_id: (round(w.queue_s, 6), round(w.wait_s, 6)) for w in rec.waits}


def _run(lines: list[str], spec: str, policy: str, tier: SleepTier, **options: float) -> Recording:
    cluster = parse_cluster(spec)
    allocator = make_policy(policy, cluster, tier=tier)
    return Simulation(parse_trace(lines), cluster, allocator, **options).run()


CHAT_TWICE = [
    '{"arrival_s": 0, "model": "chat", "vram_mb": "16G", "priority": "interactive",'
    ' "load_s": 20, "run_s": 10}',
    '{"arrival_s": 200, "model": "chat", "vram_mb": "16G", "priority": "interactive",'
    ' "load_s": 20, "run_s": 10}',
]


def test_a_wake_is_faster_than_a_cold_load() -> None:
    """chat runs 0-30 (20 s load), then idles; asked again at 200. Kept warm (ours) it
    starts at once; stopped (ours-stop) it loads again for 20 s; asleep since 90
    (ours-sleep) it waits only the wake (1 s), and meanwhile held 15 % of its size."""
    tier = SleepTier(after_s=60, resident=0.15, sleep_s=2, wake_s=1)
    runs = {p: _run(CHAT_TWICE, "1x24G", p, tier) for p in ("ours", "ours-sleep", "ours-stop")}
    assert _schedule(runs["ours"]) == {"r0": (0, 20), "r1": (0, 0)}
    assert _schedule(runs["ours-stop"]) == {"r0": (0, 20), "r1": (0, 20)}
    assert _schedule(runs["ours-sleep"]) == {"r0": (0, 20), "r1": (0, 1)}
    slept = runs["ours-sleep"]
    assert (slept.sleeps, slept.wakes, slept.loads_started, slept.warm_starts) == (2, 1, 1, 0)
    assert (runs["ours-stop"].loads_started, runs["ours"].loads_started) == (2, 1)
    for rec in runs.values():
        assert rec.violations == []
        assert rec.overcommits == rec.concurrent_loads == rec.unfinished == 0
    held = {p: summarize(rec)["mem_util"] for p, rec in runs.items()}
    assert held["ours-stop"] < held["ours-sleep"] < held["ours"]


TUNE_AFTER_CHAT = [
    '{"arrival_s": 0, "model": "chat", "vram_mb": "16G", "priority": "interactive", "run_s": 10}',
    '{"arrival_s": 16, "model": "tune", "vram_mb": "16G", "priority": "batch",'
    ' "load_s": 1, "run_s": 10}',
]


class _Blind(OursSleep):
    """A sleep tier whose probe never reports: the core only sees the shrunk lease."""

    def observe(self, gpu_id: GpuId, used_mb: Mapping[str, int]) -> None:
        return None


def test_memory_given_back_is_granted_only_once_the_probe_shows_it_free() -> None:
    """chat (16 of 24 GiB) idles from 10 and is put to sleep at 15: its lease shrinks at
    once, but its process gives the memory back only at 25 (sleep_s 10). The batch job
    (16 GiB) that comes at 16 may not reclaim an interactive model idle for 6 s, so it
    is granted at 25, when the probe shows the memory free, and never over-commits.
    Without the probe the core would grant it at 16 on memory still held."""
    tier = SleepTier(after_s=5, resident=0.1, sleep_s=10, wake_s=1)
    rec = _run(TUNE_AFTER_CHAT, "1x24G", "ours-sleep", tier)
    assert _schedule(rec) == {"r0": (0, 0), "r1": (9, 10)}
    assert rec.overcommits == 0
    assert rec.violations == []
    cluster = parse_cluster("1x24G")
    blind = Simulation(parse_trace(TUNE_AFTER_CHAT), cluster, _Blind(cluster, tier=tier)).run()
    assert _schedule(blind) == {"r0": (0, 0), "r1": (0, 1)}
    assert blind.overcommits == 1


def test_sleep_lets_a_batch_job_in_before_the_keep_alive() -> None:
    """The hand-made trace of test_schedule.py: with keep-warm alone the re-queued batch
    job waits out the 30 s keep-alive of the two idle models (ours: granted at 51);
    asleep 5 s after their runs, they give back all but 15 % and it is granted at 28."""
    tier = SleepTier(after_s=5, resident=0.15, sleep_s=2, wake_s=1)
    rec = _run(TRACE, "1x24G", "ours-sleep", tier, stop_s=2, keep_alive_s=30)
    assert _schedule(rec) == {"r1": (2, 6), "r2": (5, 7), "r0.2": (21, 31)}
    assert rec.sleeps == 3  # r1, r2 and, when done, r0.2
    assert rec.evictions == 0  # nothing was stopped for it
    assert rec.violations == []


WAKE_ON_ITS_GPU = [
    '{"arrival_s": 0, "model": "chat", "vram_mb": "16G", "priority": "interactive",'
    ' "load_s": 2, "run_s": 10}',
    '{"arrival_s": 0, "model": "filler", "vram_mb": "8G", "priority": "interactive",'
    ' "load_s": 2, "run_s": 1000}',
    '{"arrival_s": 100, "model": "chat", "vram_mb": "16G", "priority": "interactive",'
    ' "load_s": 2, "run_s": 10}',
]


class _Anywhere(OursSleep):
    """A wake that forgets ``gpu_ids``: the core places the difference wherever fits."""

    def wake(
        self, attempt: Attempt, asleep: str, gpus: tuple[GpuId, ...], vram_mb: int, now: float
    ) -> str | None:
        return self._ask(attempt, vram_mb, attempt.item.constraints, now)


def test_a_wake_asks_for_the_difference_on_its_own_gpus() -> None:
    """On 2x24G chat sleeps on one GPU (2.4 GiB kept), the filler holds 8 GiB of the other.
    The difference (13.6 GiB) fits both; placed freely it would go where the least room is
    left (the filler's GPU), away from its process. With gpu_ids it lands on its own."""
    tier = SleepTier(after_s=30, resident=0.15, sleep_s=2, wake_s=1)
    rec = _run(WAKE_ON_ITS_GPU, "2x24G", "ours-sleep", tier)
    assert rec.wakes == 1
    assert _schedule(rec)["r2"] == (0, 1)
    assert rec.violations == []
    cluster = parse_cluster("2x24G")
    loose = Simulation(parse_trace(WAKE_ON_ITS_GPU), cluster, _Anywhere(cluster, tier=tier))
    assert any(v.startswith("wake r2 granted on") for v in loose.run().violations)


GIVE_UP = [
    '{"arrival_s": 0, "model": "code", "vram_mb": "16G", "load_s": 10, "run_s": 10}',
    '{"arrival_s": 30, "model": "chat", "vram_mb": "20G", "priority": "interactive",'
    ' "load_s": 1, "run_s": 1000}',
    '{"arrival_s": 50, "model": "code", "vram_mb": "16G", "load_s": 10, "run_s": 10}',
]


def test_a_wake_not_granted_within_a_load_time_starts_cold_elsewhere() -> None:
    """code sleeps on w1:0 at 25 (2.4 GiB kept); chat (20 GiB, interactive, busy for
    1000 s) takes the memory it gave back. The request for code at 50 asks for the
    difference there, which chat holds; after code's load time (10 s) it gives up: the
    sleeping model stops and the request loads cold on w1:1 (its wait counts from 50)."""
    tier = SleepTier(after_s=5, resident=0.15, sleep_s=2, wake_s=1)
    rec = _run(GIVE_UP, "2x24G", "ours-sleep", tier)
    assert _schedule(rec) == {"r0": (0, 10), "r1": (0, 1), "r2.2": (10, 20)}
    # each of the three runs is put to sleep when done; none woke
    assert (rec.sleeps, rec.wakes, rec.wakes_abandoned, rec.loads_started) == (3, 0, 1, 3)
    assert rec.violations == []
    assert rec.overcommits == rec.unfinished == 0


_models = st.tuples(  # size GiB, GPUs, priority, preemptible, load s
    st.integers(1, 24),
    st.integers(1, 2),
    st.sampled_from([100, 300, 500, 800]),
    st.booleans(),
    st.integers(0, 20).map(float),
)
_calls = st.tuples(st.integers(0, 400).map(float), st.integers(0, 3), st.integers(1, 60))


@st.composite
def _traces(draw: st.DrawFn) -> list[TraceRequest]:
    """Requests for a few models, each always of the same shape: they reuse, sleep, wake."""
    models = draw(st.lists(_models, min_size=1, max_size=4))
    out = []
    for at, index, run in draw(st.lists(_calls, min_size=1, max_size=25)):
        gib, gpus, priority, preemptible, load = models[index % len(models)]
        model = f"m{index % len(models)}"
        out.append(
            TraceRequest(at, model, gib * 1024, float(run), gpus, priority, preemptible, load)
        )
    return sorted(out, key=lambda r: r.arrival_s)


_tiers = st.builds(
    SleepTier,
    after_s=st.integers(0, 40).map(float),
    resident=st.sampled_from([0.05, 0.15, 0.5, 0.9]),
    sleep_s=st.integers(0, 30).map(float),
    wake_s=st.integers(0, 10).map(float),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_traces(), _tiers, st.sampled_from(["1x24G", "2w:2x24G"]))
def test_random_traces_with_sleep_keep_every_invariant(
    trace: list[TraceRequest], tier: SleepTier, spec: str
) -> None:
    """I1 (committed), I2 (what a process holds by the probe is never free), I3, I4, I5,
    I6 on the core's books at every step, and no physical over-commit: the world's own
    count of memory its processes hold, a sleeping one's until it has given it back."""
    cluster = parse_cluster(spec)
    allocator = OursSleep(cluster, tier=tier)
    rec = Simulation(trace, cluster, allocator, keep_alive_s=60.0, stop_s=1.0).run()
    assert rec.violations == []
    assert rec.overcommits == 0
    assert rec.concurrent_loads == 0
    assert rec.unfinished == 0
    assert rec.completed + len(rec.rejected) == len(trace)
    assert rec.held_mb == rec.busy_mb == rec.idle_mb == 0  # everything given back at the end
    assert all(g.committed_mb == 0 for g in map(allocator.scheduler.figures, cluster.capacity_mb()))


def test_generated_trace_sleeps_wakes_and_reclaims_sleeping_models() -> None:
    cluster = parse_cluster("medium")
    trace = generate("mixed", 7, cluster, hours=0.5)
    tier = SleepTier(after_s=30, resident=0.15, sleep_s=2, wake_s=1)
    (rec,) = compare(trace, cluster, ["ours-sleep"], tier=tier)
    assert rec.sleeps > 0 and rec.wakes > 0
    assert rec.evictions > 0  # idle and sleeping models were reclaimed
    assert rec.violations == []
    assert rec.overcommits == rec.concurrent_loads == rec.unfinished == 0


def test_seeded_runs_with_sleep_are_identical() -> None:
    cluster = parse_cluster("2w:2x24G")
    trace = generate("mixed", 11, cluster, hours=0.3)
    tier = SleepTier(after_s=20, resident=0.2, sleep_s=3, wake_s=2)
    first, second = (compare(trace, cluster, ["ours-sleep"], tier=tier)[0] for _ in range(2))
    assert first.sleeps > 0
    assert summarize(first) == summarize(second)
    assert first.waits == second.waits
    assert first.timeline == second.timeline


@pytest.mark.parametrize(
    ("settings_", "field"),
    [
        ({"resident": 1.0}, "sleep-resident"),
        ({"resident": 0.0}, "sleep-resident"),
        ({"after_s": -1.0}, "sleep-after"),
        ({"sleep_s": float("nan")}, "sleep-s"),
        ({"wake_s": float("inf")}, "wake-s"),
    ],
)
def test_bad_sleep_settings_name_their_field(settings_: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidInput) as info:
        SleepTier(**settings_)
    assert str(info.value).startswith(field)


def test_a_model_too_small_to_give_memory_back_stays_warm() -> None:
    """A 1 MiB model keeps all of it asleep (a lease holds at least 1 MiB): it never
    sleeps, and is reused warm as with ours."""
    tier = SleepTier(after_s=1, resident=0.15)
    assert (tier.resident_mb(16 * 1024), tier.resident_mb(1)) == (2458, 1)
    lines = [
        '{"arrival_s": 0, "model": "m", "vram_mb": 1, "run_s": 5}',
        '{"arrival_s": 50, "model": "m", "vram_mb": 1, "run_s": 5}',
    ]
    rec = _run(lines, "1x24G", "ours-sleep", tier)
    assert (rec.sleeps, rec.warm_starts, rec.violations) == (0, 1, [])
