"""The shapes of the HTTP API (pydantic lives here, and only here).

Inputs are strict. A body is strict JSON (:func:`strict_json`, for every route of
:class:`StrictJsonRoute`): ``NaN``, ``Infinity``, numbers beyond a float's range and
lone surrogates, which Python's own parser lets through, are refused naming where
they are. Then: a number where a number is expected (no ``"5"`` for 5), no unknown
fields, bounded strings and collections, no control characters in names, holders,
keys and labels, and free-form ``metadata`` a small JSON object (at most 32 keys, 8
levels, 4 KiB). Outputs are built from the controller's records by the ``*_out``
functions; the models below document them in the OpenAPI schema.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Literal

from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)
from pydantic_core import PydanticCustomError
from starlette.responses import Response

from ..controller import UPDATE_TIMEOUT_S, DrainOutcome, PendingView
from ..core import (
    Constraints,
    GpuFigures,
    InvalidInput,
    Lease,
    LeaseState,
    Request,
    check_metadata,
    json_value_problem,
    priority_name,
)
from ..peer_identity import decode_key
from ..store import (
    CatalogueRevision,
    Event,
    LeaseRecord,
    OperationRecord,
    OperationStep,
    WorkerRecord,
)

# ---------------------------------------------------------------- strict JSON bodies

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class NotStrictJson(ValueError):
    """A body Python's ``json`` reads but the JSON standard does not allow."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where or 'body'}: {reason}")
        self.where = where
        self.reason = reason


