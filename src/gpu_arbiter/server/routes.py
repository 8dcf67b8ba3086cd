"""The HTTP routes under ``/v1``: arguments in, one controller call, JSON out.

Who may call what (see :mod:`.auth`): reads are open to every role; creating a
lease to admin, client and gateway (a gateway's only on its own worker);
renew/ready/idle/busy/shrink/release to admin and the client or gateway that created
the lease, and for a lease asked for the cluster, to the gateway token bound to the
worker it was granted on (its asker only while it is pending); register and heartbeat
to admin and the worker the token is bound to (and the reports of that worker's
operations); revoke, drain, cancel-drain, remove, update, pause and resume to admin
only. A gateway reports itself (admin, or a gateway token beside its own worker; the
first reporter's token owns the name), takes its commands and says goodbye as that
token or an admin; an admin queues commands and forgets gateways (see :mod:`.gateways`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Path, Query, Request

from ..controller import Controller, GpuProbeReport, NotLeader
from ..core import Constraints, Gpu, LeaseState, validate_worker_name
from ..store import LeaseRecord
from . import schemas as s
from .auth import Forbidden, Principal, Unauthorized, refuse
from .config import is_loopback
from .errors import error_response
from .events import EventFeed, EventStreamResponse, event_stream
from .gateways import CLUSTER_MODEL, REPORT_S, GatewayRegistry, Report, as_gateway
from .history import History
from .limits import Slots
from .responses import FiniteJSONResponse

__all__ = ["router"]

LeaseId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$")]
WorkerName = Annotated[str, Path(min_length=1, max_length=64)]
GatewayName = Annotated[str, Path(min_length=1, max_length=64)]
ModelName = Annotated[str, Path(min_length=1, max_length=64)]
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": s.ErrorOut} for code in (400, 401, 403, 404, 409, 413, 422, 429, 503)
}
ERRORS[400]["description"] = "The body is not valid JSON (malformed_json)"
ERRORS[401]["headers"] = {
    "WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}
}
ERRORS[429]["description"] = (
    "A limit was reached; details name it (limit, value, current): retry later"
)
ERRORS[429]["headers"] = {
    "Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}
}
_REPLAYED = {
    "Idempotent-Replayed": {
        "description": "true when the answer is for an earlier request with the same "
        "idempotency_key (its current state)",
        "schema": {"type": "string", "enum": ["true"]},
        "required": False,
    }
}
MAX_WAIT_S = 60.0

router = APIRouter(prefix="/v1", responses=ERRORS, route_class=s.StrictJsonRoute)


def context(request: Request) -> tuple[Controller, Principal]:
    """The controller, and who is calling (401 without a valid token). A plain call, not a
    dependency: it runs on every request, and dependencies cost more."""
    controller: Controller = request.app.state.controller
    principal: Principal = request.app.state.auth.authenticate(request.headers.get("authorization"))
    return controller, principal


def _admin(who: Principal) -> None:
    if not who.is_admin:
        raise Forbidden(f"only an admin may do this (your role: {who.role})")


def _lease_access(request: Request, who: Principal, record: LeaseRecord) -> None:
    """An admin, or the lease's holder (:func:`holds`)."""
    if who.is_admin or holds(who, record):
        return
    if CLUSTER_MODEL in record.request.metadata:
        on = record.worker or "no worker yet"
        raise refuse(who, f"touch lease {record.id}, the cluster's, granted on {on}")
    raise Forbidden(f"lease {record.id} belongs to another holder (your role: {who.role})")


def holds(who: Principal, record: LeaseRecord) -> bool:
    """Whether ``who`` holds the lease (renews, readies, idles, shrinks, releases it, and
    its read takes it up). A lease asked for the cluster is held by the gateway token
    bound to the worker it was granted on, whoever asked for it; its asker (a front door
    on another host) holds it only while it is pending, to withdraw it. Any other lease
    by the client or gateway token (or admin) that asked for it."""
    if CLUSTER_MODEL in record.request.metadata:
        if GatewayRegistry.holds_lease(who, record.worker):
            return True
        return record.owner == who.id and (who.is_admin or record.state is LeaseState.PENDING)
    return record.owner == who.id and who.role in ("admin", "client", "gateway")


