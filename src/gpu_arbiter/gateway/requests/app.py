"""The gateway's HTTP side: a plain ASGI app (no router: one dict lookup per request).

    POST /v1/...              the model named by the body's ``model`` (or an alias): a
                              JSON body's top-level key, a multipart body's form field
    ANY  /models/{name}/...   any HTTP server, by prefix (the prefix is taken off)
    GET  /v1/models           the configured models with their state, and each alias
                              as an entry of its own (``alias_of``)
    GET  /v1/models/{id}      one of them, by name or alias
    POST /admin/models/{name}/unload, /pin, /unpin
                              an operator's (an admin key's, when there are keys): stop
                              its replicas now; keep it busy-marked; let it go again
    GET  /admin/routes        the last routing decisions of this front door, newest
                              first: where each request went and why
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
cancels the request to the model server (its connection is closed).

Errors have OpenAI's shape, ``{"error": {"message", "type", "code"}}``:

    400 no_model                the body names no model (not JSON, no ``model`` field)
    401 invalid_api_key         no key, or not one of ``[gateway] api_keys``
    403 permission_denied       a user key on an ``/admin/`` route
    404 model_not_found         an unknown model (naming the known ones)
    404 not_found               no such route
    413 too_large               a body over ``max_body_bytes``
    415 unsupported_media_type  a change a cross-site page could send
    421 misdirected_request     a ``Host`` that is not this gateway's
    502 model_failed            the model server failed (exited, refused, reset), or
                                its last starts did (backing off)
    503 unavailable             no replica ready within ``queue_timeout``, or its replica
                                stopped (revoked, preempted, unloaded, the gateway
                                stopping) before the request could finish within the
                                model's ``grace``, or the gateway is stopping (a request
                                that comes or still waits for a replica then)
    503 overloaded              the bodies held in memory are at ``max_buffered_bytes``

A 503 carries ``Retry-After``. An event stream already relayed when its replica stops
(or its server cuts it short) ends with a final ``data: {"error": {...}}`` event in
that shape, with its ``status`` (the ``openai`` SDK raises it as an ``APIError``); any
other answer cut short ends with its connection, short of its length.

A gateway that stops (:meth:`GatewayApp.stop`) answers 503 at once to each new request
for a model and to those waiting for a replica; the requests relayed to a replica get
its grace (the replica's stop, ``servers/replica.py``), then end as above.

A caller that waits for a replica sees why (:class:`_Wait`): a JSON request with
``"stream": true`` gets a 200 event stream's head at once and SSE comment lines
(``: queued, position 1: ...``, ``: loading chat (3.1s)``) until the model server's own
stream; an error after that head is an SSE ``data:`` event in the shape above, with its
``status``. Every relayed answer and every refusal from the queue carries
``x-queue-seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    MutableMapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httptools
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..base.metrics import GatewayMetrics
from ..base.race import first, within
from ..base.scopes import CancelScope
from ..base.upstream import Body, NotConnected, UpstreamError
from ..cluster.cluster import Cluster
from ..cluster.routing import Kind, Route
from ..servers.lease import Lease
from ..servers.model import ModelServer, Refused
from ..servers.replica import Replica
from .access import ADMIN_PREFIX, Access
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
    json_model,
    json_true,
    stream_rest,
)

__all__ = ["ADMIN_VERBS", "GatewayApp"]

log = logging.getLogger("gpu_arbiter.gateway")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
SCAN_IN_THREAD_BYTES = 1024 * 1024
"""A JSON body larger than this is scanned for its model in a thread: the event loop
goes on relaying meanwhile."""
_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",
    }
)
_HOP_OUT = frozenset({b"connection", b"keep-alive", b"transfer-encoding"})
PEER = b"x-arbiter-peer"
"""The credential a forwarding gateway shows (issued by the controller:
``cluster/cluster.py``); with it, ``x-arbiter-priority`` and ``x-arbiter-lease`` are
believed."""
_PEER_HEADERS = frozenset(
    {PEER, b"x-arbiter-priority", b"x-arbiter-lease", b"x-arbiter-via", b"authorization"}
)
STOPPING = "the gateway is stopping"
CUT_FORWARDS_S = 1.0
"""At the stop, after the grace: how long the relays cut then may take to say so."""
HEARTBEAT_S = 3.0
"""A streaming request that waits for a replica gets a comment line at once, when what it
waits for changes, and at least this often: it says why, and keeps the client's read
timeout from running out on a long load."""
MAX_ERROR_BYTES = 64 * 1024
"""Of a model server's error answer to a request whose head went out while it waited,
this much is kept for the SSE error event (the rest is read and dropped)."""
ADMIN_VERBS = ("unload", "pin", "unpin")
_ADMIN_ROUTE = re.compile(
    re.escape(ADMIN_PREFIX) + r"models/([^/]+)/(" + "|".join(ADMIN_VERBS) + ")"
)
_SSE_HEAD = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-queued", b"true"),
]


class _Exchange:
    """One relayed request: the status sent (0 while none was), whether it is over,
    whether its client went away, whether the answer is an event stream and whether
    its body was sent to its end."""

    __slots__ = ("done", "ended", "event_stream", "gone", "status")

    def __init__(self) -> None:
        self.status = 0
        self.done = False
        self.gone = False
        self.event_stream = False
        self.ended = False


@dataclass(slots=True)
class _Outbound:
    """What goes to the model server: the target, the body (held bytes, or chunks as
    the client sends them) and its length when known. ``body_read`` is set once a
    streamed body has all been read: only then may anyone else wait on the client."""

    target: bytes
    body: Body
    length: int | None = None
    body_read: asyncio.Event | None = None


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
        self.stopping = False
        self._waits: set[CancelScope] = set()  # requests waiting for a replica
        self._forwards: set[CancelScope] = set()  # requests relayed to another gateway
        self._forwards_done = asyncio.Event()
        self._forwards_done.set()
        self._running = 0  # HTTP requests being answered
        self._quiet = asyncio.Event()
        self._quiet.set()

    def stop(self) -> None:
        """The gateway stops: each new request for a model, and each still waiting for a
        replica, is answered 503 at once (those relayed get their replica's grace)."""
        self.stopping = True
        for wait in self._waits:
            wait.cancel(STOPPING)

    async def settle_forwards(self, grace_s: float) -> None:
        """At the stop: the requests this front door relays to other gateways get
        ``grace_s`` to finish; those still running then end as a preemption ends them
        (a 503 naming why, or an event stream's final error event)."""
        await within(self._forwards_done, grace_s)
        for forward in set(self._forwards):
            forward.cancel(STOPPING)
        await within(self._forwards_done, CUT_FORWARDS_S)

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
                await self._http(scope, receive, send)
        finally:
            self._running -= 1
            if not self._running:
                self._quiet.set()

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        headers = {name.lower(): value.decode("latin-1") for name, value in scope["headers"]}
        peer = self._peer(headers)
        denial = None if peer else self.access.check(method, path, headers)
        if peer is False:
            await _error(
                send, 401, "the x-arbiter-peer credential is not this cluster's", "invalid_peer"
            )
        elif denial is not None:
            await _error(send, denial.status, denial.message, denial.code)
        elif _declared_length(headers) > self.max_body_bytes:
            await self._too_large(send)
        elif self.stopping and _to_a_model(method, path):
            await _error(send, 503, f"{STOPPING}: no new requests", "unavailable", 1.0)
        elif path.startswith("/v1/") and method == "POST":
            await self._openai(scope, receive, send, headers)
        elif path.startswith("/models/"):
            await self._prefix(scope, receive, send, headers)
        elif method == "GET" and (path == "/v1/models" or path.startswith("/v1/models/")):
            await self._listing(send, path[len("/v1/models/") :])
        elif method == "POST" and _ADMIN_ROUTE.fullmatch(path):
            await self._admin(send, path, headers)
        elif method == "GET" and path == ADMIN_PREFIX + "routes":
            routed = [] if self.cluster is None else list(reversed(self.cluster.routed))
            await _json(send, 200, {"routes": routed})
        elif path == "/metrics":
            body = generate_latest(self.metrics.registry)
            await _send(send, 200, body, CONTENT_TYPE_LATEST.encode())
        elif path == "/healthz":
            await _json(send, 200, {"ok": True})
        else:
            await _error(send, 404, f"no route {method} {path}", "not_found")

    def _peer(self, headers: Mapping[bytes, str]) -> bool | None:
        """None: not from a peer; True: a peer gateway with the cluster's credential;
        False: a credential that is not the cluster's."""
        key = headers.get(PEER)
        if key is None:
            return None
        return self.cluster is not None and self.cluster.trusts(key)

    # ------------------------------------------------------------------ the models

    async def _listing(self, send: Send, wanted: str) -> None:
        """``GET /v1/models`` (``wanted`` empty) or ``GET /v1/models/{wanted}``."""
        entries = [
            self._entry(model.name, alias)
            for model in self.models.values()
            for alias in (model.name, *model.config.aliases)
        ]
        if self.cluster is not None:
            entries = _with_hosts(entries, self.cluster, self.created)
        if not wanted:
            await _json(send, 200, {"object": "list", "data": entries})
            return
        found = next((entry for entry in entries if entry["id"] == wanted), None)
        if found is None:
            await self._unknown(send, wanted)
            return
        await _json(send, 200, found)

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

    async def _admin(self, send: Send, path: str, headers: Mapping[bytes, str]) -> None:
        """``POST /admin/models/{name}/{verb}``: :meth:`administer`, its answer as JSON."""
        found = _ADMIN_ROUTE.fullmatch(path)
        assert found is not None
        name, verb = found.groups()
        key = self.access.key_of(headers)
        done = await self.administer(name, verb, key.name if key else "a local caller")
        if done is None:
            await self._unknown(send, name)
            return
        await _json(send, 200, done)

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

    async def _unknown(self, send: Send, name: str) -> None:
        known = ", ".join(sorted(self.models))
        message = f"model {name!r} is not known; known: {known}"
        await _error(send, 404, message, "model_not_found")

    async def _too_large(self, send: Send) -> None:
        message = f"the body is over {self.max_body_bytes} bytes ([gateway] max_body_bytes)"
        await _error(send, 413, message, "too_large")

    # ------------------------------------------------------------------ finding the model

    async def _openai(
        self, scope: Scope, receive: Receive, send: Send, headers: Mapping[bytes, str]
    ) -> None:
        held = HeldBody(self.budget, self.max_body_bytes)
        try:
            json_body: bytearray | None = None  # held whole: it may ask for a stream
            if _media_type(headers) == "multipart/form-data":
                name = await _multipart_model(receive, headers, held)
                missing = "a multipart body must have a model field"
            else:
                await held.read_all(receive)
                name = await _scan(held.data)
                missing = "the body must be a JSON object naming a model"
                json_body = held.data
            if name is None:
                await _error(send, 400, missing, "no_model")
                return
            outbound = self._outbound(_target(scope, _raw_path(scope)), receive, headers, held)
            priority = self._priority(headers)
            await self._route(scope, receive, send, name, headers, outbound, json_body, priority)
        except TooLarge:
            await self._too_large(send)
        except OverBudget:
            await self._overloaded(send)
        finally:
            held.release()

    async def _prefix(
        self, scope: Scope, receive: Receive, send: Send, headers: Mapping[bytes, str]
    ) -> None:
        """``/models/{name}/...``: the body streams on from its first part."""
        name = scope["path"][len("/models/") :].partition("/")[0]
        rest = _raw_path(scope)[len("/models/") :].partition(b"/")[2]
        held = HeldBody(self.budget, self.max_body_bytes)
        try:
            await held.read(receive)
            outbound = self._outbound(_target(scope, b"/" + rest), receive, headers, held)
            priority = self._priority(headers)
            await self._route(scope, receive, send, name, headers, outbound, priority=priority)
        except TooLarge:
            await self._too_large(send)
        except OverBudget:
            await self._overloaded(send)
        finally:
            held.release()

    def _priority(self, headers: Mapping[bytes, str]) -> int | None:
        """The priority of the caller's key (None: the model's); from a peer, the one
        its front door found for its caller."""
        if self._peer(headers):
            given = headers.get(b"x-arbiter-priority", "")
            return int(given) if given.isdigit() and int(given) <= 1000 else None
        key = self.access.key_of(headers) if self.access.auth else None
        return None if key is None else key.priority

    def _outbound(
        self, target: bytes, receive: Receive, headers: Mapping[bytes, str], held: HeldBody
    ) -> _Outbound:
        """The held part of the body, and the rest as the client sends it (if any)."""
        if not held.more:
            return _Outbound(target, held.data)
        read = asyncio.Event()
        declared = _declared_length(headers)
        chunks = _chain(held.data, stream_rest(receive, len(held.data), self.max_body_bytes), read)
        return _Outbound(target, chunks, declared if declared >= 0 else None, read)

    async def _overloaded(self, send: Send) -> None:
        message = (
            f"the gateway holds {self.budget.limit} bytes of request bodies already "
            "([gateway] max_buffered_bytes); try again"
        )
        await _error(send, 503, message, "overloaded", 1.0)

    # ------------------------------------------------------------------ relaying

    async def _route(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        name: str,
        headers: Mapping[bytes, str],
        outbound: _Outbound,
        json_body: bytearray | None = None,
        priority: int | None = None,
    ) -> None:
        """``headers``: the request's, by lower-case name; ``json_body``: the body held
        whole, when it is JSON (``"stream": true`` in it gets comment lines while it
        waits); ``priority``: the caller's key's (None: the model's), which a lease asked
        for while it waits follows upward."""
        from_peer = self._peer(headers)
        if self.cluster is not None and from_peer:
            lease_id = headers.get(b"x-arbiter-lease")
            found = self.routes.get(name)
            if lease_id and found is not None:
                await self.cluster.adopt(self.models[found], lease_id)
        head_sent = False  # an event stream's head went out while it waited for a load
        if self.cluster is not None and not from_peer:
            routed = await self._front_door(
                scope, receive, send, name, outbound, json_body, priority
            )
            if routed is None:
                return
            head_sent = routed
            name = name.rpartition("@")[0] or name
        found = self.routes.get(name)
        if found is None:
            await self._unknown(send, name)
            return
        model = self.models[found]
        wait = _Wait(model, send, json_body, head_sent=head_sent)
        scope_of_wait = CancelScope()  # by the client's disconnect, or the gateway's stop
        self._waits.add(scope_of_wait)
        try:
            if self.stopping:
                scope_of_wait.cancel(STOPPING)
            acquired = await _acquire(model, receive, outbound, wait, priority, scope_of_wait)
        except Refused as refused:
            self.metrics.requests.labels(found, str(refused.status)).inc()
            await _refused(wait.sender(), refused, wait.waited_s())
            return
        finally:
            self._waits.discard(scope_of_wait)
        if acquired is None:
            return  # the client went away while the request queued
        replica, queued_s = acquired
        self.metrics.queue_seconds.labels(found).observe(queued_s)
        if wait.head_sent:
            await wait.comment(f"ready after {queued_s:.3f}s")
        gauge = self.metrics.in_flight.labels(found)
        gauge.inc()
        try:
            queued = [
                (b"x-queue-seconds", f"{queued_s:.3f}".encode()),
                (b"x-served-by", f"{self.name}/{found}".encode()),
            ]
            status = await self._forward(scope, receive, wait.sender(), replica, outbound, queued)
        finally:
            gauge.dec()
            replica.leave()
        if status:
            self.metrics.requests.labels(found, str(status)).inc()

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        replica: Replica,
        outbound: _Outbound,
        extra: Headers,
    ) -> int:
        """Relays the request, ``extra`` headers added to the answer's; the status sent
        (0 when the client went away)."""
        drop = _HOP | {b"authorization"} if self.access.auth else _HOP  # the key is ours
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in drop]
        exchange = _Exchange()
        cancel = CancelScope()  # by the replica's cut, or by the client's disconnect
        watcher = asyncio.ensure_future(
            _watch_disconnect(receive, cancel, exchange, outbound.body_read)
        )
        replica.relays.add(cancel)
        try:
            async with cancel:
                method = scope["method"]
                await self._relay(send, method, headers, outbound, extra, replica, exchange)
        except TooLarge:  # a streamed body went over the limit before any answer
            await self._too_large(send)
            exchange.status = 413
        finally:
            replica.relay_ended(cancel)
            exchange.done = True
            watcher.cancel()
        if exchange.gone:
            return 0
        if cancel.cancelled_caught and not exchange.status:  # cut before its answer began
            exchange.status = await self._stopped(send, replica)
        elif exchange.status and exchange.event_stream and not exchange.ended:
            await self._stream_cut(send, replica, cut=cancel.cancelled_caught)
        return exchange.status

    async def _relay(
        self,
        send: Send,
        method: str,
        headers: Headers,
        outbound: _Outbound,
        extra: Headers,
        replica: Replica,
        exchange: _Exchange,
    ) -> None:
        try:
            answer = await replica.upstream.request(
                method, outbound.target, headers, outbound.body, outbound.length
            )
        except UpstreamError as error:
            exchange.status = await self._failed(send, replica, error)
            return
        await _pass_on(send, answer, exchange, extra)

    # ------------------------------------------------------------------ the front door

    async def _front_door(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        name: str,
        outbound: _Outbound,
        json_body: bytearray | None,
        priority: int | None,
    ) -> bool | None:
        """Routes a request that came to this gateway as the cluster's front door
        (``cluster/routing.py``): None when it was answered here (forwarded, refused),
        else this gateway's own replicas serve it, and whether the head of its event
        stream went out already (it waited for the cluster's load). ``MODEL@GATEWAY``
        names one gateway's copy (``@`` is in no model's name)."""
        cluster = self.cluster
        assert cluster is not None
        model, at, host = name.rpartition("@")
        if not at:
            model, host = name, ""
        if not host and not cluster.knows(model):
            return False  # unknown anywhere: the local path names the models it knows
        model_id = cluster.model_id(model)
        head_sent = False
        for _ in range(len(cluster.peers) + 1):
            sender = _AfterHead(send) if head_sent else send
            decision = _named(cluster, model, host) if host else cluster.decide(model)
            self.metrics.routes.labels(model_id, str(decision.kind)).inc()
            cluster.record(model_id, decision)
            if decision.kind is Kind.LOCAL:
                return head_sent
            if decision.kind is Kind.NONE:
                status = 404 if host else 503
                code = "model_not_found" if host else "unavailable"
                await _error(sender, status, decision.why, code, 1.0 if status == 503 else None)
                return None
            lease_id, gateway = None, decision.gateway
            if decision.kind is Kind.LOAD:
                log.info("route: %s", decision.why)
                placed = await self._load(sender, receive, outbound, model_id, json_body, priority)
                if placed is None:
                    return None
                lease, head_sent = placed[0], head_sent or placed[1]
                sender = _AfterHead(send) if head_sent else send
                lease_id = lease.id
                if lease.worker == cluster.worker and model_id in self.models:
                    await cluster.adopt(self.models[model_id], lease_id)
                    return head_sent
                peer = cluster.peer_on(str(lease.worker))
                gateway = None if peer is None else peer.name
            else:
                log.debug("route: %s", decision.why)
            if gateway is None:
                await _error(
                    sender, 503, f"{model}: its host is not known here", "unavailable", 1.0
                )
                return None
            sent = await self._to_peer(
                scope, receive, sender, gateway, model_id, outbound, priority, lease_id
            )
            if sent is not None:
                return None
            self.metrics.routes.labels(model_id, "retried").inc()
        sender = _AfterHead(send) if head_sent else send
        await _error(sender, 503, f"{model}: no host took the request", "unavailable", 1.0)
        return None

    async def _load(
        self,
        send: Send,
        receive: Receive,
        outbound: _Outbound,
        model: str,
        json_body: bytearray | None,
        priority: int | None,
    ) -> tuple[Lease, bool] | None:
        """Waits for the cluster's load of ``model`` (a streaming caller sees why, as for
        a replica: :class:`_Wait`); the granted lease and how the rest of the answer is
        sent, or None when the request was answered (refused, its client gone)."""
        cluster = self.cluster
        assert cluster is not None
        wanted = priority if priority is not None else _model_priority(self, cluster, model)
        wait = _Wait(_ClusterLoad(cluster, model), send, json_body)
        cancel = CancelScope()
        self._waits.add(cancel)
        watcher = None
        if outbound.body_read is None:
            watcher = asyncio.ensure_future(_watch_disconnect(receive, cancel, _Exchange(), None))
        try:
            async with cancel:
                wait.began()
                return await cluster.load(model, wanted), wait.head_sent
            if cancel.reason == STOPPING:
                await _error(wait.sender(), 503, f"{STOPPING}: no new requests", "unavailable", 1.0)
            return None
        except Refused as refused:
            await _refused(wait.sender(), refused, wait.waited_s())
            return None
        finally:
            self._waits.discard(cancel)
            if watcher is not None:
                watcher.cancel()
            await wait.end()

    async def _to_peer(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        gateway: str,
        model: str,
        outbound: _Outbound,
        priority: int | None,
        lease_id: str | None,
    ) -> int | None:
        """Relays the request to gateway ``gateway`` as it comes and its answer as it
        comes; the status sent (0: the client went away), or None when the peer could
        not be reached (nothing of the request left: it may go elsewhere). Once the body
        has left it is never sent again; an answer cut short is the caller's, with a
        final error event on an event stream."""
        cluster = self.cluster
        assert cluster is not None
        peer = cluster.peers.get(gateway)
        if peer is None:
            return None
        drop = _HOP | _PEER_HEADERS
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in drop]
        headers += [(PEER, cluster.key.encode()), (b"x-arbiter-via", self.name.encode())]
        if priority is not None:
            headers.append((b"x-arbiter-priority", str(priority).encode()))
        if lease_id is not None:
            headers.append((b"x-arbiter-lease", lease_id.encode()))
        exchange = _Exchange()
        cancel = CancelScope()
        watcher = asyncio.ensure_future(
            _watch_disconnect(receive, cancel, exchange, outbound.body_read)
        )
        key = (gateway, model)
        cluster.forwarding[key] += 1
        self._forwards.add(cancel)
        self._forwards_done.clear()
        try:
            async with cancel:
                try:
                    answer = await peer.upstream.request(
                        scope["method"], outbound.target, headers, outbound.body, outbound.length
                    )
                except NotConnected:
                    cluster.peer_down(gateway)
                    return None
                except UpstreamError as error:
                    message = (
                        f"gateway {gateway} failed before answering for {model}: {error}; "
                        "the request is not sent again"
                    )
                    await _error(send, 502, message, "peer_failed")
                    return 502
                await _pass_on(send, answer, exchange, ())
        except TooLarge:
            await self._too_large(send)
            return 413
        finally:
            cluster.forwarding[key] -= 1
            if cluster.forwarding[key] <= 0:
                del cluster.forwarding[key]
            exchange.done = True
            watcher.cancel()
            self._forwards.discard(cancel)
            if not self._forwards:
                self._forwards_done.set()
        return await _forward_ended(send, exchange, cancel, f"{model} from {gateway}")

    async def _stopped(self, send: Send, replica: Replica) -> int:
        """503 for a request the replica's stop cut off at the end of its grace."""
        ending = replica.ending
        why = ending.reason if ending is not None else "stopped"
        grace_s = replica.model.config.grace_s
        reason = (
            f"model {replica.model.name} stopped: {why}; the request did not finish "
            f"within its {grace_s:g}s grace"
        )
        await _error(send, 503, reason, "unavailable", 1.0)
        return 503

    async def _stream_cut(self, send: Send, replica: Replica, *, cut: bool) -> None:
        """Ends an event stream cut short with a final error event: 503 when its
        replica stopped (``cut``: at the end of the grace), else 502 (the server cut it)."""
        ending = replica.ending
        if cut:
            grace_s = replica.model.config.grace_s
            why = ending.reason if ending is not None else "stopped"
            status, code = 503, "unavailable"
            message = (
                f"model {replica.model.name} stopped: {why}; the answer did not finish "
                f"within its {grace_s:g}s grace"
            )
        elif ending is not None and ending.kind.status == 503:
            status, code = 503, "unavailable"
            message = f"model {replica.model.name} stopped: {ending.reason}; the answer ended early"
        else:
            status, code = 502, "model_failed"
            why = ending.reason if ending is not None else "it ended the answer early"
            message = f"model server {replica.model.name} failed: {why}"
        error = {"message": message, "type": "server_error", "code": code, "status": status}
        event = b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": event, "more_body": False})

    async def _failed(self, send: Send, replica: Replica, error: Exception) -> int:
        await within(replica.exited, 1.0)  # did the server exit? Then say why.
        ending = replica.ending
        if ending is not None and ending.kind.status == 503:
            status, reason = 503, f"model {replica.model.name} stopped: {ending.reason}"
            await _error(send, status, reason, "unavailable", 1.0)
            return status
        why = ending.reason if ending is not None else f"{error.__class__.__name__} {error}"
        await _error(send, 502, f"model server {replica.model.name} failed: {why}", "model_failed")
        return 502


