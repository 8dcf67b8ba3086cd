"""The targets ours is held to, judged from the figures of one comparison.

Against the best baseline on each figure (and, separately, the best *safe*
baseline: one with no over-commit and no concurrent loads):

interactive_p99   ours' interactive p99 wait is at most a tenth of the best
                  baseline's.
mem_util          ours' memory utilization is at least 95 % of the best
                  baseline's.
safety            ours has zero over-commit, zero concurrent loads and zero
                  invariant violations.
batch_wait        ours' longest batch wait is bounded: every batch request
                  started before the run ended (it is reported either way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["targets"]

Summary = dict[str, Any]


def _wait(summary: Summary, cls: str, figure: str) -> float | None:
    value = summary["wait"].get(cls, {}).get(figure)
    return None if value is None else float(value)


def _best(
    baselines: Sequence[Summary], value: Callable[[Summary], float | None], *, highest: bool
) -> tuple[str, float] | None:
    scored = [(v, b["policy"]) for b in baselines if (v := value(b)) is not None]
    if not scored:
        return None
    v, name = max(scored) if highest else min(scored, key=lambda item: (item[0], item[1]))
    return name, v


def _safe(summary: Summary) -> bool:
    return bool(summary["overcommits"] == 0 and summary["concurrent_loads"] == 0)


def _p99_target(ours: Summary, baselines: Sequence[Summary]) -> dict[str, Any] | None:
    mine = _wait(ours, "interactive", "p99_s")
    if mine is None:
        return None
    out: dict[str, Any] = {"ours_s": mine}
    for label, pool in (("best", baselines), ("best_safe", [b for b in baselines if _safe(b)])):
        best = _best(pool, lambda b: _wait(b, "interactive", "p99_s"), highest=False)
        if best is None:
            continue
        out[f"{label}_baseline"], theirs = best
        out[f"{label}_s"] = theirs
        out[f"{label}_ratio"] = round(mine / theirs, 4) if theirs > 0 else None
        out[f"met_vs_{label}"] = mine <= theirs / 10
    return out


def _util_target(ours: Summary, baselines: Sequence[Summary]) -> dict[str, Any]:
    out: dict[str, Any] = {"ours": ours["mem_util"]}
    for label, pool in (("best", baselines), ("best_safe", [b for b in baselines if _safe(b)])):
        best = _best(pool, lambda b: float(b["mem_util"]), highest=True)
        if best is None:
            continue
        out[f"{label}_baseline"], theirs = best
        out[f"{label}"] = theirs
        out[f"{label}_ratio"] = round(ours["mem_util"] / theirs, 4) if theirs > 0 else None
        out[f"met_vs_{label}"] = ours["mem_util"] >= 0.95 * theirs
    return out


def targets(summaries: Sequence[Summary]) -> dict[str, Any]:
    """The targets, judged; {} when ours or every baseline is missing."""
    ours = next((s for s in summaries if s["policy"] == "ours"), None)
    baselines = [s for s in summaries if s["policy"] != "ours"]
    if ours is None or not baselines:
        return {}
    out: dict[str, Any] = {}
    p99 = _p99_target(ours, baselines)
    if p99 is not None:
        out["interactive_p99"] = p99
    out["mem_util"] = _util_target(ours, baselines)
    out["safety"] = {
        "overcommits": ours["overcommits"],
        "concurrent_loads": ours["concurrent_loads"],
        "violations": ours["violations"],
        "met": ours["overcommits"] == ours["concurrent_loads"] == ours["violations"] == 0,
    }
    batch = _wait(ours, "batch", "max_s")
    if batch is not None:
        out["batch_wait"] = {
            "ours_longest_s": batch,
            "baselines_longest_s": {b["policy"]: _wait(b, "batch", "max_s") for b in baselines},
            "met": ours["unfinished"] == 0,
        }
    return out