def _on_worker(constraints: Constraints, worker: str | None) -> bool:
    """Whether every GPU a request of ``constraints`` may be granted is on ``worker``."""
    if worker is None:
        return False
    if constraints.worker is not None:
        return constraints.worker == worker
    if constraints.gpu_ids:
        return all(gpu.worker == worker for gpu in constraints.gpu_ids)
    return constraints.workers == (worker,)


def _as_worker(who: Principal, name: str) -> None:
    if who.is_admin or (who.role == "worker" and who.worker == name):
        return
    raise Forbidden(f"this token may not act as worker {name} (your role: {who.role})")


def _lease_json(ctl: Controller, record: LeaseRecord) -> FiniteJSONResponse:
    """A lease as it is after a verb or a read; a pending one with its place and reason."""
    return FiniteJSONResponse(s.lease_out(record, ctl.leases.pending_view(record.id)))


def _worker_json(ctl: Controller, name: str, status: int = 200) -> FiniteJSONResponse:
    record = ctl.workers.get(name)
    body = s.worker_out(
        record,
        ctl.workers.gpu_figures(name),
        ctl.workers.last_seen(name),
        ctl.updates.running(name),
    )
    return FiniteJSONResponse(body, status_code=status)


# ---------------------------------------------------------------- leases


@router.post(
    "/leases",
    response_model=s.LeaseOut,
    status_code=201,
    summary="Ask for a lease: 201 granted, 202 pending, 409 ended without a grant",
    responses={
        201: {
            "description": "Granted: the lease is held (loading, active; or revoking, on a replay)",
            "headers": _REPLAYED,
        },
        202: {
            "model": s.LeaseOut,
            "description": "Pending: not granted yet; its position and reason are in the body",
            "headers": _REPLAYED,
        },
        409: {
            "model": s.ErrorOut,
            "description": "``not_granted``: the request ended before it was granted (timed out "
            "at max_wait_s, cancelled, rejected); ``lease_ended``: a replay of a lease that was "
            "granted and has ended since; ``conflict``: the idempotency key was used for a "
            "different request",
            "headers": _REPLAYED,
        },
        422: {"model": s.ErrorOut, "description": "Invalid, or no GPU could ever satisfy it"},
    },
)
async def create_lease(body: s.LeaseCreate, request: Request) -> FiniteJSONResponse:
    """201 means granted and nothing else: only then may the caller use the GPUs
    (``gpus``, ``token``). 202: still pending; follow it with ``GET /v1/leases/{id}?wait=``.
    409 ``not_granted``: it ended before it was granted (``details.state``: ``timed_out``
    when ``max_wait_s`` passed, also with ``max_wait_s: 0`` on a busy GPU). An
    idempotency key seen before answers by that lease's current state with the same
    statuses (a held lease, revoking included: 201; a lease granted then ended: 409
    ``lease_ended``), with the header ``Idempotent-Replayed: true``."""
    ctl, who = context(request)
    if who.role not in ("admin", "client", "gateway"):
        raise refuse(who, "ask for leases")
    asked = body.to_request(ctl.leases.new_id())
    if who.role == "gateway" and not _on_worker(asked.constraints, who.worker):
        raise refuse(who, f"ask for a lease beyond worker {who.worker} (set constraints.worker)")
    submitted = ctl.leases.submit(who.id, asked)
    record = submitted.record
    if record.state.is_final:
        response = _not_granted(record)
    else:
        status = 202 if record.state is LeaseState.PENDING else 201
        response = FiniteJSONResponse(s.lease_out(record, submitted.pending), status_code=status)
    if not submitted.new:
        response.headers["Idempotent-Replayed"] = "true"
    return response


def _not_granted(record: LeaseRecord) -> FiniteJSONResponse:
    """409 for a request that ended before the answer (or a replayed lease that ended)."""
    how = f"{record.state} ({record.end_reason})" if record.end_reason else str(record.state)
    details = {"lease_id": record.id, "state": str(record.state), "reason": record.end_reason}
    if record.lease is None:
        message = f"request {record.id} ended {how} before it was granted"
        return error_response(409, "not_granted", message, details)
    message = f"lease {record.id} was granted and has ended since: {how}"
    return error_response(409, "lease_ended", message, details)