async def _pass_on(send: Send, answer: Any, exchange: _Exchange, extra: Sequence[Any]) -> None:
    """Sends an answer on as it comes, ``extra`` headers added; a body cut short ends
    the answer short (an event stream's final event is the caller's to add)."""
    try:
        kept = [(k, v) for k, v in answer.headers if k.lower() not in _HOP_OUT]
        kept += extra
        await send({"type": "http.response.start", "status": answer.status, "headers": kept})
        exchange.status = answer.status
        exchange.event_stream = _is_event_stream(answer.headers)
        more = True
        while more:  # the last bytes go with the end: one write less
            chunk = await answer.read()
            more = not answer.ended
            await send({"type": "http.response.body", "body": chunk, "more_body": more})
        exchange.ended = True
    except (OSError, httptools.HttpParserError):
        pass  # cut mid-body: an event stream's final event says so, any other ends short
    finally:
        answer.close()


async def _forward_ended(send: Send, exchange: _Exchange, cancel: CancelScope, what: str) -> int:
    """The end of a relay to another gateway (``what``: the model and that gateway): the
    status sent; a relay the stop cut off is a 503 (or its event stream's final error
    event), one cut short by the other gateway a 502 event; 0 when the client went away."""
    if exchange.gone:
        return 0
    stopped = cancel.cancelled_caught and cancel.reason == STOPPING
    if stopped and not exchange.status:
        await _error(send, 503, f"{STOPPING}: {what} did not answer in time", "unavailable", 1.0)
        return 503
    if exchange.status and exchange.event_stream and not exchange.ended:
        if stopped:
            message = f"{STOPPING}: the answer of {what} did not finish in time"
            await _final_error(send, 503, message, "unavailable")
        else:
            await _final_error(send, 502, f"the answer of {what} was cut short", "peer_failed")
    return exchange.status