def strict_json(body: bytes) -> Any:
    """``body`` parsed as strict JSON. Raises :class:`NotStrictJson` naming the first
    place that is not (a non-finite number, a lone surrogate, nesting too deep for the
    parser), or ``ValueError`` for text that is not JSON at all."""
    odd: list[str] = []

    def constant(text: str) -> float:
        odd.append(text)
        return float(text)

    def number(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            odd.append(text)
        return value

    try:
        value = json.loads(body, parse_constant=constant, parse_float=number)
    except RecursionError:
        raise NotStrictJson("", "is nested too deeply") from None
    if odd or _SURROGATE_ESCAPE.search(body):  # rare: only then walk the value
        problem = json_value_problem(value, max_depth=len(body) + 1)
        if problem is not None:
            raise NotStrictJson(*problem)
    return value


class _StrictJsonRequest(HttpRequest):
    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            self._strict_json = strict_json(await self.body())
        return self._strict_json


def _is_json(content_type: str | None) -> bool:
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


class StrictJsonRoute(APIRoute):
    """A route whose JSON body is read by :func:`strict_json`: what is not strict JSON is
    refused (422 ``invalid_input`` naming the field) before any validation or handler;
    what is not JSON at all is left to FastAPI (400 ``malformed_json``)."""

    def get_route_handler(self) -> Callable[[HttpRequest], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: HttpRequest) -> Response:
            request = _StrictJsonRequest(request.scope, request.receive)
            if _is_json(request.headers.get("content-type")):
                try:
                    await request.json()
                except NotStrictJson as error:
                    loc = ("body", error.where) if error.where else ("body",)
                    problem = {"type": "json_strict", "loc": loc, "msg": error.reason}
                    raise RequestValidationError([problem]) from None
                except ValueError:
                    pass  # not JSON at all: the handler answers 400 malformed_json
            return await handler(request)

        return strict


# ---------------------------------------------------------------- inputs


def _no_control(text: str) -> str:
    if _CONTROL.search(text):
        raise PydanticCustomError("control_character", "must not contain control characters")
    return text


def _small_json_object(value: dict[str, Any]) -> dict[str, Any]:
    try:
        return check_metadata(value)
    except InvalidInput as error:
        where = {"reason": error.reason, "field": error.field}  # the field inside metadata
        raise PydanticCustomError("json_value", "{reason}", where) from None


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
NoControl = AfterValidator(_no_control)
Text = Annotated[StrictStr, Field(max_length=256), NoControl]
Short = Annotated[StrictStr, Field(min_length=1, max_length=64), NoControl]
Seconds = Annotated[StrictFloat | StrictInt, Field(allow_inf_nan=False)]
MiB = Annotated[StrictInt, Field(ge=0, le=1 << 40)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConstraintsIn(_In):
    vendor: Short | None = None
    min_compute_capability: Annotated[StrictStr, Field(max_length=8)] | Seconds | None = None
    gpu_arch: (
        Annotated[list[Annotated[StrictStr, Field(max_length=32)]], Field(max_length=16)] | None
    ) = None
    gpu_model: Text | None = None
    worker: Short | None = None
    labels: Annotated[dict[Short, Text], Field(max_length=32)] | None = None
    gpu_ids: (
        Annotated[
            list[Annotated[StrictStr, Field(max_length=80)]], Field(min_length=1, max_length=64)
        ]
        | None
    ) = Field(
        default=None,
        description="Exact GPUs (WORKER:INDEX), all on one worker; gpus defaults to their number",
    )
    never_preempt: (
        Annotated[list[Annotated[StrictStr, Field(max_length=64)]], Field(max_length=16)] | None
    ) = Field(
        default=None,
        description="Lease ids this request never preempts nor reclaims (a lease that grows by "
        "a second one names its first)",
    )
    workers: Annotated[list[Short], Field(min_length=1, max_length=64)] | None = Field(
        default=None,
        description="Any of these workers (with worker, a GPU must satisfy both; gpu_ids must "
        "be on one of them)",
    )
    prefer_workers: Annotated[list[Short], Field(max_length=64)] | None = Field(
        default=None,
        description="Workers placed on first when the request fits on one of their GPUs now "
        "(where a model last ran); never a filter",
    )


class LeaseCreate(_In):
    """A request for VRAM (DESIGN section 4)."""

    vram_mb: (
        Annotated[StrictInt, Field(gt=0, le=1 << 40)] | Annotated[StrictStr, Field(max_length=32)]
    )
    gpus: Annotated[StrictInt, Field(ge=1, le=64)] | None = Field(
        default=None, description="GPUs on one worker; default 1, or the number of gpu_ids"
    )
    priority: (
        Annotated[StrictInt, Field(ge=0, le=1000)] | Annotated[StrictStr, Field(max_length=16)]
    ) = "normal"
    preemptible: StrictBool | None = None
    constraints: ConstraintsIn = Field(default_factory=ConstraintsIn)
    holder: Text = ""
    metadata: Annotated[
        dict[Short, Any], Field(max_length=32), AfterValidator(_small_json_object)
    ] = Field(default_factory=dict)
    ttl_s: Annotated[Seconds, Field(gt=0, le=86400)] = 30.0
    max_wait_s: Annotated[Seconds, Field(ge=0, le=366 * 86400)] | None = None
    load_timeout_s: Annotated[Seconds, Field(gt=0, le=86400)] = 300.0
    idempotency_key: Annotated[StrictStr, Field(min_length=1, max_length=256), NoControl] | None = (
        None
    )

    def to_request(self, lease_id: str) -> Request:
        """The core's request, built once, here: the core's own rules (sizes like ``8G``,
        priority names, compute capabilities, GPU ids, ``gpus`` against ``gpu_ids``)
        raise :class:`InvalidInput` naming the field, as every other refusal of bad input."""
        c = self.constraints
        constraints = Constraints.build(
            vendor=c.vendor,
            min_compute_capability=c.min_compute_capability,
            gpu_arch=c.gpu_arch,
            gpu_model=c.gpu_model,
            worker=c.worker,
            labels=c.labels,
            gpu_ids=c.gpu_ids,
            never_preempt=c.never_preempt,
            workers=c.workers,
            prefer_workers=c.prefer_workers,
        )
        return Request.build(
            lease_id,
            vram_mb=self.vram_mb,
            gpus=self.gpus,
            priority=self.priority,
            preemptible=self.preemptible,
            constraints=constraints,
            holder=self.holder,
            metadata=self.metadata,
            ttl_s=self.ttl_s,
            max_wait_s=self.max_wait_s,
            load_timeout_s=self.load_timeout_s,
            idempotency_key=self.idempotency_key,
        )


class ShrinkIn(_In):
    """What a held lease keeps per GPU from now on: no more than it holds."""

    vram_mb: (
        Annotated[StrictInt, Field(gt=0, le=1 << 40)] | Annotated[StrictStr, Field(max_length=32)]
    )


class RenewIn(_In):
    ttl_s: Annotated[Seconds, Field(gt=0, le=86400)] | None = None


class GpuIn(_In):
    index: Annotated[StrictInt, Field(ge=0, le=1023)]
    total_mb: Annotated[StrictInt, Field(gt=0, le=1 << 40)]
    uuid: Text = ""
    model: Text = ""
    vendor: Short = "nvidia"
    arch: Annotated[StrictStr, Field(max_length=32)] = ""
    headroom_mb: MiB = 256


class WorkerRegister(_In):
    name: Short
    url: Text = ""
    labels: Annotated[dict[Short, Text], Field(max_length=32)] = Field(default_factory=dict)
    agent_version: Text = ""
    simulated: StrictBool = Field(
        default=False, description="The agent's GPUs are simulated (its probe is a fake one)"
    )
    gpus: Annotated[list[GpuIn], Field(min_length=1, max_length=64)]


class ProcessIn(_In):
    """One process on a GPU; ``lease`` when the agent knows which lease it holds."""

    pid: Annotated[StrictInt, Field(ge=0, le=1 << 31)]
    used_mb: MiB
    lease: Text | None = None


class GpuProbeIn(_In):
    """A GPU's reading: total used MiB, and per lease (directly, or summed from the
    processes the agent attributes to leases; other processes count as external)."""

    index: Annotated[StrictInt, Field(ge=0, le=1023)]
    used_mb: MiB
    lease_used_mb: Annotated[dict[Text, MiB], Field(max_length=256)] | None = None
    processes: Annotated[list[ProcessIn], Field(max_length=1024)] | None = None

    def per_lease(self) -> dict[str, int] | None:
        if self.lease_used_mb is None and self.processes is None:
            return None
        used = dict(self.lease_used_mb or {})
        for process in self.processes or ():
            if process.lease is not None:
                used[process.lease] = used.get(process.lease, 0) + process.used_mb
        return used


class Heartbeat(_In):
    """``leases``: the leases whose running processes the agent supervises (their TTL
    lapsing revokes them; the memory stays until they are reported ``stopped``)."""

    gpus: Annotated[list[GpuProbeIn], Field(max_length=64)] = Field(default_factory=list)
    leases: Annotated[list[Text], Field(max_length=1024)] = Field(default_factory=list)
    stopped: Annotated[list[Text], Field(max_length=1024)] = Field(default_factory=list)
    stale: Annotated[list[Annotated[StrictInt, Field(ge=0, le=1023)]], Field(max_length=64)] = (
        Field(default_factory=list)
    )


class OperationReportIn(_In):
    """An agent reports a step of an operation it carries out."""

    step: Literal["update_command"]
    outcome: Literal["started", "ok", "failed"]
    detail: Annotated[StrictStr, Field(max_length=4000)] = ""


class DrainIn(_In):
    mode: Literal["graceful", "force"] = "graceful"
    deadline_s: Annotated[Seconds, Field(ge=0, le=366 * 86400)] | None = None


class UpdateIn(_In):
    """``timeout_s``: the whole update (drain, command, restart) fails if not done by then;
    ``drain_deadline_s``: leases still on the worker after it are revoked."""

    timeout_s: Annotated[Seconds, Field(gt=0, le=366 * 86400)] = UPDATE_TIMEOUT_S
    drain_deadline_s: Annotated[Seconds, Field(ge=0, le=366 * 86400)] | None = None


def _small_object(value: dict[str, Any]) -> dict[str, Any]:
    """A small JSON object (at most 32 keys, 8 levels, 4 KiB), its inner place named."""
    try:
        return check_metadata(value, "object")
    except InvalidInput as error:
        inner = error.field.removeprefix("object").lstrip(".")
        message = f"{inner}: {error.reason}" if inner else error.reason
        raise PydanticCustomError("json_value", message) from None


SmallObject = Annotated[dict[Short, Any], Field(max_length=32), AfterValidator(_small_object)]
LongText = Annotated[StrictStr, Field(max_length=2000), NoControl]
Count = Annotated[StrictInt, Field(ge=0, le=1 << 31)]
Ago = Annotated[Seconds, Field(ge=0, le=1 << 40)]


def _http_url(url: str) -> str:
    if url and not url.startswith(("http://", "https://")):
        raise PydanticCustomError("url", "must start with http:// or https://")
    return url


class GatewayModelIn(_In):
    """One model as the gateway's ``GET /v1/models`` describes it (its aliases are not
    entries of their own here); each replica a small JSON object."""

    id: Short
    object: Literal["model"] = "model"
    owned_by: Text = ""
    state: Short
    aliases: Annotated[list[Short], Field(max_length=64)] = Field(default_factory=list)
    vram_mb: MiB = 0
    gpus: Annotated[StrictInt, Field(ge=1, le=64)] = 1
    max_parallel: Annotated[StrictInt, Field(ge=1, le=4096)] = 1
    priority: Annotated[StrictInt, Field(ge=0, le=1000)] = 500
    held_mb: MiB = 0
    in_flight: Count = 0
    queued: Count = 0
    last_used_ago_s: Ago | None = None
    keep_alive_left_s: Ago | None = None
    pinned: StrictBool = False
    preemptible_by: Text | None = None
    pending_reason: LongText | None = None
    failure: LongText | None = None
    retry_at: Ago | None = None  # a failed model: when a request may start it again (unix)
    retry_in_s: Ago | None = None  # and in how many seconds (0: now)
    replicas: Annotated[list[SmallObject], Field(max_length=64)] = Field(default_factory=list)
    file: Text | None = None  # its model file's name (its ``file``), if it has one


def _public_key(text: str) -> str:
    try:
        decode_key(text)
    except InvalidInput as error:
        raise PydanticCustomError("public_key", error.reason) from None
    return text


class GatewayConflictIn(_In):
    """A name (or alias) both sources of a gateway's models declare: ``model``, as the
    source ``kept`` declares it, won over ``over``'s (``own file``, ``catalogue revision
    3``)."""

    model: Short
    kept: Text
    over: Text


class GatewayFileIn(_In):
    """A model file the gateway holds, verified: its name in its models_dir, its size in
    bytes and its SHA-256 (peers copy it from there: ``GET /files/{name}``)."""

    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,254}$")]
    size: Annotated[StrictInt, Field(gt=0, le=1 << 50)]
    sha256: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]


