"""The gateway's HTTP side: a plain ASGI app (no router: one dict lookup per request).

    POST /v1/...              the model named by the JSON body's ``model`` (or an alias)
    ANY  /models/{name}/...   any HTTP server, by prefix (the prefix is taken off)
    GET  /v1/models           the configured models with their state
    GET  /metrics, /healthz

Responses stream through as they come (server-sent events, chunked bodies): each
chunk the model server sends is passed on at once. A client that disconnects
cancels the request to the model server (its connection is closed).

Errors have OpenAI's shape, ``{"error": {"message", "type", "code"}}``: 404 for an
unknown model (naming the known ones), 503 with ``Retry-After`` when no replica was
ready within ``queue_timeout``, or when its replica was stopped (revoked, preempted,
the gateway stopping) before the request could finish within the model's ``grace``,
502 when the model server failed, 413 for a body over 64 MiB. An answer already
streaming when its replica stops ends early.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any
from urllib.parse import quote

import httptools
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .metrics import GatewayMetrics
from .model import ModelServer, Refused
from .replica import Replica
from .upstream import UpstreamError

__all__ = ["GatewayApp"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
MAX_BODY_BYTES = 64 * 1024 * 1024
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
_STOPPED = frozenset({"preempted", "reclaimed", "revoked", "shutdown", "keep_alive"})


class _ClientGone(Exception):
    """The client went away before its request's body had arrived."""


class _Exchange:
    """One relayed request: the status sent (0 while none was), whether it is over,
    and whether its client went away."""

    __slots__ = ("done", "gone", "status")

    def __init__(self) -> None:
        self.status = 0
        self.done = False
        self.gone = False


class GatewayApp:
    def __init__(
        self, models: Mapping[str, ModelServer], routes: Mapping[str, str], metrics: GatewayMetrics
    ) -> None:
        self.models = models
        self.routes = routes  # a model's name and aliases -> its name
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        with contextlib.suppress(_ClientGone):
            await self._http(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        if path.startswith("/v1/") and method == "POST":
            await self._openai(scope, receive, send)
        elif path.startswith("/models/"):
            name = path[len("/models/") :].partition("/")[0]
            rest = _raw_path(scope)[len("/models/") :].partition(b"/")[2]
            await self._route(scope, receive, send, name, _target(scope, b"/" + rest))
        elif path == "/v1/models" and method == "GET":
            data = [model.describe() for model in self.models.values()]
            await _json(send, 200, {"object": "list", "data": data})
        elif path == "/metrics":
            body = generate_latest(self.metrics.registry)
            await _send(send, 200, body, CONTENT_TYPE_LATEST.encode())
        elif path == "/healthz":
            await _json(send, 200, {"ok": True})
        else:
            await _error(send, 404, f"no route {method} {path}", "not_found")

    async def _openai(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _body(receive)
        if body is None:
            await _error(send, 413, "the body is over 64 MiB", "too_large")
            return
        try:
            name = json.loads(body).get("model")
        except (ValueError, AttributeError):
            name = None
        if not isinstance(name, str):
            await _error(send, 400, "the body must be a JSON object naming a model", "no_model")
            return
        await self._route(scope, receive, send, name, _target(scope, _raw_path(scope)), body)

    async def _route(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        name: str,
        target: bytes,
        body: bytes | None = None,
    ) -> None:
        found = self.routes.get(name)
        if found is None:
            known = ", ".join(sorted(self.models))
            await _error(send, 404, f"model {name!r} is not known; known: {known}", "not_found")
            return
        model = self.models[found]
        if body is None:
            body = await _body(receive)
            if body is None:
                await _error(send, 413, "the body is over 64 MiB", "too_large")
                return
        try:
            replica, queued_s = await model.acquire()
        except Refused as refused:
            self.metrics.requests.labels(found, str(refused.status)).inc()
            await _error(send, refused.status, refused.reason, "unavailable", refused.retry_after_s)
            return
        self.metrics.queue_seconds.labels(found).observe(queued_s)
        gauge = self.metrics.in_flight.labels(found)
        gauge.inc()
        try:
            status = await self._forward(scope, receive, send, replica, target, body)
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
        target: bytes,
        body: bytes,
    ) -> int:
        """Relays the request; the status sent (0 when the client went away)."""
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        relay = asyncio.current_task()
        assert relay is not None
        exchange = _Exchange()
        watcher = asyncio.ensure_future(_watch_disconnect(receive, relay, exchange))
        replica.relays.add(relay)
        try:
            await self._relay(send, scope["method"], target, headers, body, replica, exchange)
        except asyncio.CancelledError:
            if not (exchange.gone or replica.cut):
                raise
            relay.uncancel()
            if exchange.gone:
                return 0
            if not exchange.status:  # cut off before its answer began: say why
                exchange.status = await self._stopped(send, replica)
        finally:
            replica.relays.discard(relay)
            exchange.done = True
            watcher.cancel()
        return exchange.status

    async def _relay(
        self,
        send: Send,
        method: str,
        target: bytes,
        headers: Headers,
        body: bytes,
        replica: Replica,
        exchange: _Exchange,
    ) -> None:
        try:
            answer = await replica.upstream.request(method, target, headers, body)
        except UpstreamError as error:
            exchange.status = await self._failed(send, replica, error)
            return
        try:
            kept = [(k, v) for k, v in answer.headers if k.lower() not in _HOP_OUT]
            await send({"type": "http.response.start", "status": answer.status, "headers": kept})
            exchange.status = answer.status
            more = True
            while more:  # the last bytes go with the end: one write less
                chunk = await answer.read()
                more = not answer.ended
                await send({"type": "http.response.body", "body": chunk, "more_body": more})
        except (OSError, httptools.HttpParserError):
            pass  # cut mid-body: the client sees the stream end early, as the server did
        finally:
            answer.close()

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

    async def _failed(self, send: Send, replica: Replica, error: Exception) -> int:
        with contextlib.suppress(TimeoutError):  # did the server exit? Then say why.
            await asyncio.wait_for(replica.exited.wait(), 1.0)
        ending = replica.ending
        if ending is not None and ending.kind in _STOPPED:
            status, reason = 503, f"model {replica.model.name} stopped: {ending.reason}"
            await _error(send, status, reason, "unavailable", 1.0)
            return status
        why = ending.reason if ending is not None else f"{error.__class__.__name__} {error}"
        await _error(send, 502, f"model server {replica.model.name} failed: {why}", "bad_gateway")
        return 502


def _raw_path(scope: Scope) -> bytes:
    raw: bytes | None = scope.get("raw_path")
    return raw if raw else quote(scope["path"]).encode()


def _target(scope: Scope, path: bytes) -> bytes:
    """The request target for the model server: the path as the client sent it
    (percent-encoded), and its query."""
    query: bytes = scope.get("query_string") or b""
    return path + b"?" + query if query else path


async def _watch_disconnect(
    receive: Receive, relay: asyncio.Task[Any], exchange: _Exchange
) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not exchange.done:
                exchange.gone = True
                relay.cancel()
            return


async def _body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


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
    send: Send, status: int, message: str, code: str, retry_after_s: float | None = None
) -> None:
    kind = "invalid_request_error" if status < 500 else "server_error"
    extra = []
    if retry_after_s is not None:
        extra.append((b"retry-after", str(max(1, round(retry_after_s))).encode()))
    body = {"error": {"message": message, "type": kind, "code": code}}
    await _json(send, status, body, extra)
