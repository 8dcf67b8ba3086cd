"""PNG plots of a comparison (matplotlib, Agg backend: no display needed).

``wait_cdf.png``            the wait-time CDF per priority class, one line per policy.
``memory_utilization.png``  memory held (solid) and busy (dotted) over time, per policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .base import priority_class
from .metrics import CLASSES, Recording, utilization_series

__all__ = ["write_plots"]


def write_plots(recordings: Sequence[Recording], directory: Path, title: str = "") -> list[Path]:
    """Writes both plots into ``directory`` (created if missing); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    classes = [
        c
        for c in CLASSES
        if any(priority_class(w.priority) == c for r in recordings for w in r.waits)
    ]
    fig, axes = plt.subplots(1, max(1, len(classes)), figsize=(5 * max(1, len(classes)), 4))
    axes_list = list(axes) if len(classes) > 1 else [axes]
    for ax, cls in zip(axes_list, classes, strict=False):
        for rec in recordings:
            waits = sorted(
                max(w.wait_s, 0.1) for w in rec.waits if priority_class(w.priority) == cls
            )
            if waits:
                ys = [(i + 1) / len(waits) for i in range(len(waits))]
                ax.step(waits, ys, where="post", label=rec.policy)
        ax.set_xscale("log")
        ax.set_xlabel("wait (s, log; 0 shown at 0.1)")
        ax.set_ylabel("fraction of starts")
        ax.set_title(f"{cls} wait CDF")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    cdf = directory / "wait_cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4))
    for rec in recordings:
        hours, held, busy = utilization_series(rec)
        (line,) = ax.plot(hours, held, label=f"{rec.policy} held")
        ax.plot(hours, busy, linestyle=":", color=line.get_color(), label=f"{rec.policy} busy")
    ax.set_xlabel("hours")
    ax.set_ylabel("memory / capacity")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"memory utilization over time {title}".strip())
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    util = directory / "memory_utilization.png"
    fig.savefig(util, dpi=100)
    plt.close(fig)
    return [cdf, util]
