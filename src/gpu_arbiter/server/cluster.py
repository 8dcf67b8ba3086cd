"""The cluster's front doors: what a gateway needs to serve a request on any host.

    GET  /v1/gateways/{name}/cluster   every live gateway, its worker's state, its
                                       public key (that its relays are checked with)
                                       and its models' routing figures, the cluster's
                                       loads still queued; a long-poll
    POST /v1/gateways/{name}/loads     a model's cold load, for the whole cluster
    DELETE /v1/gateways/{name}/loads   a front door waits no more for a model's load

A gateway asks for the cluster view with the signature of the view it has (``after``)
and is answered when the view differs: a gateway came or left, turned stale, its worker
began draining or went offline, or a model's state moved. Its routing is then its own
(``gateway/routing.py``), on that view, without asking here per request.

A cold load is one lease request for the cluster, not for the request that caused it:
its constraints allow every worker whose live gateway declares the model (the core's own
stages choose the worker and the GPU: measured free memory, the load gate, binpack or
spread, reclaim, preemption), and it prefers the worker where the model last ran (its
file is in the page cache). Every front door that asks while the model's load is pending
or loading joins it instead of asking again, so a burst anywhere starts one server. The
front doors that wait long-poll it here, which is its presence: a caller that hangs up
does not cancel it while others wait, and one nobody waits for any more ends as any
abandoned request does. A front door whose last waiter went away withdraws (the
DELETE): a load no other front door asked for ends at once, cancelled while pending,
given back while it loads (:class:`LoadAskers`). Once granted, the gateway token bound
to the lease's worker holds it (renews, readies, releases it:
:meth:`GatewayRegistry.holds_lease`), whoever asked for it.

Every route here is a gateway's (a gateway token, which owns the name it asks as) or an
admin's: a client or worker token is refused (:func:`as_gateway`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from pydantic import Field, StrictInt, StrictStr

from ..controller import Controller, PendingView, ServiceUnavailable
from ..core import (
    Constraints,
    LeaseState,
    NotFound,
    Unschedulable,
    WorkerStatus,
    validate_worker_name,
)
from ..core import Request as CoreRequest
from ..store import LeaseRecord
from . import routes
from . import schemas as s
from .auth import Principal
from .gateways import CLUSTER_MODEL, GatewayRegistry, Report, as_gateway
from .limits import Slots
from .responses import FiniteJSONResponse

__all__ = ["LoadAskers", "adoptable", "router"]

MAX_WAIT_S = 60.0
RECHECK_S = 1.0
"""How often a cluster long-poll looks again for what no report says: a report turning
stale, a worker draining or going offline, a pending load's reason moving."""
WORDS_S = 5.0
"""A pending load's long-poll answers when only the words of its reason moved (a time
counting down, memory figures) once it has waited this long: its callers' times stay
fresh, and a front door asks at most this often for them."""
ROUTED = (
    "id", "aliases", "state", "in_flight", "queued", "max_parallel", "vram_mb", "gpus",
    "priority",
)  # fmt: skip
"""A model's fields in the cluster view (besides its replicas and when it last ran)."""

_LIVE = (LeaseState.PENDING, LeaseState.LOADING, LeaseState.ACTIVE)
_WITHDRAWN = (LeaseState.PENDING, LeaseState.LOADING)
"""A load no front door waits for any more ends in these states (cancelled, or given
back before it serves); one serving is the model's replica, kept."""