class GatewayLeftOutIn(_In):
    """A model of the cluster's catalogue that the gateway's host may run but does not
    serve, and why (its ``vram = "auto"`` cannot be estimated there, its program is not
    there)."""

    model: Short
    why: Text


class GatewayReportIn(_In):
    """A gateway's report of itself: where it listens, its host, the worker it runs
    beside (when it knows one), every model it serves, and its public key (X25519, 32
    raw bytes in base64url: its peers check the requests it relays with it)."""

    url: Annotated[Text, AfterValidator(_http_url)] = ""
    public_key: Annotated[StrictStr, Field(max_length=64), AfterValidator(_public_key)] | None = (
        None
    )
    host: Text = ""
    worker: Short | None = None
    models: Annotated[list[GatewayModelIn], Field(max_length=256)] = Field(default_factory=list)
    routes: Annotated[list[SmallObject], Field(max_length=50)] = Field(default_factory=list)
    conflicts: Annotated[list[GatewayConflictIn], Field(max_length=256)] = Field(
        default_factory=list
    )
    files: Annotated[list[GatewayFileIn], Field(max_length=256)] = Field(default_factory=list)
    left_out: Annotated[list[GatewayLeftOutIn], Field(max_length=256)] = Field(default_factory=list)


CATALOGUE_TEXT_BYTES = 1 << 20
"""A catalogue's text, at most (UTF-8)."""