@router.get(
    "/leases",
    response_model=list[s.LeaseOut],
    summary="Live and recently ended leases (pending ones with their position; the reason is "
    "in GET /v1/leases/{id} and GET /v1/queue)",
)
async def list_leases(
    request: Request,
    state: LeaseState | None = None,
    worker: Annotated[str | None, Query(max_length=64)] = None,
    holder: Annotated[str | None, Query(max_length=256)] = None,
) -> FiniteJSONResponse:
    ctl, _who = context(request)
    records = ctl.leases.all(state=state, worker=worker, holder=holder)
    pending = any(r.state is LeaseState.PENDING for r in records)
    positions = ctl.leases.positions() if pending else {}
    return FiniteJSONResponse([s.lease_out(r, position=positions.get(r.id)) for r in records])


@router.get("/leases/{lease_id}", response_model=s.LeaseOut, summary="A lease; long-poll")
async def get_lease(
    lease_id: LeaseId,
    request: Request,
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)] = 0.0,
    state: LeaseState | None = None,
) -> FiniteJSONResponse:
    """With ``wait=SECONDS``, answers as soon as the lease's state changes, or when the wait
    ends (at most 60 s). With ``state=``, as soon as it differs from that state — at once if
    it already does — so a change between two polls is never missed.

    Its asker's read is its presence: a pending request is kept while its asker
    long-polls it (and ``ttl_s`` after), and a grant its holder reads is taken up."""
    ctl, who = context(request)
    record = ctl.leases.get(lease_id)
    mine = holds(who, record)
    if wait > 0:
        long_polls: Slots = request.app.state.long_polls
        with long_polls.hold(who.id), ctl.leases.watching(lease_id):
            waited = ctl.events.wait_lease(lease_id, state or record.state, wait)
            record = await unless_gone(request, waited) or ctl.leases.get(lease_id)
    if mine:
        ctl.leases.claim(lease_id)
        record = ctl.leases.get(lease_id)
    return _lease_json(ctl, record)


async def unless_gone(request: Request, answer: Awaitable[LeaseRecord]) -> LeaseRecord | None:
    """``answer``, or None as soon as the client closed its connection (a client killed
    while it long-polls is gone at once, not at the end of its wait)."""
    waiting = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        waiting.cancel()
        await asyncio.gather(waiting, gone, return_exceptions=True)
    return None if waiting.cancelled() else waiting.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the request has no body)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post("/leases/{lease_id}/renew", response_model=s.LeaseOut, summary="Extend the TTL")
async def renew_lease(
    lease_id: LeaseId, request: Request, body: s.RenewIn | None = None
) -> FiniteJSONResponse:
    ctl, who = context(request)
    _lease_access(request, who, ctl.leases.get(lease_id))
    ttl = None if body is None or body.ttl_s is None else float(body.ttl_s)
    return _lease_json(ctl, ctl.leases.renew(lease_id, ttl))


@router.post("/leases/{lease_id}/ready", response_model=s.LeaseOut, summary="The load finished")
async def ready_lease(lease_id: LeaseId, request: Request) -> FiniteJSONResponse:
    ctl, who = context(request)
    _lease_access(request, who, ctl.leases.get(lease_id))
    return _lease_json(ctl, ctl.leases.ready(lease_id))


@router.post("/leases/{lease_id}/idle", response_model=s.LeaseOut, summary="Keep warm")
async def idle_lease(lease_id: LeaseId, request: Request) -> FiniteJSONResponse:
    ctl, who = context(request)
    _lease_access(request, who, ctl.leases.get(lease_id))
    return _lease_json(ctl, ctl.leases.set_idle(lease_id, True))


@router.post("/leases/{lease_id}/busy", response_model=s.LeaseOut, summary="Busy again")
async def busy_lease(lease_id: LeaseId, request: Request) -> FiniteJSONResponse:
    ctl, who = context(request)
    _lease_access(request, who, ctl.leases.get(lease_id))
    return _lease_json(ctl, ctl.leases.set_idle(lease_id, False))