class LoadAskers:
    """The front doors that asked for each cluster load (by model, then lease id), in
    memory like the gateways' reports: a load is one while some asked for it and has
    not withdrawn. After a restart none is known: a load then ends as any abandoned
    request does (I8), never by a withdrawal."""

    def __init__(self) -> None:
        self._asked: dict[str, dict[str, set[str]]] = {}

    def asked(self, model: str, lease_id: str, gateway: str, live: Sequence[str]) -> None:
        """``gateway`` asked for ``lease_id``; the model's loads not ``live`` are forgotten."""
        loads = self._asked.setdefault(model, {})
        for gone in [i for i in loads if i not in live]:
            del loads[gone]
        loads.setdefault(lease_id, set()).add(gateway)

    def withdraw(self, model: str, lease_id: str, gateway: str) -> bool | None:
        """``gateway`` waits no more for ``lease_id``: whether another front door still
        does, None when ``gateway`` had not asked for it."""
        askers = self._asked.get(model, {}).get(lease_id)
        if askers is None or gateway not in askers:
            return None
        askers.discard(gateway)
        return bool(askers)

    def asking(self) -> list[tuple[str, str, list[str]]]:
        """Each load some front door still asks for: (model, lease id, its gateways)."""
        return [
            (model, lease_id, sorted(gateways))
            for model, loads in sorted(self._asked.items())
            for lease_id, gateways in loads.items()
            if gateways
        ]


GatewayName = Annotated[str, Path(min_length=1, max_length=64)]
router = APIRouter(prefix="/v1", responses=routes.ERRORS, route_class=s.StrictJsonRoute)


class LoadIn(s._In):
    """A model's cold load for the cluster: the lease's size, count and place are taken
    from the gateways that declare the model; the asker says how important it is and how
    long the lease may wait."""

    model: s.Short
    priority: (
        Annotated[StrictInt, Field(ge=0, le=1000)] | Annotated[StrictStr, Field(max_length=16)]
    ) = "normal"
    replicas: Annotated[StrictInt, Field(ge=1, le=64)] = 1
    ttl_s: Annotated[s.Seconds, Field(gt=0, le=86400)] = 30.0
    max_wait_s: Annotated[s.Seconds, Field(ge=0, le=366 * 86400)] | None = None
    load_timeout_s: Annotated[s.Seconds, Field(gt=0, le=86400)] = 300.0
    unreachable: Annotated[list[s.Short], Field(max_length=64)] = Field(default_factory=list)
    """Gateways the asking front door cannot reach now (a refused connection, no answer
    to its liveness check): a load there is not the model's load for it, and no new one
    is placed there."""


def _context(request: Request, name: str) -> tuple[Controller, Principal, GatewayRegistry, str]:
    ctl, who = routes.context(request)
    routes.leader_only(ctl)
    registry: GatewayRegistry = request.app.state.gateways
    return ctl, who, registry, validate_worker_name(name, "name")


@router.get("/gateways/{name}/cluster", summary="The cluster as a front door routes in it")
async def cluster_view(
    name: GatewayName,
    request: Request,
    after: Annotated[str, Query(max_length=64)] = "",
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)] = 0.0,
) -> FiniteJSONResponse:
    """Answers at once when the view's ``signature`` differs from ``after``, else as
    soon as it does, or after ``wait`` seconds (at most 60) as it is. Only the token that
    reports gateway ``name`` (or an admin)."""
    ctl, who, registry, name = _context(request, name)
    as_gateway(who, "read the cluster's view")
    registry.owned(name, who, "route for")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    long_polls: Slots = request.app.state.long_polls
    askers: LoadAskers = request.app.state.load_askers
    with long_polls.hold(who.id):
        while True:
            view = _view(ctl, registry, askers)
            left = deadline - loop.time()
            if view["signature"] != after or left <= 0:
                break
            await registry.moved(min(left, RECHECK_S))
    return FiniteJSONResponse(view)


def _view(ctl: Controller, registry: GatewayRegistry, askers: LoadAskers) -> dict[str, Any]:
    gateways = [_gateway(ctl, n, report, silent_s) for n, report, silent_s in registry.known()]
    loads = _queued(ctl, askers)
    signed = json.dumps(
        [[_signed(g) for g in gateways], [(q["model"], q["lease"]) for q in loads]],
        sort_keys=True,
    ).encode()
    return {
        "signature": hashlib.sha256(signed).hexdigest()[:32],
        "gateways": gateways,
        "loads": loads,
    }