def _catalogue_size(text: str) -> str:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > CATALOGUE_TEXT_BYTES:
        raise PydanticCustomError(
            "too_large",
            "is {size} bytes; a catalogue is at most {limit} bytes",
            {"size": size, "limit": CATALOGUE_TEXT_BYTES},
        )
    return text


class CatalogueIn(_In):
    """A catalogue's text (TOML: ``[models.NAME]`` tables), and the name of the file it
    was read from (its errors name it)."""

    text: Annotated[
        StrictStr, Field(max_length=CATALOGUE_TEXT_BYTES), AfterValidator(_catalogue_size)
    ]
    file: Annotated[StrictStr, Field(min_length=1, max_length=256), NoControl] = "catalogue.toml"


# ---------------------------------------------------------------- outputs (documentation)


class _Out(BaseModel):
    """A shape the API answers with, for the OpenAPI schema: the answers themselves are
    built by the ``*_out`` functions, so its validator is built only if something uses
    it (the schema's own generation, a test), not for every route at the start."""

    model_config = ConfigDict(defer_build=True)


class ErrorBody(_Out):
    code: str
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


class ErrorOut(_Out):
    error: ErrorBody


class LeaseOut(_Out):
    id: str
    state: str
    gpus: list[str]
    worker: str | None
    token: int | None
    vram_mb: int
    gpu_count: int
    priority: int
    priority_name: str
    preemptible: bool
    holder: str
    metadata: dict[str, Any]
    constraints: dict[str, Any]
    ttl_s: float | None
    submitted_at: float
    granted_at: float | None
    expires_at: float | None = Field(
        description="When its TTL lapses unless renewed (Unix time); null while pending, "
        "and for a lease with no TTL"
    )
    ended_at: float | None
    end_reason: str | None
    revoke_reason: str | None
    preempted_for: str | None
    revoked_at: float | None = None
    supervised: bool = False
    idle: bool
    loading: bool
    idempotency_key: str | None
    position: int | None = None
    effective_priority: int | None = None
    reason: dict[str, Any] | None = Field(
        default=None,
        description="Why a pending request waits: code, message, gpus (a verdict per "
        "outcome), nominated, blocked_by, blocker and blockers (each with kind, id, holder, "
        "gpus, since, until, expires_at; a lease's also state, priority, priority_name, "
        "rule). Every time is Unix time, finite, or null where there is none: until null "
        "is never (or, for a revoking lease, no TTL bounds it), expires_at null is no TTL",
    )