@router.post(
    "/leases/{lease_id}/shrink",
    response_model=s.LeaseOut,
    summary="Give memory back: the lease holds less from now on",
    responses={
        409: {
            "model": s.ErrorOut,
            "description": "``conflict``: the lease is pending or has ended (``details.state``), "
            "or the size is larger than it holds (a lease grows only through a new grant)",
        },
    },
)
async def shrink_lease(lease_id: LeaseId, body: s.ShrinkIn, request: Request) -> FiniteJSONResponse:
    """The lease holds ``vram_mb`` per GPU from now on (a model server put to sleep keeps
    its process and only what it still uses). Its committed memory drops at once, but the
    memory is granted to others only once the worker's probe shows it free; to hold more
    again, ask for a new lease (``constraints.gpu_ids``: on the very same GPUs)."""
    ctl, who = context(request)
    _lease_access(request, who, ctl.leases.get(lease_id))
    return _lease_json(ctl, ctl.leases.shrink(lease_id, body.vram_mb))


@router.delete(
    "/leases/{lease_id}", response_model=s.LeaseOut, summary="Release or cancel; idempotent"
)
async def release_lease(lease_id: LeaseId, request: Request) -> FiniteJSONResponse:
    ctl, who = context(request)
    _lease_access(request, who, ctl.leases.get(lease_id))
    return _lease_json(ctl, ctl.leases.release(lease_id))


@router.post("/leases/{lease_id}/revoke", response_model=s.LeaseOut, summary="Take a lease back")
async def revoke_lease(lease_id: LeaseId, request: Request) -> FiniteJSONResponse:
    ctl, who = context(request)
    _admin(who)
    return _lease_json(ctl, ctl.leases.revoke(lease_id))


# ---------------------------------------------------------------- workers


@router.post(
    "/workers",
    response_model=s.WorkerOut,
    status_code=201,
    summary="Register a worker (201), or update a registered one (200)",
    responses={200: {"model": s.WorkerOut, "description": "Updated"}},
)
async def register_worker(body: s.WorkerRegister, request: Request) -> FiniteJSONResponse:
    ctl, who = context(request)
    name = validate_worker_name(body.name, "name")
    _as_worker(who, name)
    gpus = [Gpu(worker=name, **g.model_dump()) for g in body.gpus]
    _, new = ctl.workers.register(
        name,
        gpus,
        labels=body.labels,
        url=body.url,
        agent_version=body.agent_version,
        simulated=body.simulated,
    )
    return _worker_json(ctl, name, 201 if new else 200)


@router.post(
    "/workers/{name}/heartbeat",
    response_model=s.HeartbeatOut,
    summary="Probe snapshot; answers which of the worker's leases are held and revoking",
)
async def heartbeat(name: WorkerName, body: s.Heartbeat, request: Request) -> FiniteJSONResponse:
    ctl, who = context(request)
    name = validate_worker_name(name)
    _as_worker(who, name)
    probes = [GpuProbeReport(p.index, p.used_mb, p.per_lease()) for p in body.gpus]
    record = ctl.workers.heartbeat(
        name, probes, stopped=body.stopped, stale=body.stale, supervised=body.leases
    )
    update = ctl.updates.for_agent(name)
    return FiniteJSONResponse(s.heartbeat_out(record, ctl.workers.leases_on(name), update))


@router.get("/workers", response_model=list[s.WorkerOut], summary="Workers and their GPUs")
async def list_workers(request: Request) -> FiniteJSONResponse:
    ctl, _who = context(request)
    return FiniteJSONResponse(
        [
            s.worker_out(
                w,
                ctl.workers.gpu_figures(w.name),
                ctl.workers.last_seen(w.name),
                ctl.updates.running(w.name),
            )
            for w in ctl.workers.all()
        ]
    )


@router.get("/workers/{name}", response_model=s.WorkerOut, summary="One worker")
async def get_worker(name: WorkerName, request: Request) -> FiniteJSONResponse:
    ctl, _who = context(request)
    return _worker_json(ctl, validate_worker_name(name))