def _queued(ctl: Controller, askers: LoadAskers) -> list[dict[str, Any]]:
    """The cluster's loads still pending that a front door asks for, for every front door
    to list its model ``queued``: the model, the lease, the gateways that asked, its
    position and reason as the queue shows them now (the view changes when a load comes
    or goes, not when only its reason does: its askers follow that, ``cluster_load``)."""
    found = []
    for model, lease_id, gateways in askers.asking():
        pending = ctl.leases.pending_view(lease_id)
        if pending is None:
            continue
        found.append(
            {"model": model, "lease": lease_id, "asked_by": gateways,
             "position": pending.position, "reason": pending.reason.as_dict()}
        )  # fmt: skip
    return found


def _gateway(
    ctl: Controller, name: str, report: Report, silent_s: float | None = None
) -> dict[str, Any]:
    """One gateway as the front doors route among them; a stale one (``silent_s`` since
    its last report) stays in the view, not routable, until it is forgotten: the front
    doors still know its models are declared there (a model whose only host is lost is
    then a 503 naming it, not a model only the door declares, nor an unknown one)."""
    worker_state = None
    if report.worker is not None:
        try:
            worker_state = str(ctl.workers.get(report.worker).status)
        except NotFound:
            worker_state = "unknown"
    routable = worker_state == str(WorkerStatus.ONLINE) and silent_s is None
    return {
        "name": name,
        "url": report.url,
        "worker": report.worker,
        "worker_state": worker_state,
        "routable": routable,
        "stale": silent_s is not None,
        "reported_at": round(time.time() - (silent_s or 0.0), 3),
        "public_key": report.public_key,
        "models": [_model(m) for m in report.models],
        "files": [dict(f) for f in report.files],  # the model files peers may copy from it
    }


def _model(model: Mapping[str, Any]) -> dict[str, Any]:
    found = {key: model[key] for key in ROUTED if key in model}
    found["last_used_ago_s"] = model.get("last_used_ago_s")
    found["replicas"] = [
        {k: r.get(k) for k in ("state", "in_flight", "lease", "gpus")}
        for r in model.get("replicas") or ()
        if isinstance(r, Mapping)
    ]
    return found


def _signed(gateway: Mapping[str, Any]) -> dict[str, Any]:
    """What a routing decision turns on, without the figures every report moves."""
    models = [
        {
            "id": m.get("id"),
            "aliases": m.get("aliases"),
            "state": m.get("state"),
            "replicas": [(r.get("state"), r.get("lease")) for r in m["replicas"]],
        }
        for m in gateway["models"]
    ]
    moving = ("models", "reported_at")
    return {**{k: v for k, v in gateway.items() if k not in moving}, "models": models}


# ---------------------------------------------------------------- loads


