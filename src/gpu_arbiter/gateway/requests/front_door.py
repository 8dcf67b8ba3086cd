"""The cluster's front door: where a request that came to this gateway first goes
(``cluster/routing.py`` decides): a ready replica here (this gateway's own path serves
it), a ready replica on another host (relayed there: ``relay.to_peer``), the cluster's
one load of a cold model (waited for here, then served where it was granted), or the
cluster's queue. ``MODEL@GATEWAY`` names one gateway's copy (``@`` is in no model's
name): at any front door, relayed as it was sent (the body still names it; that gateway
takes its own name off); a gateway no live one is called is a 404, one that is live but
takes no request now (its worker draining or offline, or down just now) a 503 saying
so. A host that could not be reached takes nothing of the request: the next
decision leaves it out, once per host."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from ..base.metrics import GatewayMetrics
from ..base.scopes import CancelScope
from ..cluster.cluster import Cluster
from ..cluster.routing import Kind, Route
from ..servers.lease import Lease
from ..servers.model import ModelServer, Refused
from .answers import STOPPING, AfterHead, Send, send_error, send_refused
from .relay import Relaying, to_peer
from .request import Request
from .waits import ClusterLoad, Wait, watching

__all__ = ["FrontDoorApp", "front_door", "load_priority"]

log = logging.getLogger("gpu_arbiter.gateway")

REPORTED_WAIT_S = 10.0
"""How long a load granted on a host whose gateway this view does not show yet waits for
it (a new leader learns the gateways from their next reports, every 5 s), before a 503."""


class FrontDoorApp(Relaying, Protocol):
    """What the front door reads of the gateway (``app.GatewayApp``)."""

    models: Mapping[str, ModelServer]
    metrics: GatewayMetrics
    waits: set[CancelScope]


async def front_door(app: FrontDoorApp, request: Request, name: str) -> bool | None:
    """Routes a request that came to this gateway as the cluster's front door: None
    when it was answered here (forwarded, refused), else this gateway's own replicas
    serve it, and whether the head of its event stream went out already (it waited
    for the cluster's load)."""
    cluster = app.cluster
    assert cluster is not None
    model, at, host = name.rpartition("@")
    if not at:
        model, host = name, ""
    if not host and not cluster.knows(model):
        return False  # unknown anywhere: the local path names the models it knows
    model_id = cluster.model_id(model)
    head_sent = False
    refused: list[str] = []  # the hosts that refused a connection, as a caller reads them
    for _ in range(len(cluster.peers) + 1):
        send = AfterHead(request.send) if head_sent else request.send
        decision = (
            _named(cluster, model, host) if host else cluster.decide(model, request.json_body)
        )
        app.metrics.routes.labels(model_id, str(decision.kind)).inc()
        cluster.record(model_id, decision)
        if decision.kind is Kind.LOCAL:
            return head_sent
        if decision.kind is Kind.NONE:
            status, code = _named_status(decision) if host else (503, "unavailable")
            await send_error(send, status, decision.why, code, 1.0 if status == 503 else None)
            return None
        lease_id, gateway, where = None, decision.gateway, "its host"
        if decision.kind is Kind.LOAD:
            log.info("route: %s", decision.why)
            placed = await _load(app, request, send, model_id)
            if placed is None:
                return None
            lease, head_sent = placed[0], head_sent or placed[1]
            send = AfterHead(request.send) if head_sent else request.send
            if lease.worker == cluster.worker and model_id in app.models:
                await cluster.adopt(app.models[model_id], lease.id)
                return head_sent
            peer = await cluster.peer_on_within(str(lease.worker), REPORTED_WAIT_S)
            lease_id, gateway = lease.id, None if peer is None else peer.name
            where = f"its host {lease.worker}"
        else:
            log.debug("route: %s", decision.why)
        if gateway is None:
            await send_error(send, 503, f"{model}: {where} is not known here", "unavailable", 1.0)
            return None
        if await to_peer(app, request, send, gateway, model_id, lease_id) is not None:
            return None
        refused.append(cluster.host_name(gateway))
        app.metrics.routes.labels(model_id, "retried").inc()
    send = AfterHead(request.send) if head_sent else request.send
    why = f"{', '.join(refused)} refused a connection; " if refused else ""
    await send_error(send, 503, f"{model}: {why}no host took the request", "unavailable", 1.0)
    return None


async def _load(
    app: FrontDoorApp, request: Request, send: Send, model: str
) -> tuple[Lease, bool] | None:
    """Waits for the cluster's load of ``model`` (a streaming caller sees why, as for
    a replica: :class:`.waits.Wait`); the granted lease and whether the head of its
    event stream went out, or None when the request was answered (refused, its client
    gone)."""
    cluster = app.cluster
    assert cluster is not None
    wanted = load_priority(_model_priority(app, cluster, model), request.priority)
    wait = Wait(ClusterLoad(cluster, model), send, request.json_body)
    cancel = CancelScope()
    app.waits.add(cancel)
    try:
        async with watching(request, cancel), cancel:
            wait.began()
            return await cluster.load(model, wanted), wait.head_sent
        if cancel.reason == STOPPING:
            await send_error(wait.sender(), 503, f"{STOPPING}: no new requests", "unavailable", 1.0)
        return None
    except Refused as refused:
        await send_refused(wait.sender(), refused, wait.waited_s())
        return None
    finally:
        app.waits.discard(cancel)
        await wait.end()


def load_priority(model: int, caller: int | None) -> int:
    """The priority the cluster's load is asked at: the model's own, or the caller's
    (its key's, ``x-arbiter-priority``) if higher, as a replica's lease is on one
    gateway (``ModelServer.lease_priority``): a batch key never lowers it, so never makes
    it preemptible."""
    return model if caller is None else max(model, caller)


def _named(cluster: Cluster, model: str, host: str) -> Route:
    """``MODEL@GATEWAY``: that gateway's copy, or none (its why says whether the gateway
    is live, serves the model, and takes requests now: :func:`_named_status`)."""
    named = f"{model}@{host}"
    if host == cluster.name:
        if model not in cluster.routes:
            return Route(Kind.NONE, None, f"{named}: gateway {host} does not serve {model!r}")
        if cluster.own_why:
            why = f"{named}: gateway {host} takes no new request: {cluster.own_why}"
            return Route(Kind.NONE, host, why)
        return Route(Kind.LOCAL, host, f"{named}: named")
    peer = cluster.peers.get(host)
    if peer is None:
        return Route(Kind.NONE, None, f"{named}: no live gateway {host!r} in this cluster")
    if peer.model(model) is None:
        return Route(Kind.NONE, None, f"{named}: gateway {host} does not serve {model!r}")
    why_not = cluster.why_not(host)
    if why_not:
        return Route(Kind.NONE, host, f"{named}: gateway {host} takes no new request: {why_not}")
    return Route(Kind.PEER, host, f"{named}: named")


def _named_status(decision: Route) -> tuple[int, str]:
    """A named copy that is not to be had: 404 when no live gateway of that name serves
    the model, 503 when it does but takes no request now (draining, offline, down)."""
    return (503, "unavailable") if decision.gateway else (404, "model_not_found")


def _model_priority(app: FrontDoorApp, cluster: Cluster, model: str) -> int:
    """The model's own priority: this gateway's config, else the peers' reports."""
    if model in app.models:
        return app.models[model].config.priority
    for peer in cluster.peers.values():
        found = peer.model(model)
        if found is not None:
            return int(found.get("priority") or 500)
    return 500