async def _final_error(send: Send, status: int, message: str, code: str) -> None:
    """The final event of an event stream cut short, in OpenAI's error shape."""
    error = {"message": message, "type": "server_error", "code": code, "status": status}
    event = b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
    with contextlib.suppress(OSError):
        await send({"type": "http.response.body", "body": event, "more_body": False})


def _named(cluster: Cluster, model: str, host: str) -> Route:
    """``MODEL@GATEWAY``: that gateway's copy, or none."""
    if host == cluster.name and model in cluster.routes:
        return Route(Kind.LOCAL, host, f"{model}@{host}: named")
    peer = cluster.peers.get(host)
    if peer is not None and peer.model(model) is not None:
        return Route(Kind.PEER, host, f"{model}@{host}: named")
    return Route(Kind.NONE, None, f"no gateway {host!r} of this cluster serves model {model!r}")


class _ClusterLoad:
    """What a request waiting for the cluster's load of a model sees (:class:`_Wait`)."""

    def __init__(self, cluster: Cluster, model: str) -> None:
        self.cluster = cluster
        self.model = model
        self.clock = cluster.clock

    def waiting_for(self) -> str:
        return f"{self.model}: {self.cluster.load_waiting(self.model)}"

    async def changed(self) -> None:
        await self.cluster.changed()


