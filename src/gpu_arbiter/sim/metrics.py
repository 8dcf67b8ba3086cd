"""What a simulated run records, and the figures it is judged by.

Figures per policy:

wait            seconds from a request's (re)submission until its run starts:
                queueing, waiting for victims to stop, and the model load; 0 when
                a warm model is reused. Per priority class: median, p95, p99 and
                the longest (starvation). A preempted request is re-queued as a
                new attempt whose wait counts from its re-submission.
                ``queue_p99_s``: p99 of the wait until the grant alone (no load).
busy_mem_util   the headline utilization: time-weighted memory of processes
                loading or running (doing work) over the cluster's capacity,
                while the trace arrives (0 to the last arrival: the same window
                for every policy; the span when everything arrives at once).
mem_util        the same for all memory held by holders' processes (loading,
                running, idle-warm, asleep, stopping).
mem_util_no_idle  the same without idle-warm memory (loading, running,
                stopping): memory held by work, started or ending. What a sleeping
                model keeps counts as idle-warm; a wake's load as busy.
work_per_hour   GPU-hours of completed runs per hour (run_s x gpus over the span).
loads, warm_starts, sleeps, wakes  cold loads (a process started), runs on a
                warm model, models put to sleep, and runs on a woken one (a wake:
                the difference granted again, ``wake_s`` instead of a load).
                ``wakes_abandoned``: wakes not granted within a cold load's time
                (the sleeping model stopped, the request started cold).
preemptions     runs and loads interrupted; ``wasted_run_s`` the GPU-seconds of
                run they had done (lost). ``evictions``: idle models reclaimed.
overcommits     grants that pushed a GPU's held memory above its capacity.
concurrent_loads  loads that started on a GPU while another load ran there;
                ``max_loads`` the most at once on one GPU. Both also per GPU
                (``*_by_gpu``, GPUs with none left out).
violations      invariant violations found in the policy's own books (ours).
unfinished      requests not done when the run ended (a policy that livelocks
                runs until the horizon).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import priority_class

__all__ = ["CLASSES", "Recording", "WaitSample", "percentile", "summarize", "utilization_series"]

CLASSES = ("interactive", "normal", "background", "batch")


@dataclass(frozen=True, slots=True)
class WaitSample:
    priority: int
    wait_s: float
    queue_s: float
    warm: bool
    attempt_id: str


@dataclass(slots=True)
class Recording:
    policy: str
    capacity_mb: int
    waits: list[WaitSample] = field(default_factory=list)
    completed: int = 0
    work_gpu_s: float = 0.0
    last_completion: float = 0.0
    preemptions: int = 0
    wasted_run_s: float = 0.0
    evictions: int = 0
    loads_started: int = 0
    warm_starts: int = 0
    sleeps: int = 0
    wakes: int = 0
    wakes_abandoned: int = 0
    overcommits: int = 0
    concurrent_loads: int = 0
    by_gpu: dict[str, Counter[str]] = field(default_factory=dict)
    max_loads: int = 0
    violations: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    unfinished: int = 0
    steps: int = 0
    window_s: float = 0.0
    held_mb: int = 0
    busy_mb: int = 0
    idle_mb: int = 0
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)

    def count(self, what: str, gpu: str) -> None:
        """One over-commit or concurrent load (``what``) on ``gpu``."""
        self.by_gpu.setdefault(what, Counter())[gpu] += 1
        if what == "overcommits":
            self.overcommits += 1
        else:
            self.concurrent_loads += 1

    def change(self, now: float, *, held: int, busy: int, idle: int = 0) -> None:
        """Memory held (and of it busy, idle-warm) changed at ``now`` by these deltas."""
        self.held_mb += held
        self.busy_mb += busy
        self.idle_mb += idle
        point = (now, self.held_mb, self.busy_mb, self.idle_mb)
        if self.timeline and self.timeline[-1][0] == now:
            self.timeline[-1] = point
        else:
            self.timeline.append(point)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of the values; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _integral(
    timeline: Sequence[tuple[float, int, int, int]], end: float
) -> tuple[float, float, float]:
    """MiB-seconds held, busy and idle-warm from 0 to ``end``."""
    held = busy = idle = 0.0
    for (t, h, b, i), following in zip(timeline, [*timeline[1:], None], strict=True):
        if t >= end:
            break
        until = end if following is None else min(following[0], end)
        held += h * (until - t)
        busy += b * (until - t)
        idle += i * (until - t)
    return held, busy, idle


def summarize(rec: Recording) -> dict[str, Any]:
    """The figures of one run, as plain JSON-ready values."""
    end = rec.last_completion
    window = rec.window_s if rec.window_s > 0 else end  # all arrived at once: the span
    held, busy, idle = _integral(rec.timeline, window)
    denominator = rec.capacity_mb * window if window > 0 else 1.0
    classes: dict[str, dict[str, float | int]] = {}
    for name in CLASSES:
        samples = [w for w in rec.waits if priority_class(w.priority) == name]
        if not samples:
            continue
        waits = [w.wait_s for w in samples]
        classes[name] = {
            "starts": len(samples),
            "warm_starts": sum(w.warm for w in samples),
            "p50_s": round(percentile(waits, 50), 3),
            "p95_s": round(percentile(waits, 95), 3),
            "p99_s": round(percentile(waits, 99), 3),
            "max_s": round(max(waits), 3),
            "queue_p99_s": round(percentile([w.queue_s for w in samples], 99), 3),
        }
    return {
        "policy": rec.policy,
        "wait": classes,
        "busy_mem_util": round(busy / denominator, 4),
        "mem_util": round(held / denominator, 4),
        "mem_util_no_idle": round((held - idle) / denominator, 4),
        "work_per_hour": round(rec.work_gpu_s / end, 4) if end > 0 else 0.0,
        "span_s": round(end, 3),
        "window_s": round(rec.window_s, 3),
        "completed": rec.completed,
        "preemptions": rec.preemptions,
        "wasted_run_s": round(rec.wasted_run_s, 3),
        "evictions": rec.evictions,
        "loads": rec.loads_started,
        "warm_starts": rec.warm_starts,
        "sleeps": rec.sleeps,
        "wakes": rec.wakes,
        "wakes_abandoned": rec.wakes_abandoned,
        "overcommits": rec.overcommits,
        "concurrent_loads": rec.concurrent_loads,
        "overcommits_by_gpu": dict(sorted(rec.by_gpu.get("overcommits", {}).items())),
        "concurrent_loads_by_gpu": dict(sorted(rec.by_gpu.get("concurrent_loads", {}).items())),
        "max_loads_per_gpu": rec.max_loads,
        "violations": len(rec.violations),
        "rejected": len(rec.rejected),
        "unfinished": rec.unfinished,
        "steps": rec.steps,
    }


def utilization_series(
    rec: Recording, bins: int = 200
) -> tuple[list[float], list[float], list[float]]:
    """(bin start hours, held fraction, busy fraction), time-averaged per bin."""
    end = rec.last_completion
    if end <= 0 or not rec.timeline:
        return [], [], []
    width = end / bins
    starts, held_out, busy_out = [], [], []
    previous_held = previous_busy = 0.0
    for i in range(bins):
        held, busy, _ = _integral(rec.timeline, (i + 1) * width)
        starts.append(i * width / 3600)
        held_out.append((held - previous_held) / (width * rec.capacity_mb))
        busy_out.append((busy - previous_busy) / (width * rec.capacity_mb))
        previous_held, previous_busy = held, busy
    return starts, held_out, busy_out