@router.post("/gateways/{name}/loads", summary="A model's cold load for the cluster; long-poll")
async def cluster_load(
    name: GatewayName,
    body: LoadIn,
    request: Request,
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)] = 0.0,
    after: Annotated[str, Query(max_length=64)] = "",
) -> FiniteJSONResponse:
    """The model's load for the cluster: the one pending or loading on a routable host
    (joined), else a new lease request over every worker whose live gateway declares the
    model (and the front door can reach: ``unreachable``), preferring where it last ran;
    with ``replicas`` above 1, a new one while fewer are held or coming there. A lease
    on a host that is not routable (offline, draining, its gateway stale or unreachable)
    keeps its memory but is not joined. Answers once it is not pending, or after
    ``wait`` seconds (at most 60), with the lease, ``joined`` and each candidate
    worker's most free MiB on one GPU. A pending one is answered at once when its reason's
    ``signature`` differs from ``after`` (the one the front door last read), else as soon
    as its reason moves (:func:`_pending_moves`), for the front door to tell its callers.
    404 when no routable gateway declares the model."""
    ctl, who, registry, name = _context(request, name)
    as_gateway(who, "ask for the cluster's loads")
    registry.owned(name, who, "ask loads for")
    unreachable = {validate_worker_name(g, "unreachable") for g in body.unreachable}
    hosts = _hosts(ctl, registry, body.model, unreachable)
    if not hosts:
        raise _nowhere(ctl, registry, body.model, unreachable)
    live = [r for r in _live_loads(ctl, body.model) if r.worker is None or r.worker in hosts]
    coming = [r for r in live if r.state in (LeaseState.PENDING, LeaseState.LOADING)]
    joined = bool(coming) or len(live) >= body.replicas
    if joined:
        record = (coming or live)[-1]
    else:
        place = max(len(live) + 1, body.replicas)
        try:
            holding = _holding(registry, hosts)
            submitted = ctl.leases.submit(who.id, _request(ctl, body, hosts, place, holding))
        except Unschedulable as error:
            raise _too_small(ctl, registry, body.model, unreachable, hosts, error) from None
        record = submitted.record
    askers: LoadAskers = request.app.state.load_askers
    askers.asked(body.model, record.id, name, [r.id for r in live] + [record.id])
    if record.state is LeaseState.PENDING and wait > 0:
        long_polls: Slots = request.app.state.long_polls
        with long_polls.hold(who.id), ctl.leases.watching(record.id):
            waited = _pending_moves(ctl, record.id, wait, after)
            record = await routes.unless_gone(request, waited) or ctl.leases.get(record.id)
    pending = ctl.leases.pending_view(record.id)
    answer = {**s.lease_out(record, pending), "joined": joined, "free_mb": _free(ctl, hosts)}
    return FiniteJSONResponse(
        {**answer, "signature": "" if pending is None else _signed_reason(pending)}
    )


@router.delete("/gateways/{name}/loads", summary="A front door waits no more for a model's load")
async def withdraw_load(
    name: GatewayName,
    request: Request,
    model: Annotated[str, Query(min_length=1, max_length=64)],
) -> FiniteJSONResponse:
    """Gateway ``name``'s front door waits no more for ``model``'s cluster load (its last
    waiter went away): each live load of the model it asked for ends at once if no other
    front door asked for it too and this token made its request, cancelled while
    pending, released while it loads (nothing serves under it yet); one serving, one
    another front door waits for, or one it only joined, is kept. Answers with the leases
    ``ended`` and ``kept``; idempotent."""
    ctl, who, registry, name = _context(request, name)
    as_gateway(who, "withdraw the cluster's loads")
    registry.owned(name, who, "withdraw loads for")
    askers: LoadAskers = request.app.state.load_askers
    ended: list[str] = []
    kept: list[str] = []
    for record in _live_loads(ctl, model):
        others = askers.withdraw(model, record.id, name)
        if others is None:
            continue
        if others or record.state not in _WITHDRAWN or not _asked_first(who, record):
            kept.append(record.id)
        else:
            ctl.leases.release(record.id)
            ended.append(record.id)
    return FiniteJSONResponse({"model": model, "ended": ended, "kept": kept})


async def _pending_moves(ctl: Controller, lease_id: str, wait_s: float, after: str) -> LeaseRecord:
    """The load at once when its reason's signature (:func:`_signed_reason`) is not
    ``after``, else once it is not pending or its signature moved (the lease or request in
    its way, the GPU nearest to taking it, its position), looked at every
    :data:`RECHECK_S` (a reason is not stored: the leases around it move it), or once
    only its words did (a time counting down, the memory figures) after
    :data:`WORDS_S`; as it is after ``wait_s``."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    said = ctl.leases.pending_view(lease_id)
    if said is None or _signed_reason(said) != after:
        return ctl.leases.get(lease_id)
    while True:
        left = began + wait_s - loop.time()
        record = await ctl.events.wait_lease(lease_id, LeaseState.PENDING, min(left, RECHECK_S))
        now = ctl.leases.pending_view(lease_id)
        if record.state is not LeaseState.PENDING or now is None or left <= RECHECK_S:
            return record
        if _signed_reason(now) != after:
            return record
        if now.reason.message != said.reason.message and loop.time() - began >= WORDS_S:
            return record


def _signed_reason(view: PendingView) -> str:
    """What a pending load waits for, without the words and figures that move by
    themselves, as a signature: its position, the reason's code, the GPUs nominated for
    it, what is in its way (each lease or request, its state and when it gives way) and
    each outcome's GPU nearest to taking it."""
    reason = view.reason
    blockers = (reason.blocker, *reason.blockers) if reason.blocker else reason.blockers
    gist = (
        view.position, str(reason.code), [str(g) for g in reason.nominated], reason.blocked_by,
        [(b.kind, b.id, b.state, b.until, b.rule) for b in blockers],
        [(str(v.gpu), v.code) for v in reason.gpus],
    )  # fmt: skip
    return hashlib.sha256(json.dumps(gist).encode()).hexdigest()[:32]