def _model_priority(app: GatewayApp, cluster: Cluster, model: str) -> int:
    """The model's own priority: this gateway's config, else the peers' reports."""
    if model in app.models:
        return app.models[model].config.priority
    for peer in cluster.peers.values():
        found = peer.model(model)
        if found is not None:
            return int(found.get("priority") or 500)
    return 500


def _with_hosts(
    entries: list[dict[str, Any]], cluster: Cluster, created: int
) -> list[dict[str, Any]]:
    """The models of the whole cluster: each of this gateway's with the gateways that
    serve it (``hosts``: each one's state and requests in flight), and those only
    other gateways serve as entries of their own."""
    by_id = {e["id"]: e for e in entries if "alias_of" not in e}
    for peer in sorted(cluster.peers.values(), key=lambda p: p.name):
        for model_id, model in peer.models.items():
            there = {"gateway": peer.name, "worker": peer.worker, "state": model.get("state"),
                     "in_flight": model.get("in_flight", 0), "routable": peer.routable}  # fmt: skip
            entry = by_id.get(model_id)
            if entry is None:
                entry = {"id": model_id, "object": "model", "created": created,
                         "owned_by": "gpu-arbiter", "state": model.get("state"),
                         "aliases": list(model.get("aliases") or ()), "hosts": []}  # fmt: skip
                by_id[model_id] = entry
                entries.append(entry)
                for alias in entry["aliases"]:
                    entries.append({"id": alias, "object": "model", "created": created,
                                    "owned_by": "gpu-arbiter", "alias_of": model_id})  # fmt: skip
            entry.setdefault("hosts", []).append(there)
    for model_id, entry in by_id.items():
        if model_id in cluster.routes and cluster.routes[model_id] == model_id:
            local = {"gateway": cluster.name, "worker": cluster.worker, "state": entry.get("state"),
                     "in_flight": entry.get("in_flight", 0), "routable": True}  # fmt: skip
            entry["hosts"] = [local, *entry.get("hosts", [])]
    return entries


