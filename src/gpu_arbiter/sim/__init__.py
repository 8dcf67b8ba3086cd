"""A discrete-event simulator that drives the decision core on a virtual clock.

``ours`` is :class:`gpu_arbiter.core.Scheduler` itself; the baselines are the
ways GPUs are commonly shared today (see :mod:`.baselines`). Every policy runs
the same trace on the same cluster in the same simulated world
(:mod:`.world`), and is judged by the same figures (:mod:`.metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..core import InvalidInput
from .base import Allocator, Attempt, Step, priority_class
from .baselines import BASELINES
from .cluster import PRESETS, Cluster, parse_cluster
from .metrics import Recording, summarize
from .ours import Ours
from .trace import TraceError, TraceRequest, dump_trace, load_trace, parse_trace
from .workloads import KINDS, generate
from .world import Simulation

__all__ = [
    "KINDS",
    "POLICIES",
    "PRESETS",
    "Allocator",
    "Attempt",
    "Cluster",
    "Recording",
    "Simulation",
    "Step",
    "TraceError",
    "TraceRequest",
    "compare",
    "dump_trace",
    "generate",
    "load_trace",
    "parse_cluster",
    "parse_policies",
    "parse_trace",
    "priority_class",
    "summarize",
]

POLICIES: dict[str, Callable[[Cluster], Allocator]] = {"ours": Ours, **BASELINES}


def parse_policies(text: str) -> list[str]:
    """``all`` or names joined by ``,`` (e.g. ``ours,lru``), in the order given."""
    if text.strip().lower() == "all":
        return list(POLICIES)
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in POLICIES:
            raise InvalidInput("policy", f"{name!r} is not one of all, {', '.join(POLICIES)}")
    if not names:
        raise InvalidInput("policy", "names no policy")
    return list(dict.fromkeys(names))


def compare(
    trace: Sequence[TraceRequest],
    cluster: Cluster,
    policies: Sequence[str] = tuple(POLICIES),
    **options: Any,
) -> list[Recording]:
    """Runs each policy over the trace; options go to :class:`Simulation`."""
    return [
        Simulation(trace, cluster, POLICIES[name](cluster), **options).run() for name in policies
    ]
