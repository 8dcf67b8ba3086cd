"""The routing rules, each one filter or one scorer, and the profiles built of them.

Filters:

- ``routable``: a host whose worker is not online (draining, drained, offline), this one
  included, or a peer that refused a connection just now, is dropped (a draining host's
  requests in flight finish there; new ones go elsewhere);
- ``ready``: a candidate with no replica ready (warm or busy) is dropped;
- ``coming``: a candidate with no replica on its way is dropped;
- ``free_slot``: a replica with no free slot is dropped (a request waits for one).

Scorers (weights in :data:`WEIGHTS`):

- ``free_slot`` (4): 1 with a free slot, else 0;
- ``prefix_affinity`` (2, only with ``[gateway] prefix_affinity = true`` in
  ``models.toml``): 1 where the request's conversation prefix went last, else 0
  (``affinity.py``). Off by default: with it, a conversation stays on a busier replica
  rather than the one with the fewest in flight, a trade (its engine's prompt cache
  against the load's spread) for the operator to make, not the default;
- ``fewest_in_flight`` (1): 1 / (1 + requests in flight).

The weights make the rules strict in that order: a free slot outweighs everything else
(4 > 2 + 1), the prefix's own place outweighs any difference in flight (2 > 1), and the
picker's tie-break (this host, the prefix's rendezvous weight, then names) decides what
the totals leave equal. So, without prefix affinity, the pick is the free slot with the
fewest in flight, this host on a tie: the rule written once for a host at the front door
(:data:`WARM`) and for a replica inside it (:data:`REPLICA`).
"""

from __future__ import annotations

from .figures import Ask, Candidate
from .pick import Filter, Profile, Scorer

__all__ = [
    "COMING",
    "REPLICA",
    "WARM",
    "WEIGHTS",
    "profiles",
]


def _routable(ask: Ask, c: Candidate) -> str | None:
    if c.routable:
        return None
    return c.why_not or "not routable"


def _ready(ask: Ask, c: Candidate) -> str | None:
    return None if c.ready else "no replica ready"


def _coming(ask: Ask, c: Candidate) -> str | None:
    return None if c.coming else "no replica on its way"


def _has_free_slot(ask: Ask, c: Candidate) -> str | None:
    return None if c.in_flight < c.slots else f"full: {c.in_flight} in flight of {c.slots}"


def _free_slot(ask: Ask, c: Candidate) -> float:
    return 1.0 if c.in_flight < c.slots else 0.0


def _fewest_in_flight(ask: Ask, c: Candidate) -> float:
    return 1.0 / (1 + c.in_flight)


def _prefix_affinity(ask: Ask, c: Candidate) -> float:
    return 1.0 if ask.went and ask.went == c.name else 0.0


ROUTABLE = Filter("routable", _routable)
READY = Filter("ready", _ready)
COMING_SOON = Filter("coming", _coming)
HAS_FREE_SLOT = Filter("free_slot", _has_free_slot)

WEIGHTS = {"free_slot": 4.0, "prefix_affinity": 2.0, "fewest_in_flight": 1.0}
FREE_SLOT = Scorer("free_slot", WEIGHTS["free_slot"], _free_slot)
PREFIX_AFFINITY = Scorer("prefix_affinity", WEIGHTS["prefix_affinity"], _prefix_affinity)
FEWEST_IN_FLIGHT = Scorer("fewest_in_flight", WEIGHTS["fewest_in_flight"], _fewest_in_flight)

WARM = Profile("warm", (ROUTABLE, READY), (FREE_SLOT, FEWEST_IN_FLIGHT))
"""A host with a replica ready: a free slot first, then the fewest in flight."""
COMING = Profile("coming", (ROUTABLE, COMING_SOON))
"""A host where a replica is on its way: this host first, then by name."""
REPLICA = Profile("replica", (READY, HAS_FREE_SLOT), (FREE_SLOT, FEWEST_IN_FLIGHT))
"""A replica inside a host with a free slot: the fewest in flight, the first on a tie."""


_AFFINE = (FREE_SLOT, PREFIX_AFFINITY, FEWEST_IN_FLIGHT)
WARM_AFFINE = Profile("warm", WARM.filters, _AFFINE)
REPLICA_AFFINE = Profile("replica", REPLICA.filters, _AFFINE)


def profiles(prefix_affinity: bool) -> tuple[Profile, Profile]:
    """The warm-host and replica profiles, with the prefix affinity scorer or not (the
    one new rule is one more scorer in each)."""
    return (WARM_AFFINE, REPLICA_AFFINE) if prefix_affinity else (WARM, REPLICA)