async def _multipart_model(
    receive: Receive, headers: Mapping[bytes, str], held: HeldBody
) -> str | None:
    """Holds a multipart body up to the end of its ``model`` field (the rest streams)."""
    boundary = boundary_of(headers.get(b"content-type", ""))
    if boundary is None:
        return None
    scan = MultipartModel(boundary)
    name = None
    while name is None and held.more and not scan.malformed:
        await held.read(receive)
        name = scan.feed(held.data)
    return name


async def _scan(body: bytearray) -> str | None:
    if len(body) > SCAN_IN_THREAD_BYTES:
        return await asyncio.to_thread(json_model, body)
    return json_model(body)


async def _chain(
    held: bytearray, rest: AsyncIterator[bytes], read: asyncio.Event
) -> AsyncIterator[bytes | bytearray]:
    """The held part of a body, then the rest; ``read`` is set once it has all been read."""
    try:
        if held:
            yield held
        async for chunk in rest:
            yield chunk
    finally:
        read.set()


def _to_a_model(method: str, path: str) -> bool:
    """Whether a request is routed to a model (refused while the gateway stops)."""
    return (path.startswith("/v1/") and method == "POST") or path.startswith("/models/")


def _is_event_stream(headers: Headers) -> bool:
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() == b"text/event-stream"
    return False