def _asked_first(who: Principal, record: LeaseRecord) -> bool:
    """Whether ``who`` made the load's lease request (or is an admin): only then may its
    withdrawal end it; a front door that joined a load only stops waiting for it (after
    a restart, when no asker is known, it would otherwise end another door's load)."""
    return who.is_admin or record.owner == who.id


def _hosts(
    ctl: Controller, registry: GatewayRegistry, model: str, unreachable: set[str]
) -> dict[str, Mapping[str, Any]]:
    """The online workers whose live gateway, not ``unreachable``, declares ``model`` (by
    name or alias): the model as that gateway reports it, by worker. A lease of the model
    held anywhere else (its worker offline or draining, its gateway stale, gone or out of
    the front door's reach) still holds its memory (I4) but is not the model's load: a
    request for it is not joined to it, and a new one is placed among these."""
    found: dict[str, Mapping[str, Any]] = {}
    for name, report in registry.live():
        if report.worker is None or name in unreachable:
            continue
        try:
            if ctl.workers.get(report.worker).status is not WorkerStatus.ONLINE:
                continue
        except NotFound:
            continue
        for reported in report.models:
            if reported.get("id") == model or model in (reported.get("aliases") or ()):
                found[report.worker] = reported
    return found


def _nowhere(
    ctl: Controller, registry: GatewayRegistry, model: str, unreachable: set[str]
) -> NotFound | ServiceUnavailable:
    """Why no host may take ``model`` now: 404 when no gateway this controller knows
    declares it; else 503 naming each host that does and what keeps it out (its worker
    offline since its last heartbeat, draining, its gateway stale since its last report or
    out of the front door's reach), for the caller to retry after."""
    declaring = registry.declaring(model)
    if not declaring:
        return NotFound(f"no gateway declares model {model!r}", model=model)
    why = [_out(ctl, name, report, silent_s, unreachable) for name, report, silent_s in declaring]
    hosts = "its only host" if len(why) == 1 else "none of its hosts can take it:"
    return ServiceUnavailable(
        f"{model}: {hosts} {'; '.join(why)}", model=model, hosts="; ".join(why)
    )


def _too_small(
    ctl: Controller,
    registry: GatewayRegistry,
    model: str,
    unreachable: set[str],
    hosts: Mapping[str, Any],
    error: Unschedulable,
) -> Unschedulable | ServiceUnavailable:
    """A load no routable host can ever hold: ``error`` as it is (422) when every host
    that declares the model is routable; else 503 naming what keeps the others out (the
    one that could hold it may be back soon), for the caller to retry after."""
    out = [
        _out(ctl, name, report, silent_s, unreachable)
        for name, report, silent_s in registry.declaring(model)
        if report.worker not in hosts
    ]
    if not out:
        return error
    here = ", ".join(sorted(hosts))
    return ServiceUnavailable(
        f"{model}: {here} cannot hold it ({error}); {'; '.join(out)}",
        model=model, hosts="; ".join(out),
    )  # fmt: skip


