"""PNG plots of a comparison (matplotlib, Agg backend: no display needed).

``wait_cdf.png``            the wait-time CDF per priority class, one line per policy.
``memory_utilization.png``  memory held and busy over time, one row per policy.
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

    fig, rows = plt.subplots(
        len(recordings), 1, figsize=(10, 1.8 * len(recordings) + 0.8), sharex=True, squeeze=False
    )
    for (ax,), rec in zip(rows, recordings, strict=True):
        hours, held, busy = utilization_series(rec)
        ax.fill_between(hours, held, step="post", alpha=0.35, label="held (incl. idle-warm)")
        ax.step(hours, busy, where="post", linewidth=1, label="busy (loading or running)")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(rec.policy)
        ax.grid(True, alpha=0.3)
    rows[0][0].legend(fontsize=7, loc="lower right")
    rows[-1][0].set_xlabel("hours")
    fig.suptitle(f"memory utilization (memory / capacity) {title}".strip())
    fig.tight_layout()
    util = directory / "memory_utilization.png"
    fig.savefig(util, dpi=100)
    plt.close(fig)
    return [cdf, util]