def _media_type(headers: Mapping[bytes, str]) -> str:
    return headers.get(b"content-type", "").partition(";")[0].strip().lower()


def _declared_length(headers: Mapping[bytes, str]) -> int:
    """The ``Content-Length`` the client declared; -1 when none (uvicorn checked it)."""
    value = headers.get(b"content-length", "")
    return int(value) if value.isdigit() else -1


def _raw_path(scope: Scope) -> bytes:
    raw: bytes | None = scope.get("raw_path")
    return raw if raw else quote(scope["path"]).encode()


def _target(scope: Scope, path: bytes) -> bytes:
    """The request target for the model server: the path as the client sent it
    (percent-encoded), and its query."""
    query: bytes = scope.get("query_string") or b""
    return path + b"?" + query if query else path


async def _acquire(
    model: ModelServer,
    receive: Receive,
    outbound: _Outbound,
    wait: _Wait,
    priority: int | None,
    cancel: CancelScope,
) -> tuple[Replica, float] | None:
    """A replica for the request; None when the client went away while it queued (its
    held body is then given back at once, not after ``queue_timeout``); :class:`Refused`
    (503) when the gateway stops meanwhile (``cancel`` cancelled with :data:`STOPPING`).
    A streamed body not read yet is the client's to send: its disconnect is seen by the
    relay. The comment lines of ``wait`` (if any) have ended when it returns."""
    watcher = None
    if outbound.body_read is None:  # JSON held whole: comment lines while it waits
        watcher = asyncio.ensure_future(_watch_disconnect(receive, cancel, _Exchange(), None))
    try:
        async with cancel:
            return await model.acquire(wait.began if watcher else None, priority)
        if cancel.reason == STOPPING:
            raise Refused(503, f"{STOPPING}: model {model.name} takes no new requests", 1.0)
        return None
    finally:
        if watcher is not None:
            watcher.cancel()
        await wait.end()


