"""The scheduling policy: every setting the decision core takes, with its default.

One frozen value, checked when it is made (errors name the setting); the scheduler reads
it and never changes it. The settings are told in :class:`Policy`'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

from .errors import InvalidInput
from .units import PRIORITY_NAMES

__all__ = ["Policy", "Waiting"]


class Waiting(Protocol):
    """What aging reads of a pending request (a :class:`~.model.Request`)."""

    @property
    def priority(self) -> int: ...
    @property
    def submitted_at(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Policy:
    """Every setting of the scheduling policy, with its default.

    max_concurrent_loads  leases per GPU in state ``loading`` at once (I3); 1 avoids
                          the concurrent-load driver crash.
    placement             ``binpack`` (least memory left after placing: keeps large
                          holes for large requests) or ``spread`` (most left).
    aging_interval_s      a pending request's effective priority rises by
    aging_step            ``aging_step`` per ``aging_interval_s`` waited ...
    aging_cap             ... but never above ``aging_cap`` (below ``interactive``).
                          Aging orders the queue; it never gives preemption rights.
    preempt_exempt_s      a lease younger than this is not preempted unless idle.
    idle_reclaim_s        an idle (keep-warm) lease idle this long is reclaimable by a
                          request of any priority, least recently used first; before
                          that only by equal or higher priority. ``inf``: never.
    starvation_s          a request that has waited this long may reclaim any idle
                          lease, whatever its priority. ``inf``: never. Neither
                          setting gives rights over busy work (I5).
    preempt_patience_s    busy work is preempted only for a request that has waited
                          this long (0: at once), so that a short request does not
                          kill a long job when a warm copy or a release would serve
                          it a moment later. Idle leases are reclaimed at once.
    grace_s               how long a revoked holder has to stop before it is killed;
                          a revoked lease can be renewed only within it, and never
                          past ``revoked_at + grace_s + ttl_s``: a holder that ignores
                          its revocation keeps its memory at most grace + TTL (I4).
    claim_s               where askers must be present (the service), a grant its holder
                          has not taken up within ``min(claim_s, ttl_s / 3)`` is given
                          back (``unclaimed``): always well within its TTL (I8).
    """

    max_concurrent_loads: int = 1
    placement: Literal["binpack", "spread"] = "binpack"
    aging_interval_s: float = 60.0
    aging_step: int = 10
    aging_cap: int = 799
    preempt_exempt_s: float = 0.0
    grace_s: float = 10.0
    # Defaults chosen on the real-trace benchmark (bench/README.md, bench/sim_azure.py).
    idle_reclaim_s: float = 60.0
    starvation_s: float = 120.0
    preempt_patience_s: float = 0.0
    claim_s: float = 10.0

    def __post_init__(self) -> None:
        _integer("max_concurrent_loads", self.max_concurrent_loads, least=1)
        if self.placement not in ("binpack", "spread"):
            raise InvalidInput("placement", "must be 'binpack' or 'spread'")
        _seconds("aging_interval_s", self.aging_interval_s, above_zero=True)
        _integer("aging_step", self.aging_step, least=0)
        _integer("aging_cap", self.aging_cap, least=0)
        if not self.aging_cap < PRIORITY_NAMES["interactive"]:
            raise InvalidInput("aging_cap", "must be in 0..799 (below interactive)")
        _seconds("preempt_exempt_s", self.preempt_exempt_s)
        _seconds("grace_s", self.grace_s)
        _seconds("claim_s", self.claim_s, above_zero=True)
        if not math.isfinite(self.claim_s):
            raise InvalidInput("claim_s", "must be a number of seconds > 0")
        for name in ("idle_reclaim_s", "starvation_s", "preempt_patience_s"):
            _seconds(name, getattr(self, name), never="inf: never")

    def claim_bound_s(self, ttl_s: float | None) -> float:
        """How long a grant may wait for its holder to take it up: ``claim_s``, and
        less than a third of its TTL."""
        return self.claim_s if ttl_s is None else min(self.claim_s, ttl_s / 3)

    def effective_priority(self, request: Waiting, now: float) -> int:
        """Base priority plus aging, capped at ``aging_cap`` (never lowered by the cap)."""
        base = request.priority
        if base >= self.aging_cap or self.aging_step == 0:
            return base
        steps = int(max(0.0, now - request.submitted_at) // self.aging_interval_s)
        return min(self.aging_cap, base + steps * self.aging_step)


def _integer(name: str, value: object, *, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidInput(name, f"must be an integer >= {least}")


def _seconds(name: str, value: object, *, above_zero: bool = False, never: str = "") -> None:
    """A number of seconds (not a bool, not NaN), > 0 or >= 0."""
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not number or not (value > 0 if above_zero else value >= 0):  # type: ignore[operator]
        bound = "> 0" if above_zero else ">= 0"
        extra = f" ({never})" if never else ""
        raise InvalidInput(name, f"must be a number of seconds {bound}{extra}")
