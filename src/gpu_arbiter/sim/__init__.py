"""A discrete-event simulator that drives the decision core on a virtual clock.

``ours`` is :class:`gpu_arbiter.core.Scheduler` itself (``ours-sleep`` and
``ours-stop`` the same core with a sleep tier, and without keep-warm: see
:mod:`.ours`); the baselines are the ways GPUs are commonly shared today (see
:mod:`.baselines`). Every policy runs
the same trace on the same cluster in the same simulated world
(:mod:`.world`), and is judged by the same figures (:mod:`.metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..core import InvalidInput, Policy
from .base import Allocator, Attempt, SleepTier, Step, priority_class
from .baselines import BASELINES
from .cluster import PRESETS, Cluster, parse_cluster
from .metrics import Recording, summarize
from .ours import Ours, OursSleep, OursStop
from .trace import TraceError, TraceRequest, dump_trace, load_trace, parse_trace
from .workloads import KINDS, generate
from .world import Simulation

__all__ = [
    "ALL",
    "KINDS",
    "POLICIES",
    "PRESETS",
    "TIERS",
    "Allocator",
    "Attempt",
    "Cluster",
    "Recording",
    "Simulation",
    "SleepTier",
    "Step",
    "TraceError",
    "TraceRequest",
    "compare",
    "dump_trace",
    "generate",
    "load_trace",
    "make_policy",
    "parse_cluster",
    "parse_policies",
    "parse_trace",
    "priority_class",
    "summarize",
]

POLICIES: dict[str, Callable[[Cluster], Allocator]] = {
    "ours": Ours,
    **BASELINES,
    "ours-sleep": OursSleep,
    "ours-stop": OursStop,
}
ALL = ("ours", *BASELINES)  # what ``all`` names: ours against the baselines
TIERS = ("ours", "ours-sleep", "ours-stop")  # what ``tiers`` names: what each tier buys


def parse_policies(text: str) -> list[str]:
    """``all`` (ours and the baselines), ``tiers`` (ours, ours-sleep, ours-stop) or names
    joined by ``,`` (e.g. ``ours,lru``), in the order given."""
    aliases = {"all": ALL, "tiers": TIERS}
    names: list[str] = []
    for name in (part.strip().lower() for part in text.split(",") if part.strip()):
        if name in aliases:
            names.extend(aliases[name])
        elif name in POLICIES:
            names.append(name)
        else:
            raise InvalidInput(
                "policy", f"{name!r} is not one of all, tiers, {', '.join(POLICIES)}"
            )
    if not names:
        raise InvalidInput("policy", "names no policy")
    return list(dict.fromkeys(names))


def make_policy(
    name: str, cluster: Cluster, policy: Policy | None = None, tier: SleepTier | None = None
) -> Allocator:
    """The named policy on ``cluster``; ``policy`` sets the core's settings (ours and its
    variants), ``tier`` how ``ours-sleep``'s models sleep (default :class:`SleepTier`)."""
    if name == "ours-sleep":
        return OursSleep(cluster, policy, tier)
    if name in TIERS:
        return Ours(cluster, policy) if name == "ours" else OursStop(cluster, policy)
    return POLICIES[name](cluster)


def compare(
    trace: Sequence[TraceRequest],
    cluster: Cluster,
    policies: Sequence[str] = ALL,
    *,
    tier: SleepTier | None = None,
    **options: Any,
) -> list[Recording]:
    """Runs each policy over the trace; ``tier`` is ours-sleep's; options go to
    :class:`Simulation`."""
    return [
        Simulation(trace, cluster, make_policy(name, cluster, tier=tier), **options).run()
        for name in policies
    ]