@router.post("/workers/{name}/drain", response_model=s.DrainOut, summary="Drain a worker")
async def drain_worker(
    name: WorkerName, request: Request, body: s.DrainIn | None = None
) -> FiniteJSONResponse:
    ctl, who = context(request)
    _admin(who)
    body = body or s.DrainIn()
    deadline = None if body.deadline_s is None else float(body.deadline_s)
    force = body.mode == "force"
    outcome = ctl.workers.drain(validate_worker_name(name), force=force, deadline_s=deadline)
    return FiniteJSONResponse(s.drain_out(outcome))


@router.post("/workers/{name}/cancel-drain", response_model=s.DrainOut, summary="Back online")
async def cancel_drain(name: WorkerName, request: Request) -> FiniteJSONResponse:
    ctl, who = context(request)
    _admin(who)
    return FiniteJSONResponse(s.drain_out(ctl.workers.cancel_drain(validate_worker_name(name))))


@router.delete("/workers/{name}", response_model=s.DrainOut, summary="Remove a worker")
async def remove_worker(
    name: WorkerName, request: Request, force: bool = False
) -> FiniteJSONResponse:
    ctl, who = context(request)
    _admin(who)
    return FiniteJSONResponse(
        s.drain_out(ctl.workers.remove(validate_worker_name(name), force=force))
    )


@router.post(
    "/workers/{name}/update",
    response_model=s.OperationOut,
    status_code=202,
    summary="Update a worker's agent: drain, its own update command, restart, back online",
)
async def update_worker(
    name: WorkerName, request: Request, body: s.UpdateIn | None = None
) -> FiniteJSONResponse:
    """The agent runs the update command configured on its own host (never one sent over
    the network). Follow the steps in ``GET /v1/operations/{id}``."""
    ctl, who = context(request)
    _admin(who)
    body = body or s.UpdateIn()
    operation = ctl.updates.start(
        validate_worker_name(name),
        timeout_s=float(body.timeout_s),
        drain_deadline_s=None if body.drain_deadline_s is None else float(body.drain_deadline_s),
    )
    return FiniteJSONResponse(s.operation_out(operation), status_code=202)


@router.get("/operations/{operation_id}", response_model=s.OperationOut, summary="An operation")
async def get_operation(operation_id: LeaseId, request: Request) -> FiniteJSONResponse:
    ctl, _who = context(request)
    return FiniteJSONResponse(s.operation_out(ctl.updates.get(operation_id)))


@router.post(
    "/operations/{operation_id}/report",
    response_model=s.OperationOut,
    summary="The worker's agent reports a step it carried out",
)
async def report_operation(
    operation_id: LeaseId, body: s.OperationReportIn, request: Request
) -> FiniteJSONResponse:
    ctl, who = context(request)
    _as_worker(who, ctl.updates.get(operation_id).worker)
    operation = ctl.updates.report(operation_id, body.step, body.outcome, body.detail)
    return FiniteJSONResponse(s.operation_out(operation))


# ---------------------------------------------------------------- gateways


def _gateways(request: Request) -> tuple[Controller, Principal, GatewayRegistry]:
    ctl, who = context(request)
    return ctl, who, request.app.state.gateways


def leader_only(ctl: Controller) -> None:
    """A standby knows no gateway: a gateway reports to the leader (307 there)."""
    if ctl.gate.standby:
        where = f"; the leader is {ctl.gate.leader_url}" if ctl.gate.leader_url else ""
        raise NotLeader(f"this controller is a standby{where}", leader=ctl.gate.leader_url or "")