class _Wait:
    """A request's wait for a replica, as its caller sees it. A streaming one (a JSON
    body with ``"stream": true``) that has to wait gets its answer's head at once (200,
    ``text/event-stream``, ``x-queued: true``: nothing later can change it), then an SSE
    comment line saying why: at once, on each change (``queued, position 1: ...``, then
    ``loading chat``) and every ``HEARTBEAT_S`` between. A request with a slot free is
    not touched: the body is scanned for ``stream`` only once the wait begins."""

    def __init__(
        self,
        model: ModelServer | _ClusterLoad,
        send: Send,
        json_body: bytearray | None,
        *,
        head_sent: bool = False,
    ) -> None:
        """``head_sent``: the head went out already, while it waited for something else
        (the cluster's load): only comment lines from here."""
        self.model = model
        self.send = send
        self.json_body = json_body
        self.clock = model.clock  # the model's: its waits run on a virtual one in tests
        self.started = self.clock.now()
        self.head_sent = head_sent
        self._over = asyncio.Event()
        self._beats: asyncio.Future[None] | None = None

    def began(self) -> None:
        """``acquire``'s ``on_wait``: the request has to wait."""
        if self.json_body is not None:
            self._beats = asyncio.ensure_future(self._beat(self.json_body))

    def waited_s(self) -> float:
        return self.clock.now() - self.started

    async def end(self) -> None:
        """Stops the comment lines; one being sent goes out whole."""
        self._over.set()
        if self._beats is not None:
            await self._beats

    def sender(self) -> Send:
        """How the rest of the answer is sent: as it is, or after the head went out, as
        the rest of an event stream (:class:`_AfterHead`)."""
        return _AfterHead(self.send) if self.head_sent else self.send

    async def comment(self, text: str) -> None:
        line = f": {text}\n\n".encode()
        await self.send({"type": "http.response.body", "body": line, "more_body": True})

    async def _beat(self, json_body: bytearray) -> None:
        if not await _streams(json_body) or self._over.is_set():
            return
        if not self.head_sent:
            await self.send({"type": "http.response.start", "status": 200, "headers": _SSE_HEAD})
            self.head_sent = True
        said, beat_at = "", 0.0
        while not self._over.is_set():
            now = self.clock.now()
            text = self.model.waiting_for()
            if text != said or now >= beat_at:
                await self.comment(f"{text} ({self.waited_s():.1f}s)")
                said, beat_at = text, now + HEARTBEAT_S
            waits = self.clock.sleep(beat_at - now), self.model.changed(), self._over.wait()
            await first(*waits)


