"""The goals ours is held to, judged from the figures of one comparison.

Each goal compares ours with the best *safe* baseline on that figure (safe: no
over-commit and no concurrent loads; a baseline that crashes GPUs is no
yardstick), whichever baseline that is (ours' own variants, ``ours-sleep`` and
``ours-stop``, are not baselines):

interactive_p99   ours' interactive p99 wait is no worse than the best one's.
normal_p99        ours' normal p99 wait is no worse than the best one's.
batch_max         ours' longest batch wait is at most 1.5 times the best one's.
busy_mem          ours' busy memory (memory loading or running) is at least
                  95 % of the best one's.
safety            ours has zero over-commit, zero concurrent loads and zero
                  invariant violations.

A goal whose figure no safe baseline (or ours) has is left out. No goal is judged when
the trace asks for more than the cluster holds (:func:`offered_load` above 1): every
policy's queue then grows for as long as the trace arrives, the waits measure the
backlog, and the best of them says nothing of a policy (``not_judged`` says why; safety
is still judged).

Beyond the goals, :func:`dominators` names the safe baselines that do strictly
better than ours: at least as good on every figure of ``FRONTIER`` (interactive
p50 and p99 wait, normal p99 wait, longest batch wait, work per hour) and better
on one. Ours is on the trade-off frontier where it names none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .trace import TraceRequest

__all__ = [
    "FRONTIER",
    "GOALS",
    "OVERLOAD",
    "dominators",
    "goal_lines",
    "offered_load",
    "safe",
    "targets",
]

OVERLOAD = 1.0  # offered load above which no goal is judged

Summary = dict[str, Any]
_Figure = Callable[[Summary], float | None]


def _wait(cls: str, figure: str) -> _Figure:
    def value(summary: Summary) -> float | None:
        found = summary["wait"].get(cls, {}).get(figure)
        return None if found is None else float(found)

    return value


def _busy(summary: Summary) -> float | None:
    return float(summary["busy_mem_util"])


# name: (figure, higher is better, the bound on ours / best)
GOALS: dict[str, tuple[_Figure, bool, float]] = {
    "interactive_p99": (_wait("interactive", "p99_s"), False, 1.0),
    "normal_p99": (_wait("normal", "p99_s"), False, 1.0),
    "batch_max": (_wait("batch", "max_s"), False, 1.5),
    "busy_mem": (_busy, True, 0.95),
}


def _work(summary: Summary) -> float | None:
    found = summary.get("work_per_hour")
    return None if found is None else float(found)


# name: (figure, higher is better): what a baseline must match everywhere to beat ours
FRONTIER: dict[str, tuple[_Figure, bool]] = {
    "interactive_p50": (_wait("interactive", "p50_s"), False),
    "interactive_p99": (_wait("interactive", "p99_s"), False),
    "normal_p99": (_wait("normal", "p99_s"), False),
    "batch_max": (_wait("batch", "max_s"), False),
    "work_per_hour": (_work, True),
}


def _beats(theirs: Summary, ours: Summary) -> bool:
    """At least as good as ours on every frontier figure both have, better on one."""
    better = False
    for figure, higher in FRONTIER.values():
        a, b = figure(theirs), figure(ours)
        if a is None or b is None:
            continue
        if a == b:
            continue
        if (a > b) != higher:
            return False
        better = True
    return better


def dominators(summaries: Sequence[Summary]) -> list[str]:
    """The safe baselines that do strictly better than ours (see the module); [] when
    none does or ours is missing."""
    ours = next((s for s in summaries if s["policy"] == "ours"), None)
    if ours is None:
        return []
    pool = [s for s in summaries if not s["policy"].startswith("ours") and safe(s)]
    return [s["policy"] for s in pool if _beats(s, ours)]


def safe(summary: Summary) -> bool:
    """No over-commit and no concurrent loads."""
    return bool(summary["overcommits"] == 0 and summary["concurrent_loads"] == 0)


def _judge(ours: Summary, pool: Sequence[Summary], name: str) -> dict[str, Any] | None:
    figure, higher, bound = GOALS[name]
    mine = figure(ours)
    scored = [(v, b["policy"]) for b in pool if (v := figure(b)) is not None]
    if mine is None or not scored:
        return None
    theirs, baseline = max(scored) if higher else min(scored)
    ratio = round(mine / theirs, 4) if theirs > 0 else None
    met = mine >= bound * theirs if higher else mine <= bound * theirs
    return {
        "ours": mine,
        "baseline": baseline,
        "theirs": theirs,
        "ratio": ratio,
        "bound": bound,
        "met": met,
    }


def offered_load(trace: Sequence[TraceRequest], total_mb: int) -> float:
    """The busy memory-seconds the trace asks for (``vram_mb`` x ``gpus`` x ``run_s``: the
    runs alone, no load, no wait) over the cluster's memory-seconds from the first arrival
    until the last run would end if every one started as it arrived: the shortest time
    any policy could take. Above 1 no policy keeps up. A lower bound: memory never packs
    perfectly (two 16 GiB models do not share a 24 GiB GPU), so a cluster may be
    overloaded below 1 too. 0 for an empty trace."""
    if not trace or total_mb <= 0:
        return 0.0
    start_s = min(r.arrival_s for r in trace)
    end_s = max(r.arrival_s + r.run_s for r in trace)
    work_mb_s = sum(r.vram_mb * r.gpus * r.run_s for r in trace)
    return work_mb_s / (max(end_s - start_s, 1e-9) * total_mb)


def targets(summaries: Sequence[Summary], offered: float | None = None) -> dict[str, Any]:
    """The goals, judged; {} when ours or every baseline is missing. With ``offered``
    (:func:`offered_load`) above :data:`OVERLOAD`, no goal is judged: ``not_judged`` says
    why, and only safety is."""
    ours = next((s for s in summaries if s["policy"] == "ours"), None)
    pool = [s for s in summaries if not s["policy"].startswith("ours") and safe(s)]
    if ours is None or len(summaries) < 2:
        return {}
    out: dict[str, Any] = {}
    if offered is not None and offered > OVERLOAD:
        out["not_judged"] = {
            "offered_load": round(offered, 3),
            "why": f"offered load {offered:.1f}x capacity",
        }
    for name in [] if out else GOALS:
        judged = _judge(ours, pool, name)
        if judged is not None:
            out[name] = judged
    out["safety"] = {
        "overcommits": ours["overcommits"],
        "concurrent_loads": ours["concurrent_loads"],
        "violations": ours["violations"],
        "met": ours["overcommits"] == ours["concurrent_loads"] == ours["violations"] == 0,
    }
    return out


def goal_lines(t: dict[str, Any]) -> list[str]:
    """The judged goals (:func:`gpu_arbiter.sim.report.targets`) as markdown bullets."""
    yes = {True: "met", False: "**not met**"}
    out = []
    for name, goal in t.items():
        if name == "not_judged":
            out.append(f"- goals **not judged**: {goal['why']} (every policy's queue grows)")
        if name in ("safety", "not_judged"):
            continue
        ratio = "-" if goal["ratio"] is None else f"{goal['ratio']:.2f}"
        out.append(
            f"- {name}: ours {goal['ours']:.3g} vs {goal['baseline']} {goal['theirs']:.3g} "
            f"(ratio {ratio}, bound {goal['bound']:g}): {yes[goal['met']]}"
        )
    safety = t["safety"]
    out.append(
        f"- zero over-commit / concurrent loads / invariant violations: "
        f"{safety['overcommits']} / {safety['concurrent_loads']} / {safety['violations']}: "
        f"{yes[safety['met']]}"
    )
    return out