@router.put(
    "/gateways/{name}",
    response_model=s.GatewayReportOut,
    summary="A gateway reports its models; the answer hands over the commands queued for it",
)
async def report_gateway(
    name: GatewayName, body: s.GatewayReportIn, request: Request
) -> FiniteJSONResponse:
    """Every ``report_s`` seconds and soon after a change; a gateway not reported for
    ``ttl_s`` is stale. An admin, or a gateway token naming its own worker; the first
    reporter's token owns the name, live or stale (403 for another token but an
    admin's)."""
    ctl, who, registry = _gateways(request)
    leader_only(ctl)
    as_gateway(who, "report a gateway")
    name = validate_worker_name(name, "name")
    worker = None if body.worker is None else validate_worker_name(body.worker, "worker")
    if who.role == "gateway" and worker != who.worker:
        raise refuse(
            who,
            f"report a gateway beside {f'worker {worker}' if worker else 'no worker'} "
            f"([gateway] worker = {who.worker!r})",
        )
    models = [m.model_dump(exclude_none=True) for m in body.models]
    routes = [dict(route) for route in body.routes]
    report = Report(
        url=body.url, host=body.host, worker=worker, models=models, routes=routes,
        public_key=body.public_key, conflicts=[c.model_dump() for c in body.conflicts],
        files=[f.model_dump() for f in body.files],
        left_out=[m.model_dump() for m in body.left_out],
    )  # fmt: skip
    commands = registry.report(name, who, report)
    answer = {"name": name, "ttl_s": registry.ttl_s, "report_s": REPORT_S}
    return FiniteJSONResponse({**answer, "commands": [c.as_dict() for c in commands]})


@router.get(
    "/gateways/{name}/commands",
    response_model=s.GatewayCommandsOut,
    summary="The commands queued for a gateway, handed over; long-poll",
)
async def gateway_commands(
    name: GatewayName,
    request: Request,
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)] = 0.0,
) -> FiniteJSONResponse:
    """With ``wait=SECONDS`` (at most 60), answers as soon as a command is queued, or
    with none when the wait ends. Its reporter's token or an admin."""
    ctl, who, registry = _gateways(request)
    leader_only(ctl)
    as_gateway(who, "take a gateway's commands")
    name = validate_worker_name(name, "name")
    long_polls: Slots = request.app.state.long_polls
    with long_polls.hold(who.id):
        commands = await registry.commands(name, who, wait)
    return FiniteJSONResponse({"name": name, "commands": [c.as_dict() for c in commands]})


@router.get(
    "/gateways",
    response_model=list[s.GatewayOut],
    summary="The gateways that report to this controller, with their models",
)
async def list_gateways(request: Request) -> FiniteJSONResponse:
    """Held in memory: a restarted controller knows them again at their next report
    (every few seconds); a standby knows none."""
    _ctl, _who, registry = _gateways(request)
    return FiniteJSONResponse(registry.views())


@router.post(
    "/gateways/{name}/models/{model}/{verb}",
    response_model=s.GatewayCommandQueuedOut,
    status_code=202,
    summary="Queue unload, pin or unpin of a gateway's model (the gateway takes it)",
    responses={
        404: {
            "model": s.ErrorOut,
            "description": "No such gateway, or no such model in its last report (a name "
            "or an alias)",
        },
        409: {
            "model": s.ErrorOut,
            "description": "The gateway is stale (nobody would take the command), or too "
            "many commands wait for it",
        },
    },
)
async def command_gateway(
    name: GatewayName,
    model: ModelName,
    verb: Literal["unload", "pin", "unpin"],
    request: Request,
) -> FiniteJSONResponse:
    """202: queued; the gateway takes it within a moment (it long-polls) and runs it as
    its own ``POST /admin/models/{model}/{verb}``; its next report shows the outcome."""
    ctl, who, registry = _gateways(request)
    _admin(who)
    leader_only(ctl)
    name = validate_worker_name(name, "name")
    command = registry.queue(name, model, verb)
    return FiniteJSONResponse({"gateway": name, **command.as_dict()}, status_code=202)


@router.delete(
    "/gateways/{name}",
    response_model=s.GatewayGoneOut,
    summary="A gateway's goodbye, or an admin forgets it (its name is free again)",
)
async def forget_gateway(name: GatewayName, request: Request) -> FiniteJSONResponse:
    """At a clean stop, by its own token: it leaves the list now, not once stale, and
    its name stays its token's. By an admin: the report and the name are forgotten, for
    a gateway given a new token (``gpu-arbiter gateways forget NAME``)."""
    ctl, who, registry = _gateways(request)
    leader_only(ctl)
    name = validate_worker_name(name, "name")
    registry.forget(name, who)
    return FiniteJSONResponse({"name": name, "forgotten": True})