class _AfterHead:
    """Sends the rest of an answer whose head (200, an event stream) went out while the
    request waited: the model server's 200 streams on as it comes, its head dropped;
    any other answer (the model server's or the gateway's own error) becomes one SSE
    ``data:`` event in OpenAI's error shape, its status in it, and the stream ends."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.status = 0
        self.error = bytearray()

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            served = dict(message.get("headers") or ()).get(b"x-served-by")
            if served and self.status == 200:  # its head is gone: a comment line says it
                line = b": served by " + served + b"\n\n"
                await self.send({"type": "http.response.body", "body": line, "more_body": True})
        elif self.status == 200:
            await self.send(message)
        else:
            body: bytes = message.get("body", b"")
            self.error += body[: MAX_ERROR_BYTES - len(self.error)]
            if not message.get("more_body"):
                event = b"data: " + json.dumps(_error_event(self.status, self.error)).encode()
                await self.send({"type": "http.response.body", "body": event + b"\n\n"})


def _error_event(status: int, body: bytes | bytearray) -> dict[str, Any]:
    """An error answer as OpenAI's error object, with its ``status``: the body when it
    is one already, else the body's text in one."""
    try:
        found = json.loads(body)
    except ValueError:
        found = None
    if isinstance(found, dict) and isinstance(found.get("error"), dict):
        return {"error": {**found["error"], "status": status}}
    text = bytes(body).decode("utf-8", "replace")[:1000]
    kind = "invalid_request_error" if status < 500 else "server_error"
    message = f"the model server answered {status}: {text}"
    return {"error": {"message": message, "type": kind, "code": "model_error", "status": status}}


async def _streams(json_body: bytearray) -> bool:
    if len(json_body) > SCAN_IN_THREAD_BYTES:
        return await asyncio.to_thread(json_true, json_body, "stream")
    return json_true(json_body, "stream")


async def _refused(send: Send, refused: Refused, waited_s: float) -> None:
    code = "model_failed" if refused.status == 502 else "unavailable"
    queued = [(b"x-queue-seconds", f"{waited_s:.3f}".encode())]
    await _error(send, refused.status, refused.reason, code, refused.retry_after_s, queued)


async def _watch_disconnect(
    receive: Receive, relay: CancelScope, exchange: _Exchange, after: asyncio.Event | None
) -> None:
    """Cancels the relay's scope when the client goes away; with a streamed body, only
    once it has all been read (until then, reading it is how a disconnect is seen)."""
    if after is not None:
        await after.wait()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not exchange.done:
                exchange.gone = True
                relay.cancel("the client went away")
            return


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _send(send: Send, status: int, body: bytes, content_type: bytes, extra: Any = ()) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    headers += list(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, status: int, value: Any, extra: Any = ()) -> None:
    await _send(send, status, json.dumps(value).encode(), b"application/json", extra)


async def _error(
    send: Send,
    status: int,
    message: str,
    code: str,
    retry_after_s: float | None = None,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """An error in OpenAI's shape. Sent before the client's body has all come, the
    connection stays open: uvicorn reads the rest and drops it (holding none of it),
    as closing with unread bytes would reset the connection, the answer with it."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    extra = list(headers)
    if retry_after_s is not None:
        extra.append((b"retry-after", str(max(1, round(retry_after_s))).encode()))
    body = {"error": {"message": message, "type": kind, "code": code}}
    await _json(send, status, body, extra)
