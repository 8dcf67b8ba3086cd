"""Where a request for a model goes: one pure decision on the cluster as a front door
sees it (its own models as they are now, the other gateways as the controller last
showed them, the requests it forwards to each).

In this order:

1. **warm**: a host with a replica ready (warm or busy), the one with a free slot and
   the fewest requests in flight, this host on a tie;
2. **coming**: a host where a replica is on its way (queued for its lease, loading,
   waking, asleep): the request waits there, behind that load, and starts no other;
3. **load**: a cold load for the cluster, placed by the arbiter (one lease request
   over every host that declares the model: ``server/cluster.py``); a model only this
   host declares is loaded here, as a gateway on its own does.

A host is routable while its gateway reports and its worker is online (not draining,
drained or offline); this host always is to itself (its own replicas are its own to
judge). Nothing here does I/O or reads a clock: it is tested alone, and its cost is
measured in ``bench/bench_routing.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Host", "Kind", "Route", "route"]


class Kind(StrEnum):
    LOCAL = "local"  # served by this gateway's own replicas (or its own load)
    PEER = "peer"  # forwarded to another gateway
    LOAD = "load"  # a cold load for the cluster, placed by the arbiter
    NONE = "none"  # no host can take it now


@dataclass(frozen=True, slots=True)
class Host:
    """One gateway's copy of a model: ``ready`` replicas with ``slots`` in all,
    ``in_flight`` requests on them, whether one is ``coming``."""

    gateway: str
    local: bool = False
    routable: bool = True
    ready: int = 0
    slots: int = 0
    in_flight: int = 0
    coming: bool = False
    why_not: str = ""  # why it is not routable (its worker draining, offline...)


@dataclass(frozen=True, slots=True)
class Route:
    kind: Kind
    gateway: str | None
    why: str


def route(model: str, hosts: Sequence[Host]) -> Route:
    """Where a request for ``model`` goes among ``hosts`` (each a gateway that declares
    it; this gateway's own copy, if any, ``local``)."""
    usable = [h for h in hosts if h.local or h.routable]
    if not usable:
        gone = "; ".join(f"{h.gateway}: {h.why_not or 'not routable'}" for h in hosts)
        return Route(Kind.NONE, None, f"{model}: no host can serve it now ({gone or 'none'})")
    best: Host | None = None
    for host in usable:
        if host.ready and (best is None or _key(host) < _key(best)):
            best = host
    if best is not None:
        kind = Kind.LOCAL if best.local else Kind.PEER
        free = "full" if best.in_flight >= best.slots else f"{best.in_flight} in flight"
        return Route(kind, best.gateway, f"{model} -> {best.gateway}: warm, {free}")
    coming = [h for h in usable if h.coming]
    if coming:
        there = min(coming, key=lambda h: (not h.local, h.gateway))
        kind = Kind.LOCAL if there.local else Kind.PEER
        return Route(kind, there.gateway, f"{model} -> {there.gateway}: its load is on the way")
    if len(usable) == 1 and usable[0].local:
        return Route(Kind.LOCAL, usable[0].gateway, f"{model}: cold, only this host runs it")
    names = ", ".join(sorted(h.gateway for h in usable))
    return Route(Kind.LOAD, None, f"{model}: cold, a load for the cluster ({names})")


def _key(host: Host) -> tuple[bool, int, bool, str]:
    """A host with a free slot first, then the fewest in flight, this host on a tie."""
    return (host.in_flight >= host.slots, host.in_flight, not host.local, host.gateway)