class GpuOut(_Out):
    id: str
    index: int
    uuid: str
    model: str
    vendor: str
    arch: str
    total_mb: int
    headroom_mb: int
    capacity_mb: int
    used_mb: int | None
    committed_mb: int
    free_mb: int
    overcommitted_mb: int = 0
    loading: int
    stale: bool
    leases: list[str]


class WorkerUpdateOut(_Out):
    operation: str
    waiting_on: str
    deadline: float | None


class WorkerOut(_Out):
    name: str
    state: str
    url: str
    labels: dict[str, str]
    agent_version: str
    simulated: bool
    registered_at: float
    last_heartbeat_at: float | None
    drain_deadline: float | None
    update: WorkerUpdateOut | None
    gpus: list[GpuOut]


class HeartbeatOut(_Out):
    name: str
    state: str
    leases: list[str]
    revoking: list[str]
    update: dict[str, Any] | None = None


class OperationStepOut(_Out):
    name: str
    outcome: str
    at: float
    detail: str


class OperationOut(_Out):
    id: str
    kind: str
    worker: str
    state: str
    created_at: float
    steps: list[OperationStepOut]
    reason: str | None
    from_version: str
    to_version: str | None
    deadline: float | None


class DrainOut(_Out):
    worker: str
    previous_state: str
    state: str
    revoked: int
    already_revoking: int
    already_finished: int
    leases_left: int


