"""Where a request for a model goes: one pure decision on the cluster as a front door
sees it (its own models as they are now, the other gateways as the controller last
showed them, the requests it forwards to each), made by two profiles
(``profile/rules.py``), then the cold cases.

In this order:

1. **warm** (:data:`~gpu_arbiter.gateway.profile.WARM`): a host with a replica ready
   (warm or busy), the one with a free slot and the fewest requests in flight, this host
   on a tie;
2. **coming** (:data:`~gpu_arbiter.gateway.profile.COMING`): a host where a replica is
   on its way (queued for its lease, loading, waking, asleep): the request waits there,
   behind that load, and starts no other;
3. **load**: a cold load for the cluster, placed by the arbiter (one lease request over
   every host that declares the model: ``server/cluster.py``); a model only this host
   declares is loaded here, as a gateway on its own does. One that other hosts declare
   too, out of routing now, is still the cluster's load: the arbiter places it among
   the hosts that are routable, or says why none can take it (its only host offline
   since when, out of the front door's reach), where a load of this host's own would
   only say that it does not fit here.

A host is routable while its gateway reports and its worker is online (not draining,
drained or offline); this host always is to itself (its own replicas are its own to
judge). Each profile's run is kept with the route (:attr:`Route.picks`): every
candidate's filter or scores, the totals and the pick, as ``GET /admin/routes`` shows
them. Nothing here does I/O or reads a clock: it is tested alone, and its cost is
measured in ``bench/bench_routing.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..profile import COMING, WARM, Ask, Candidate, Pick, Profile

__all__ = ["Kind", "Route", "route"]


class Kind(StrEnum):
    LOCAL = "local"  # served by this gateway's own replicas (or its own load)
    PEER = "peer"  # forwarded to another gateway
    LOAD = "load"  # a cold load for the cluster, placed by the arbiter
    NONE = "none"  # no host can take it now


@dataclass(frozen=True, slots=True)
class Route:
    kind: Kind
    gateway: str | None
    why: str
    picks: tuple[Pick, ...] = ()  # the profiles' runs that decided it, in order

    def diagnosis(self) -> list[dict[str, Any]]:
        """Each profile's run, as ``GET /admin/routes`` shows it."""
        return [pick.as_json() for pick in self.picks]


def route(
    model: str, hosts: Sequence[Candidate], ask: Ask | None = None, warm: Profile = WARM
) -> Route:
    """Where a request for ``model`` goes among ``hosts`` (each a gateway that declares
    it; this gateway's own copy, if any, ``local``); ``ask``: the request's figures
    (prefix affinity), ``warm``: the warm profile (with the prefix affinity scorer or
    not)."""
    ask = ask or Ask(model)
    first = warm.pick(ask, hosts)
    best = first.picked
    if best is not None:
        kind = Kind.LOCAL if best.local else Kind.PEER
        free = "full" if best.in_flight >= best.slots else f"{best.in_flight} in flight"
        return Route(kind, best.gateway, f"{model} -> {best.gateway}: warm, {free}", (first,))
    gone = first.dropped("routable")
    if len(gone) == len(hosts):
        said = "; ".join(f"{v.candidate.gateway}: {v.dropped.why}" for v in gone if v.dropped)
        why = f"{model}: no host can serve it now ({said or 'none'})"
        return Route(Kind.NONE, None, why, (first,))
    then = COMING.pick(ask, hosts)
    there = then.picked
    if there is not None:
        kind = Kind.LOCAL if there.local else Kind.PEER
        why = f"{model} -> {there.gateway}: its load is on the way"
        return Route(kind, there.gateway, why, (first, then))
    usable = [
        v.candidate for v in first.verdicts if v.dropped is None or v.dropped.filter != "routable"
    ]
    if len(hosts) == 1 and usable[0].local:
        why = f"{model}: cold, only this host runs it"
        return Route(Kind.LOCAL, usable[0].gateway, why, (first, then))
    names = ", ".join(sorted(h.gateway for h in usable))
    return Route(Kind.LOAD, None, f"{model}: cold, a load for the cluster ({names})", (first, then))