def _out(
    ctl: Controller, name: str, report: Report, silent_s: float | None, unreachable: set[str]
) -> str:
    """What keeps one gateway's host out of a model's routing, in words."""
    host = report.worker or name
    if report.worker is None:
        return f"{name} runs beside no worker"
    try:
        worker = ctl.workers.get(report.worker)
    except NotFound:
        return f"{host} is not a registered worker"
    seen = ctl.workers.last_seen(report.worker)
    if worker.status is WorkerStatus.OFFLINE and seen is not None:
        return f"{host} is offline since {_clock(seen)}"  # the whole host, first
    if worker.status is not WorkerStatus.ONLINE:
        return f"{host} is {worker.status}"
    if name in unreachable:
        return f"{host} is out of the front door's reach (its gateway {name} does not answer)"
    if silent_s is not None:
        return f"{host}'s gateway {name} has not reported since {_clock(time.time() - silent_s)}"
    return f"{host} is {worker.status}"


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(at))


def _live_loads(ctl: Controller, model: str) -> list[LeaseRecord]:
    """The model's cluster leases pending, loading or serving, oldest first (one being
    revoked is on its way out: a new one is asked for beside it)."""
    return [
        r
        for r in ctl.leases.all()
        if r.state in _LIVE and r.request.metadata.get(CLUSTER_MODEL) == model
    ]


def _request(
    ctl: Controller,
    body: LoadIn,
    hosts: Mapping[str, Mapping[str, Any]],
    replica: int,
    holding: Sequence[str] = (),
) -> CoreRequest:
    """One request for the cluster: the largest size any host declares (never less than
    one of them needs), every host's worker allowed, the most recent one preferred (for
    the first replica only: another is placed where the arbiter finds room), and the
    hosts whose gateway holds the model's file (``holding``: no copy before its load);
    ``replica``: its place among the model's replicas (one beyond the model's
    ``replicas.min`` is marked idle whenever it has nothing in flight)."""
    sizes = [int(m.get("vram_mb") or 0) for m in hosts.values()]
    gpus = max(int(m.get("gpus") or 1) for m in hosts.values())
    recent = _last_ran(hosts) if replica == 1 else []
    preferred = sorted({*recent, *holding})
    constraints = Constraints.build(workers=sorted(hosts), prefer_workers=preferred)
    return CoreRequest.build(
        ctl.leases.new_id(),
        vram_mb=max(1, *sizes),
        gpus=gpus,
        priority=body.priority,
        constraints=constraints,
        holder=f"cluster model {body.model}",
        metadata={CLUSTER_MODEL: body.model, "model": body.model, "replica": replica},
        ttl_s=body.ttl_s,
        max_wait_s=body.max_wait_s,
        load_timeout_s=body.load_timeout_s,
    )


def _holding(registry: GatewayRegistry, hosts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The workers among ``hosts`` whose gateway reports holding the model's file (the
    model's ``file``, by name, among the gateway's ``files``)."""
    found = set()
    for _, report in registry.live():
        model = hosts.get(report.worker or "")
        name = None if model is None else model.get("file")
        if name and any(f.get("name") == name for f in report.files):
            found.add(str(report.worker))
    return sorted(found)


def _last_ran(hosts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The worker where the model was used last, if any has used it since its start."""
    ran = [
        (float(m["last_used_ago_s"]), worker)
        for worker, m in hosts.items()
        if isinstance(m.get("last_used_ago_s"), int | float)
    ]
    return [min(ran)[1]] if ran else []


def adoptable(ctl: Controller, worker: str) -> list[tuple[str, str]]:
    """The cluster's leases granted on ``worker`` and still loading: (model, lease id),
    for the gateway beside it to adopt if it does not hold them yet
    (``GatewayRegistry.commands``)."""
    return [
        (str(r.request.metadata[CLUSTER_MODEL]), r.id)
        for r in ctl.leases.all(state=LeaseState.LOADING, worker=worker)
        if CLUSTER_MODEL in r.request.metadata
    ]


def _free(ctl: Controller, workers: Sequence[str] | Mapping[str, Any]) -> dict[str, int]:
    """Each worker's most free MiB on one GPU, as the arbiter counts it."""
    return {
        worker: max((f.free_mb for f in ctl.workers.gpu_figures(worker)), default=0)
        for worker in workers
    }