class GatewayCommandOut(_Out):
    """A command queued for a gateway: ``verb`` one of unload, pin, unpin (an admin's),
    or adopt (the cluster's ``lease``, granted beside the gateway, to serve under)."""

    id: str
    model: str
    verb: str
    lease: str | None = None


class GatewayReportOut(_Out):
    """The answer to a report: the gateway is stale after ``ttl_s`` without another
    (report every ``report_s``); ``commands``: those queued for it, handed over now."""

    name: str
    ttl_s: float
    report_s: float
    commands: list[GatewayCommandOut]


class GatewayCommandsOut(_Out):
    name: str
    commands: list[GatewayCommandOut]


class GatewayCommandQueuedOut(_Out):
    id: str
    gateway: str
    model: str
    verb: str


class GatewayOut(_Out):
    """A gateway as it last reported: ``stale`` once it has not for ``ttl_s``; its
    models as its ``GET /v1/models`` describes them."""

    name: str
    url: str
    host: str
    worker: str | None
    reported_ago_s: float
    stale: bool
    commands_queued: int
    models: list[dict[str, Any]]
    routes: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Its last routing decisions as a front door (newest last): model, "
        "outcome (local, peer, load, none, placed; relayed: a request another front door "
        "relayed here, with from, its sender, and verified), to (a gateway), why, at "
        "(Unix time)",
    )
    conflicts: list[dict[str, str]] = Field(
        default_factory=list,
        description="The names both sources of its models declare (its own file and the "
        "cluster's catalogue): model, kept (the source whose model it serves), over",
    )
    files: list[dict[str, Any]] = Field(
        default_factory=list,
        description="The model files it holds, verified (name, size in bytes, sha256): "
        "its peers copy them from its GET /files/{name}",
    )
    left_out: list[dict[str, str]] = Field(
        default_factory=list,
        description="The models of the catalogue its host may run that it does not serve: "
        "model, why",
    )


class GatewayGoneOut(_Out):
    name: str
    forgotten: bool


class CatalogueRevisionOut(_Out):
    """One revision of the cluster's catalogue: numbered 1, 2, ... in the order applied;
    ``applied_by``: the id of the token that applied it; ``text`` where asked for."""

    revision: int
    sha256: str
    applied_at: float
    applied_by: str
    file: str
    size_bytes: int
    text: str | None = None


class CatalogueOut(CatalogueRevisionOut):
    """The current revision, with its text and its models as the catalogue declares
    them (by name: command, vram, gpus, where it may run: hosts, labels, vendor,
    gpu_model, gpu_arch, min_compute_capability)."""

    models: dict[str, dict[str, Any]] | None = Field(
        description="null only where this controller cannot read the text (``problem``)"
    )
    problem: str | None = None


class CatalogueAppliedOut(CatalogueRevisionOut):
    """``outcome``: ``applied`` (a new revision, 201) or ``unchanged`` (the text is the
    current revision's: no new one, 200)."""

    outcome: Literal["applied", "unchanged"]


