"""The gateway's HTTP side: a plain ASGI app. Each request is one :class:`.request.Request`,
built at the entry; the checks every route shares come first, then one table says which
route answers it (:data:`_EXACT`, :data:`_PREFIXES`).

    POST /v1/...              the model named by the body's ``model`` (or an alias): a
                              JSON body's top-level key, a multipart body's form field
    ANY  /models/{name}/...   any HTTP server, by prefix (the prefix is taken off)
    GET  /v1/models           the configured models with their state, and each alias
                              as an entry of its own (``alias_of``); at a front door,
                              the cluster's models, each with the cluster's state and
                              every host's copy beside it (``hosts``: :func:`_with_hosts`),
                              ``queued`` with the cluster's load (``load``) while
                              that waits at the arbiter
    GET  /v1/models/{id}      one of them, by name or alias
    POST /admin/models/{name}/unload, /pin, /unpin
                              an operator's (an admin key's, when there are keys): stop
                              its replicas now; keep it busy-marked; let it go again
    GET  /admin/routes        the last routing decisions of this front door, newest
                              first: where each request went and why
    POST /admin/reload        an operator's: the config file read again and its models
                              applied (``live.py``): what changed, as JSON (added,
                              removed, replaced, in_place, conflicts, not_applied,
                              failed), or
                              422 invalid_config naming the field (``param``) and why
    GET  /files/{name}        a model file this gateway holds, to a peer only (its
                              verified x-arbiter-peer; a Range honoured: files/route.py)
    GET  /metrics, /healthz

In front of every route: the ``Host`` check, the simple-request rule and the API keys
(``access.py``); ``/healthz`` needs no key. A request routed to a model carries its key's
``priority`` (if any) to the model (``servers/model.py``: how a lease's priority follows its
callers). Bodies are held only as far as finding the
model needs, under ``max_body_bytes`` each and ``max_buffered_bytes`` in all
(``bodies.py``); the rest streams to the model server as it comes, as every body to
``/models/{name}/...`` does.

Responses stream through as they come (server-sent events, chunked bodies): each
chunk the model server sends is passed on at once. A client that disconnects
cancels the request to the model server (its connection is closed), seen from
``relay.WATCH_AFTER_S`` into the relay on. An answer to a
JSON body names the model as the body did (the model's name, an alias, or
``MODEL@GATEWAY`` as sent), not as the model server calls itself (llama.cpp's server:
its GGUF file's path): its top-level ``model``, in a JSON answer and in each event of a
stream, renamed by the gateway that serves it (``renamed.py``).

Errors have OpenAI's shape, ``{"error": {"message", "type", "code"}}``:

    400 no_model                the body names no model (not JSON, no ``model`` field)
    401 invalid_api_key         no key, or not one of ``[gateway] api_keys``
    403 permission_denied       a user key on an ``/admin/`` route; a peer's header on
                                any route but a model's
    403 permission_denied       /files/ without a peer's verified header (a key is not
                                enough)
    403 invalid_peer            a peer's ``x-arbiter-peer`` not taken, saying why (not
                                for this gateway, out of its time window, a sender or
                                key this gateway's view does not show even when asked
                                again, a MAC that does not verify, a replay)
    404 model_not_found         an unknown model (naming the known ones), or one a
                                change of the model set removed (naming that change)
    404 not_found               no such route
    413 too_large               a body over ``max_body_bytes``
    415 unsupported_media_type  a change a cross-site page could send
    416 range_not_satisfiable   /files/ with a Range that is not one or lies beyond it
    422 invalid_config          a reload refused (nothing changed): ``param`` names the
                                field, the message the field and the reason
    421 misdirected_request     a ``Host`` that is not this gateway's
    502 model_failed            the model server failed (exited, refused, reset), or
                                its last starts did (backing off)
    503 unavailable             no replica ready within ``queue_timeout``, or its replica
                                stopped (revoked, preempted, unloaded, the gateway
                                stopping) before the request could finish within the
                                model's ``grace``, or the gateway is stopping (a request
                                that comes or still waits for a replica then)
    503 overloaded              the bodies held in memory are at ``max_buffered_bytes``
    503 peer_view_behind        a peer's ``x-arbiter-peer`` made for this gateway's
                                previous key (it restarted; the sender's view has not
                                shown the new one yet): Retry-After 1

A 503 carries ``Retry-After``. An event stream already relayed when its replica stops
(or its server cuts it short) ends with a final ``data: {"error": {...}}`` event in
that shape, with its ``status`` (the ``openai`` SDK raises it as an ``APIError``); any
other answer cut short ends with its connection, short of its length.

The request path's modules: ``front_door.py`` (where a request that came here first
goes in the cluster), ``waits.py`` (a wait for a replica or a load), ``relay.py`` (the
relay to a replica or a peer, and what its end says), ``renamed.py`` (the answer's
``model`` renamed), ``answers.py`` (the gateway's own answers), ``request.py`` (the
request as a value).

A gateway that stops (:meth:`GatewayApp.stop`) answers 503 at once to each new request
for a model and to those waiting for a replica; the requests relayed to a replica get
its grace (the replica's stop, ``servers/replica.py``), then end as above.

A caller that waits for a replica sees why (``waits.py``): a JSON request with
``"stream": true`` gets a 200 event stream's head at once and SSE comment lines
(``: queued, position 1: ...``, ``: loading chat (3.1s)``) until the model server's own
stream; an error after that head is an SSE ``data:`` event in the shape above, with its
``status``. Every relayed answer and every refusal from the queue carries
``x-queue-seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ...core import InvalidInput
from ...peer_identity import Refusal, Relayed
from ...web.zerocopy import ZEROCOPY
from ..base.metrics import GatewayMetrics
from ..base.race import within
from ..base.scopes import CancelScope
from ..cluster.cluster import Cluster
from ..files.store import FileStore
from ..servers.model import ModelServer, Refused
from ..servers.states import most_advanced
from . import files as files_route
from .access import ADMIN_PREFIX, PEER_ONLY, Access
from .answers import (
    STOPPING,
    Receive,
    Scope,
    Send,
    send_bytes,
    send_error,
    send_json,
    send_refused,
)
from .bodies import (
    MAX_BODY_BYTES,
    MAX_BUFFERED_BYTES,
    BodyBudget,
    ClientGone,
    HeldBody,
    MultipartModel,
    OverBudget,
    TooLarge,
    boundary_of,
    scan_model,
    stream_rest,
)
from .front_door import front_door
from .relay import Forwards, to_replica
from .request import LEASE, Outbound, Request, chain, declared_length
from .waits import Wait, acquire

__all__ = ["ADMIN_VERBS", "STOPPING", "GatewayApp"]

log = logging.getLogger("gpu_arbiter.gateway")

ADMIN_VERBS = ("unload", "pin", "unpin")
_ADMIN_ROUTE = re.compile(
    re.escape(ADMIN_PREFIX) + r"models/([^/]+)/(" + "|".join(ADMIN_VERBS) + ")"
)
Handler = Callable[["GatewayApp", Request], Awaitable[None]]
Reload = Callable[[], Awaitable[dict[str, Any]]]
"""Reads the gateway's config file again and applies its models: what changed; raises
:class:`~gpu_arbiter.core.InvalidInput` (nothing changed)."""


class GatewayApp:
    def __init__(
        self,
        models: Mapping[str, ModelServer],
        routes: Mapping[str, str],
        metrics: GatewayMetrics,
        access: Access | None = None,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_buffered_bytes: int = MAX_BUFFERED_BYTES,
    ) -> None:
        self.models = models
        self.routes = routes  # a model's name and aliases -> its name
        self.metrics = metrics
        self.access = access or Access((), "127.0.0.1", ())
        self.max_body_bytes = max_body_bytes
        self.budget = BodyBudget(max_buffered_bytes)
        metrics.body_bytes_held.set_function(lambda: self.budget.held)
        self.created = int(time.time())  # the models' "created", as OpenAI lists it
        self.name = "gateway"  # as it reports itself (``x-served-by``)
        self.cluster: Cluster | None = None  # the other gateways (None: on its own)
        self.files: FileStore | None = None  # the model files it serves its peers
        self.stopping = False
        self.removed: Mapping[str, str] = {}  # a name removed -> what removed it (live.py)
        self.reload: Reload | None = None  # None: no file to read again
        self.waits: set[CancelScope] = set()  # requests waiting for a replica or a load
        self.forwards = Forwards()  # requests relayed to another gateway
        self._running = 0  # HTTP requests being answered
        self._quiet = asyncio.Event()
        self._quiet.set()

    def stop(self) -> None:
        """The gateway stops: each new request for a model, and each still waiting for a
        replica, is answered 503 at once (those relayed get their replica's grace)."""
        self.stopping = True
        for wait in self.waits:
            wait.cancel(STOPPING)

    async def settle_forwards(self, grace_s: float) -> None:
        """At the stop: the requests this front door relays to other gateways get
        ``grace_s`` to finish; those still running then end as a preemption ends them
        (a 503 naming why, or an event stream's final error event)."""
        await self.forwards.settle(grace_s)

    async def quiet(self, timeout_s: float) -> bool:
        """Waits until no request is being answered (at most ``timeout_s``); True then."""
        return await within(self._quiet, timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        self._running += 1
        self._quiet.clear()
        try:
            with contextlib.suppress(ClientGone):
                request = Request.build(scope, receive, send, self.access, self._verify)
                if await self._relearned(request):
                    request = Request.build(scope, receive, send, self.access, self._verify)
                await self._http(request)
        finally:
            self._running -= 1
            if not self._running:
                self._quiet.set()

    async def _relearned(self, request: Request) -> bool:
        """Whether the view was asked for again because a peer's header named a sender or
        key not known here (a peer that just started or restarted may relay before this
        gateway's view shows it): the request is then verified again, once."""
        refused = request.peer_refused
        if refused is None or not refused.ask_again or self.cluster is None:
            return False
        await self.cluster.relearn()
        return True

    def _verify(self, signed: str, relayed: Relayed) -> str | Refusal:
        if self.cluster is None:
            return Refusal("this gateway is in no cluster: it takes no relayed request")
        return self.cluster.verify(signed, relayed)

    async def _http(self, request: Request) -> None:
        """The checks every route shares, in order, then the route's handler."""
        handler, to_a_model = _route_of(request.method, request.path)
        if request.peer_refused is not None:
            refused = request.peer_refused
            why = refused.why
            log.info("a relayed %s %s refused: %s", request.method, request.path[:200], why)
            message = f"x-arbiter-peer refused: {why}"
            if refused.status == 503:  # made for this gateway's previous key: retry
                await send_error(request.send, 503, message, "peer_view_behind", 1.0)
            else:
                await send_error(request.send, 403, message, "invalid_peer")
            return
        headers = request.headers
        for_peers = request.path.startswith(files_route.PREFIX)
        if request.peer:  # relayed by a peer: a model's route only (access.py), or a file
            denial = None if to_a_model or for_peers else PEER_ONLY
        elif for_peers:
            denial = files_route.FILES_FOR_PEERS
        else:
            denial = self.access.check(request.method, request.path, headers)
        if denial is not None:
            await send_error(request.send, denial.status, denial.message, denial.code)
        elif declared_length(request.headers) > self.max_body_bytes:
            await self.too_large(request.send)
        elif self.stopping and to_a_model:
            await send_error(request.send, 503, f"{STOPPING}: no new requests", "unavailable", 1.0)
        else:
            await handler(self, request)

    # ------------------------------------------------------------------ the models

    async def _listing(self, request: Request) -> None:
        """``GET /v1/models`` or ``GET /v1/models/{id}``."""
        wanted = request.path[len("/v1/models/") :]
        entries = [
            self._entry(model.name, alias)
            for model in self.models.values()
            for alias in (model.name, *model.config.aliases)
        ]
        if self.cluster is not None:
            entries = _with_hosts(entries, self.cluster, self.created)
        if not wanted:
            await send_json(request.send, 200, {"object": "list", "data": entries})
            return
        found = next((entry for entry in entries if entry["id"] == wanted), None)
        if found is None:
            await self._unknown(request.send, wanted)
            return
        await send_json(request.send, 200, found)

    def _entry(self, name: str, alias: str) -> dict[str, Any]:
        """A model (``alias`` is its name) or one of its aliases as OpenAI lists models,
        with the gateway's own fields."""
        model = self.models[name]
        if alias == name:
            return {"created": self.created, **model.describe()}
        return {
            "id": alias,
            "object": "model",
            "created": self.created,
            "owned_by": "gpu-arbiter",
            "alias_of": model.name,
            "state": model.state(),
        }

    async def _admin(self, request: Request) -> None:
        """``POST /admin/models/{name}/{verb}``: :meth:`administer`, its answer as JSON."""
        found = _ADMIN_ROUTE.fullmatch(request.path)
        if found is None:
            await _not_found(self, request)
            return
        name, verb = found.groups()
        by = request.key.name if request.key else "a local caller"
        done = await self.administer(name, verb, by)
        if done is None:
            await self._unknown(request.send, name)
            return
        await send_json(request.send, 200, done)

    async def administer(self, name: str, verb: str, by: str) -> dict[str, Any] | None:
        """Unloads, pins or unpins a model (by name or alias) as an operator asked
        (``by``: who, for the log): what it did (unload) or what the model is now; None
        for an unknown model. The admin routes and the controller's commands
        (``cluster/report.py``) both come here; a verb not in :data:`ADMIN_VERBS` is a
        ``ValueError``."""
        if verb not in ADMIN_VERBS:
            raise ValueError(f"verb must be one of {', '.join(ADMIN_VERBS)}, not {verb!r}")
        if name not in self.routes:
            return None
        model = self.models[self.routes[name]]
        log.info("model %s: %s by %s", model.name, verb, by)
        if verb == "unload":
            return await model.unload()
        if verb == "pin":
            await model.pin()
        else:
            model.unpin()
        return self._entry(model.name, model.name)

    async def adopt(self, name: str, lease_id: str) -> None:
        """Serves model ``name`` under the cluster's lease ``lease_id``, granted beside
        this gateway (the controller's ``adopt`` command), unless it does already."""
        if self.cluster is not None and name in self.routes:
            await self.cluster.adopt(self.models[self.routes[name]], lease_id)

    async def _file(self, request: Request) -> None:
        """``GET /files/{name}``, for a peer (``files/route.py``)."""
        name = request.path[len(files_route.PREFIX) :]
        held = [] if self.files is None else self.files.held()
        root = None if self.files is None else self.files.root
        zero_copy = ZEROCOPY in request.scope.get("extensions", {})
        await files_route.serve_file(
            request.send, name, held, root or Path(), request.headers.get(b"range"), zero_copy
        )

    async def _routed(self, request: Request) -> None:
        """``GET /admin/routes``: this front door's last routing decisions, newest first."""
        routed = [] if self.cluster is None else list(reversed(self.cluster.routed))
        await send_json(request.send, 200, {"routes": routed})

    async def _unknown(self, send: Send, name: str) -> None:
        known = ", ".join(sorted(self.models))
        removed = self.removed.get(name)
        if removed is not None:
            message = f"model {name} was removed {removed}; known: {known or 'none'}"
        elif not known:
            message = f"no model is served here yet: {name!r} is not known"
        else:
            message = f"model {name!r} is not known; known: {known}"
        await send_error(send, 404, message, "model_not_found")

    async def _reloaded(self, request: Request) -> None:
        """``POST /admin/reload``: :attr:`reload`'s answer, or 422 naming the field."""
        if self.reload is None:
            message = "this gateway has no config file to read again"
            await send_error(request.send, 404, message, "not_found")
            return
        by = request.key.name if request.key else "a local caller"
        log.info("gateway: reload asked by %s", by)
        try:
            done = await self.reload()
        except InvalidInput as error:
            await send_json(request.send, 422, _invalid(error))
            return
        await send_json(request.send, 200, done)

    async def too_large(self, send: Send) -> None:
        message = f"the body is over {self.max_body_bytes} bytes ([gateway] max_body_bytes)"
        await send_error(send, 413, message, "too_large")

    async def _overloaded(self, send: Send) -> None:
        message = (
            f"the gateway holds {self.budget.limit} bytes of request bodies already "
            "([gateway] max_buffered_bytes); try again"
        )
        await send_error(send, 503, message, "overloaded", 1.0)

    # ------------------------------------------------------------------ finding the model

    async def _openai(self, request: Request) -> None:
        """``POST /v1/...``: the model named by the body (a JSON body is held whole, a
        multipart one up to its ``model`` field)."""
        async with self._holding(request) as held:
            if request.media_type() == "multipart/form-data":
                name = await _multipart_model(request, held)
                missing = "a multipart body must have a model field"
            else:
                await held.read_all(request.receive)
                name = await scan_model(held.data)
                missing = "the body must be a JSON object naming a model"
                request.json_body = held.data
            if name is None:
                await send_error(request.send, 400, missing, "no_model")
                return
            request.outbound = self._outbound(request, request.target(request.raw_path()), held)
            await self._route(request, name)

    async def _prefix(self, request: Request) -> None:
        """``/models/{name}/...``: the body streams on from its first part."""
        name = request.path[len("/models/") :].partition("/")[0]
        rest = request.raw_path()[len("/models/") :].partition(b"/")[2]
        async with self._holding(request) as held:
            await held.read(request.receive)
            request.outbound = self._outbound(request, request.target(b"/" + rest), held)
            await self._route(request, name)

    @contextlib.asynccontextmanager
    async def _holding(self, request: Request) -> AsyncIterator[HeldBody]:
        """What is held of the request's body, given back at the end; a body over the
        limits is answered 413 or 503 here."""
        held = HeldBody(self.budget, self.max_body_bytes)
        try:
            yield held
        except TooLarge:
            await self.too_large(request.send)
        except OverBudget:
            await self._overloaded(request.send)
        finally:
            held.release()

    def _outbound(self, request: Request, target: bytes, held: HeldBody) -> Outbound:
        """The held part of the body, and the rest as the client sends it (if any)."""
        if not held.more:
            return Outbound(target, held.data)
        read = asyncio.Event()
        declared = declared_length(request.headers)
        rest = stream_rest(request.receive, len(held.data), self.max_body_bytes)
        length = declared if declared >= 0 else None
        return Outbound(target, chain(held.data, rest, read), length, read)

    # ------------------------------------------------------------------ serving it

    async def _route(self, request: Request, name: str) -> None:
        """A request for model ``name``: from a peer, served here (its lease adopted);
        else through the front door when there is a cluster, then here if it says so."""
        request.model = name
        if self.cluster is not None and request.peer:
            self.cluster.relayed_in(name, request.peer)
            model, at, host = name.rpartition("@")
            if at and host == self.name:  # MODEL@GATEWAY, named at a front door: this copy
                name = model
            lease_id = request.headers.get(LEASE)
            found = self.routes.get(name)
            if lease_id and found is not None:
                await self.cluster.adopt(self.models[found], lease_id)
        head_sent = False  # an event stream's head went out while it waited for a load
        if self.cluster is not None and not request.peer:
            routed = await front_door(self, request, name)
            if routed is None:
                return
            head_sent = routed
            name = name.rpartition("@")[0] or name
        found = self.routes.get(name)
        if found is None:
            await self._unknown(request.send, name)
            return
        await self._serve_here(request, self.models[found], head_sent)

    async def _serve_here(self, request: Request, model: ModelServer, head_sent: bool) -> None:
        """A replica of ``model`` for the request (it may wait: :class:`.waits.Wait`),
        then the relay to it."""
        wait = Wait(model, request.send, request.json_body, head_sent=head_sent)
        cancel = CancelScope()  # by the client's disconnect, or the gateway's stop
        self.waits.add(cancel)
        try:
            if self.stopping:
                cancel.cancel(STOPPING)
            acquired = await acquire(model, request, wait, cancel)
        except Refused as refused:
            self.metrics.requests.labels(model.name, str(refused.status)).inc()
            await send_refused(wait.sender(), refused, wait.waited_s())
            return
        finally:
            self.waits.discard(cancel)
        if acquired is None:
            return  # the client went away while the request queued
        replica, queued_s = acquired
        self.metrics.queue_seconds.labels(model.name).observe(queued_s)
        if wait.head_sent:
            await wait.comment(f"ready after {queued_s:.3f}s")
        gauge = self.metrics.in_flight.labels(model.name)
        gauge.inc()
        try:
            extra = [
                (b"x-queue-seconds", f"{queued_s:.3f}".encode()),
                (b"x-served-by", f"{self.name}/{model.name}".encode()),
            ]
            status = await to_replica(self, request, wait.sender(), replica, extra)
        finally:
            gauge.dec()
            replica.leave()
        if status:
            self.metrics.requests.labels(model.name, str(status)).inc()


# ---------------------------------------------------------------------- the routes


async def _metrics(app: GatewayApp, request: Request) -> None:
    body = generate_latest(app.metrics.registry)
    await send_bytes(request.send, 200, body, CONTENT_TYPE_LATEST.encode())


async def _healthz(app: GatewayApp, request: Request) -> None:
    await send_json(request.send, 200, {"ok": True})


async def _not_found(app: GatewayApp, request: Request) -> None:
    message = f"no route {request.method} {request.path}"
    await send_error(request.send, 404, message, "not_found")


_ANY = "*"
_EXACT: Mapping[tuple[str, str], Handler] = {
    ("GET", "/v1/models"): GatewayApp._listing,
    ("GET", ADMIN_PREFIX + "routes"): GatewayApp._routed,
    ("POST", ADMIN_PREFIX + "reload"): GatewayApp._reloaded,
    (_ANY, "/metrics"): _metrics,
    (_ANY, "/healthz"): _healthz,
}
"""The routes of one path (``*``: any method)."""
_PREFIXES: tuple[tuple[str, str, Handler, bool], ...] = (
    ("POST", "/v1/", GatewayApp._openai, True),
    (_ANY, "/models/", GatewayApp._prefix, True),
    ("GET", "/v1/models/", GatewayApp._listing, False),
    ("POST", ADMIN_PREFIX + "models/", GatewayApp._admin, False),
    ("GET", files_route.PREFIX, GatewayApp._file, False),
)
"""The routes of a path's beginning, first match first: method, prefix, handler, and
whether it goes to a model (a stopping gateway refuses those)."""


def _route_of(method: str, path: str) -> tuple[Handler, bool]:
    """The handler of a request, and whether it goes to a model."""
    for wanted, prefix, handler, to_a_model in _PREFIXES:
        if path.startswith(prefix) and wanted in (_ANY, method):
            return handler, to_a_model
    found = _EXACT.get((method, path)) or _EXACT.get((_ANY, path))
    return (found or _not_found), False


def _with_hosts(
    entries: list[dict[str, Any]], cluster: Cluster, created: int
) -> list[dict[str, Any]]:
    """The models of the whole cluster: each of this gateway's with every host's copy
    (``hosts``: :meth:`Cluster.copies`), and those only other gateways serve as entries
    of their own. An entry's ``state`` (its aliases' too) is the cluster's: the most
    advanced of its routable hosts' (``MODEL_STATES``), ``unavailable`` when none is
    routable; its other figures are this gateway's own."""
    by_id = {e["id"]: e for e in entries if "alias_of" not in e}
    for peer in sorted(cluster.peers.values(), key=lambda p: p.name):
        for model_id, model in peer.models.items():
            if model_id in by_id:
                continue
            aliases = [str(alias) for alias in model.get("aliases") or ()]
            entry: dict[str, Any] = {"id": model_id, "object": "model", "created": created,
                                     "owned_by": "gpu-arbiter", "aliases": aliases}  # fmt: skip
            by_id[model_id] = entry
            entries.append(entry)
            for alias in aliases:
                entries.append({"id": alias, "object": "model", "created": created,
                                "owned_by": "gpu-arbiter", "alias_of": model_id})  # fmt: skip
    for model_id, entry in by_id.items():
        entry["hosts"] = cluster.copies(model_id)
        found = most_advanced(h["state"] for h in entry["hosts"] if h["routable"])
        entry["state"] = found or "unavailable"
        _queued(entry, cluster.queued(model_id))
    for entry in entries:
        if "alias_of" in entry:
            entry["state"] = by_id[entry["alias_of"]]["state"]
    return entries


def _queued(entry: dict[str, Any], load: dict[str, Any] | None) -> None:
    """A model no host serves, loads or queues yet, whose cluster load is queued at the
    arbiter: listed ``queued``, with why it waits (``pending_reason``) and the load
    (``load``: its lease, the front doors that asked, its position); the requests that
    wait for it at this front door count in its ``queued``."""
    if load is None or entry["state"] == "queued":
        return
    if most_advanced((entry["state"], "queued")) != "queued":
        return
    entry["state"] = "queued"
    entry["pending_reason"] = load["waiting"]
    entry["queued"] = int(entry.get("queued") or 0) + load.pop("waiters")
    entry["load"] = load


def _invalid(error: InvalidInput) -> dict[str, Any]:
    """A refused change in OpenAI's error shape: ``param`` is the field."""
    return {
        "error": {
            "message": f"{error.field}: {error.reason}; nothing changed",
            "type": "invalid_request_error",
            "code": "invalid_config",
            "param": error.field,
        }
    }


async def _multipart_model(request: Request, held: HeldBody) -> str | None:
    """Holds a multipart body up to the end of its ``model`` field (the rest streams)."""
    boundary = boundary_of(request.headers.get(b"content-type", ""))
    if boundary is None:
        return None
    scan = MultipartModel(boundary)
    name = None
    while name is None and held.more and not scan.malformed:
        await held.read(request.receive)
        name = scan.feed(held.data)
    return name


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