# ---------------------------------------------------------------- arbiter


@router.post("/pause", summary="Grant nothing until resume")
async def pause(request: Request) -> FiniteJSONResponse:
    ctl, who = context(request)
    _admin(who)
    ctl.pause()
    return FiniteJSONResponse({"paused": True})


@router.post("/resume", summary="Grant again")
async def resume(request: Request) -> FiniteJSONResponse:
    ctl, who = context(request)
    _admin(who)
    ctl.resume()
    return FiniteJSONResponse({"paused": False})


@router.get("/status", summary="Counters, per-GPU figures, queue depth by priority")
async def status(request: Request) -> FiniteJSONResponse:
    ctl, _who = context(request)
    body = ctl.status()
    workers = ctl.workers
    body["gpus"] = [s.gpu_out(f) for w in workers.all() for f in workers.gpu_figures(w.name)]
    return FiniteJSONResponse(body)


@router.get("/queue", response_model=list[s.LeaseOut], summary="Pending requests, in order")
async def queue(
    request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> FiniteJSONResponse:
    """The first ``limit`` pending requests, each with its position and reason."""
    ctl, _who = context(request)
    return FiniteJSONResponse(
        [s.lease_out(record, view) for record, view in ctl.leases.queue(limit)]
    )


@router.get(
    "/events",
    summary="Server-Sent Events, resumable with Last-Event-ID",
    response_class=EventStreamResponse,
    status_code=200,
    responses={
        200: {
            "description": "id: SEQ, event: KIND, data: the event as JSON; until the client goes",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    },
)
async def events(
    request: Request,
    lease: Annotated[str | None, Query(max_length=64)] = None,
    worker: Annotated[str | None, Query(max_length=64)] = None,
    since: Annotated[int | None, Query(ge=0)] = None,
    last_event_id: Annotated[str | None, Header(max_length=32)] = None,
) -> EventStreamResponse:
    ctl, who = context(request)
    after = ctl.events.last_seq
    resume = (last_event_id or "").strip()
    if resume.isascii() and resume.isdigit():
        after = int(resume)
    elif since is not None:
        after = since
    feed: EventFeed = request.app.state.event_feed
    streams: Slots = request.app.state.streams
    streams.take(who.id)
    body = event_stream(feed, after, lease=lease, worker=worker)
    return EventStreamResponse(body, release=lambda: streams.give(who.id))


# ---------------------------------------------------------------- history and access


@router.get(
    "/history",
    response_model=s.HistoryOut,
    summary="The last hour, from the controller's memory: per GPU the committed, used and "
    "busy memory, and the queue depth by priority class",
)
async def history(
    request: Request,
    since: Annotated[float | None, Query(ge=0, allow_inf_nan=False)] = None,
) -> FiniteJSONResponse:
    """A sample every ``sample_s`` seconds; with ``since=T`` (a time of ``times``), only the
    samples after it: poll at the sample rate to follow."""
    context(request)
    kept: History = request.app.state.history
    return FiniteJSONResponse(kept.read(since))


def _role(request: Request) -> str | None:
    """The role of the request's token; None without one, or for an unknown one."""
    try:
        principal: Principal = request.app.state.auth.authenticate(
            request.headers.get("authorization")
        )
    except Unauthorized:
        return None
    return principal.role


@router.get(
    "/access",
    response_model=s.AccessOut,
    summary="How to sign in (no token needed): whether tokens are needed, the role of the "
    "token sent, and, to a caller on this machine, where the admin token is",
)
async def access(request: Request) -> FiniteJSONResponse:
    """The admin token's path is told only to a caller on the controller's own machine
    (loopback): it is no secret (the file is readable by its owner only), but it names a
    local directory, and whoever can read the file is on that machine."""
    token_file = request.app.state.admin_token_file
    client = request.client.host if request.client else ""
    local = token_file is not None and is_loopback(client)
    body = {
        "auth": request.app.state.auth.enabled,
        "role": _role(request),
        "admin_token_file": str(token_file) if local else None,
    }
    return FiniteJSONResponse(body)