# ---------------------------------------------------------------- records -> JSON


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def lease_out(
    record: LeaseRecord,
    pending: PendingView | None = None,
    *,
    position: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """A lease as JSON; a pending one with its position (and reason, when ``pending``).

    Not the stored document (``store.codec.lease_to_doc``), on purpose: the store keeps
    a lease nested (request, grant) and lossless, to be read back exactly; the API shows
    it flat, as a client reads it (its worker, ``gpu_count``, ``priority_name``, the
    compute capability as ``"8.0"``, no loading flag once it ended, its place in the
    queue)."""
    request, lease = record.request, record.lease
    out: dict[str, Any] = {
        "id": record.id,
        "state": str(record.state),
        "gpus": [] if lease is None else [str(g) for g in lease.gpus],
        "worker": record.worker,
        "token": record.token,
        "vram_mb": request.vram_mb if lease is None else lease.vram_mb,  # as shrunk
        "gpu_count": request.gpus,
        "priority": request.priority,
        "priority_name": priority_name(request.priority),
        "preemptible": request.preemptible,
        "holder": request.holder,
        "metadata": dict(request.metadata),
        "constraints": constraints_out(request.constraints),
        "ttl_s": request.ttl_s,
        "submitted_at": request.submitted_at,
        "granted_at": None if lease is None else lease.granted_at,
        "expires_at": None if lease is None else _finite(lease.expires_at),
        "ended_at": record.ended_at,
        "end_reason": record.end_reason,
        "revoke_reason": None if lease is None else lease.revoke_reason,
        "preempted_for": None if lease is None else lease.preempted_for,
        "revoked_at": None if lease is None else lease.revoked_at,
        "supervised": False if lease is None else lease.supervised,
        "idle": False if lease is None else lease.idle,
        "loading": False if lease is None else lease.loading and not record.state.is_final,
        "idempotency_key": request.idempotency_key,
    }
    if pending is not None:
        out["position"] = pending.position
        out["effective_priority"] = pending.effective_priority
        out["reason"] = pending.reason.as_dict()
    elif position is not None:
        out["position"], out["effective_priority"] = position
    return out


def constraints_out(c: Constraints) -> dict[str, Any]:
    """A request's constraints as the API shows them: every field, the compute
    capability as ``"8.0"``, the labels an object, the GPUs as ``worker:index``."""
    cc = c.min_compute_capability
    return {
        "vendor": c.vendor,
        "min_compute_capability": "{}.{}".format(*cc) if cc else None,
        "gpu_arch": list(c.gpu_arch),
        "gpu_model": c.gpu_model,
        "worker": c.worker,
        "labels": dict(c.labels),
        "gpu_ids": [str(g) for g in c.gpu_ids],
        "never_preempt": list(c.never_preempt),
        "workers": list(c.workers),
        "prefer_workers": list(c.prefer_workers),
    }


def worker_out(
    record: WorkerRecord,
    figures: list[GpuFigures],
    last_seen: float | None,
    update: OperationRecord | None = None,
) -> dict[str, Any]:
    running = None
    if update is not None:
        running = {
            "operation": update.id,
            "waiting_on": update.waiting_on,
            "deadline": update.deadline,
        }
    return {
        "name": record.name,
        "state": str(record.status),
        "url": record.url,
        "labels": dict(record.labels),
        "agent_version": record.agent_version,
        "simulated": record.simulated or record.simulated_gpus,
        "registered_at": record.registered_at,
        "last_heartbeat_at": last_seen,
        "drain_deadline": record.drain_deadline,
        "update": running,
        "gpus": [gpu_out(f) for f in figures],
    }


def heartbeat_out(
    record: WorkerRecord, leases: list[Lease], update: dict[str, Any] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": record.name,
        "state": str(record.status),
        "leases": [lease.id for lease in leases],
        "revoking": [lease.id for lease in leases if lease.state is LeaseState.REVOKING],
    }
    if update is not None:
        out["update"] = update
    return out


def operation_out(op: OperationRecord) -> dict[str, Any]:
    """An operation as the API shows it (:class:`OperationOut`), each step with its time
    and outcome. The API's own, not the store's document (``store.codec``): the two hold
    the same fields today, but a change of what is stored does not change the API."""
    return {
        "id": op.id,
        "kind": op.kind,
        "worker": op.worker,
        "state": op.state,
        "created_at": op.created_at,
        "steps": [operation_step_out(step) for step in op.steps],
        "reason": op.reason,
        "from_version": op.from_version,
        "to_version": op.to_version,
        "deadline": op.deadline,
    }


def operation_step_out(step: OperationStep) -> dict[str, Any]:
    return {"name": step.name, "outcome": step.outcome, "at": step.at, "detail": step.detail}


def gpu_out(f: GpuFigures) -> dict[str, Any]:
    gpu = f.gpu
    return {
        "id": str(gpu.id),
        "index": gpu.index,
        "uuid": gpu.uuid,
        "model": gpu.model,
        "vendor": gpu.vendor,
        "arch": gpu.arch,
        "total_mb": gpu.total_mb,
        "headroom_mb": gpu.headroom_mb,
        "capacity_mb": gpu.capacity_mb,
        "used_mb": f.used_mb,
        "committed_mb": f.committed_mb,
        "free_mb": f.free_mb,
        "overcommitted_mb": f.overcommitted_mb,
        "loading": f.loading,
        "stale": f.stale,
        "leases": list(f.lease_ids),
    }


def drain_out(outcome: DrainOutcome) -> dict[str, Any]:
    return {
        "worker": outcome.worker,
        "previous_state": outcome.previous_state,
        "state": outcome.state,
        "revoked": outcome.revoked,
        "already_revoking": outcome.already_revoking,
        "already_finished": outcome.already_finished,
        "leases_left": outcome.leases_left,
    }


def catalogue_revision_out(revision: CatalogueRevision, *, text: bool) -> dict[str, Any]:
    """A catalogue revision as the API shows it (:class:`CatalogueRevisionOut`)."""
    out: dict[str, Any] = {
        "revision": revision.revision,
        "sha256": revision.sha256,
        "applied_at": revision.applied_at,
        "applied_by": revision.applied_by,
        "file": revision.file,
        "size_bytes": len(revision.text.encode()),
    }
    if text:
        out["text"] = revision.text
    return out


def event_out(event: Event) -> dict[str, Any]:
    """An event as the API shows it (the ``data`` of each event of ``GET /v1/events``).
    The API's own, not the store's document (``store.codec``): the two hold the same
    fields today, but a change of what is stored does not change the API."""
    return {
        "seq": event.seq,
        "at": event.at,
        "kind": event.kind,
        "lease_id": event.lease_id,
        "worker": event.worker,
        "data": dict(event.data),
    }


# ---------------------------------------------------------------- history and access


class GpuHistoryOut(_Out):
    """One GPU's samples, one value per time of ``times`` (``null``: the GPU was not
    there then; for ``used_mb`` also: its probe reported nothing)."""

    id: str
    total_mb: int
    committed_mb: list[int | None]
    used_mb: list[int | None]
    busy_mb: list[int | None]


class HistoryOut(_Out):
    """The controller's recent history, kept in its memory (a restart starts it afresh):
    a sample every ``sample_s`` seconds, the last ``samples`` of them, for at most
    ``max_gpus`` GPUs (``gpus_left_out``: how many more the last sample saw)."""

    sample_s: float
    samples: int
    max_gpus: int
    gpus_left_out: int
    times: list[float]
    gpus: list[GpuHistoryOut]
    queue: dict[str, list[int]] = Field(
        description="Pending requests per priority class (critical, interactive, normal, "
        "background, batch: the highest name at or below the priority), one count per time"
    )


class AccessOut(_Out):
    """How to sign in. ``auth``: whether tokens are needed; ``role``: the role of the
    token sent, if the controller knows it (``null`` without one, or for an unknown one);
    ``admin_token_file``: where this controller keeps its admin token, told only to a
    caller on the controller's own machine (loopback), ``null`` otherwise."""

    auth: bool
    role: str | None
    admin_token_file: str | None
