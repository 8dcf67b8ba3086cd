"""A request relayed, to a replica of this gateway (:func:`to_replica`) or to a peer
gateway (:func:`to_peer`), both one :func:`exchange`: the request goes to the upstream
as it comes and its answer back as it comes, in a cancel scope that the client's
disconnect (watched from :data:`WATCH_AFTER_S` into the exchange on), a replica's cut
at the end of its grace or the gateway's stop cancel. What is said when it ends short
is each one's own:

    to a replica  cut before its answer: 503 naming why the replica stopped; an event
                  stream cut short: its final error event, 503 (a stop: the ending's
                  status) or 502 (the server cut it); the server unreachable: as its
                  ending says (``EndKind.status``), else 502
    to a peer     unreachable: nothing was sent, the front door may go elsewhere; failed
                  after that: 502, never sent again; cut by the stop: 503 (or the
                  stream's final error event); a stream the peer cut short: 502 event;
                  cut because the peer fell silent (``cluster/liveness.py``): 504
                  naming it (or the stream's final error event), never sent again

An answer cut short that is not an event stream ends with its connection, short of its
length. 0 for a client that went away: nothing more is sent to it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import httptools

from ...peer_identity import Relayed
from ..base.race import running_if_waiting, within
from ..base.scopes import CancelScope
from ..base.upstream import NotConnected, Upstream, UpstreamError
from ..cluster.cluster import UNRESPONSIVE, Cluster
from ..servers.replica import Replica
from .access import Access
from .answers import STOPPING, Headers, Receive, Send, send_error, send_final_error
from .bodies import TooLarge
from .renamed import HELD_MAX, Events, named_already, renamed
from .request import LEASE, PEER, PRIORITY, Request

log = logging.getLogger(__name__)

__all__ = [
    "CUT_FORWARDS_S",
    "Exchange",
    "Forwards",
    "Relaying",
    "exchange",
    "to_peer",
    "to_replica",
]

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
_PEER_HEADERS = frozenset({PEER, PRIORITY, LEASE, b"x-arbiter-via"})
"""What a peer's word says: never passed on as it came (to a peer, this gateway's own
are sent; to a model server, none: a peer's header is nobody else's to read)."""
_HOP_TO_PEER = _HOP | _PEER_HEADERS | {b"authorization"}
_HOP_TO_OUR_SERVER = _HOP | _PEER_HEADERS | {b"authorization"}  # with keys, the key is ours
_HOP_TO_OPEN_SERVER = _HOP | _PEER_HEADERS
CUT_FORWARDS_S = 1.0
"""At the stop, after the grace: how long the relays cut then may take to say so."""
WATCH_AFTER_S = 0.02
"""A relay watches its client's disconnect from this long into the exchange on: an
answer that came sooner cost no watcher (a task, and the loop's turns to end it), and
a client gone before then is seen then."""
Failed = Callable[[Send, UpstreamError], Awaitable[int | None]]
"""What a relay says when its upstream fails before answering: the status sent, or None
when nothing of the request left (it may go elsewhere)."""


class Relaying(Protocol):
    """What a relay reads of the gateway (``app.GatewayApp``)."""

    access: Access
    cluster: Cluster | None
    name: str
    forwards: Forwards

    async def too_large(self, send: Send) -> None: ...


class Exchange:
    """One relayed request: the status sent (0 while none was), whether it is over,
    whether its client went away, whether the answer is an event stream, whether its
    body was sent to its end, and whether nothing of the request left (``unsent``)."""

    __slots__ = ("done", "ended", "event_stream", "gone", "status", "unsent")

    def __init__(self) -> None:
        self.status = 0
        self.done = False
        self.gone = False
        self.event_stream = False
        self.ended = False
        self.unsent = False


class Forwards:
    """The requests this front door relays to other gateways, for the stop."""

    def __init__(self) -> None:
        self.scopes: set[CancelScope] = set()
        self.done = asyncio.Event()
        self.done.set()

    def add(self, scope: CancelScope) -> None:
        self.scopes.add(scope)
        self.done.clear()

    def discard(self, scope: CancelScope) -> None:
        self.scopes.discard(scope)
        if not self.scopes:
            self.done.set()

    async def settle(self, grace_s: float) -> None:
        """``grace_s`` to finish; then those still running are cut (:data:`STOPPING`)
        and get :data:`CUT_FORWARDS_S` to say so."""
        await within(self.done, grace_s)
        for forward in set(self.scopes):
            forward.cancel(STOPPING)
        await within(self.done, CUT_FORWARDS_S)


async def exchange(
    request: Request,
    send: Send,
    upstream: Upstream,
    headers: Headers,
    extra: Headers,
    cancel: CancelScope,
    failed: Failed,
    too_large: Callable[[Send], Awaitable[None]],
    rename: str | None = None,
    target: bytes | None = None,
) -> Exchange:
    """Relays ``request`` (its headers: ``headers``) to ``upstream`` inside ``cancel``,
    the client's disconnect watched meanwhile (from :data:`WATCH_AFTER_S` on), and its
    answer back with ``extra``
    headers added (and its ``model`` renamed ``rename``, if given: ``renamed.py``). A
    streamed body over the limit before any answer is a 413. ``target``: the request
    target sent (None: the model server's, ``request.body.target``; a peer gets the one
    the caller sent, ``/models/{name}/...`` whole)."""
    outbound = request.body
    done = Exchange()
    receive, read = request.receive, outbound.body_read
    watcher = running_if_waiting(
        lambda: watch_disconnect(receive, cancel, done, read), WATCH_AFTER_S
    )
    async with watcher:
        try:
            async with cancel:
                try:
                    answer = await upstream.request(
                        request.method,
                        outbound.target if target is None else target,
                        headers,
                        outbound.body,
                        outbound.length,
                    )
                except UpstreamError as error:
                    status = await failed(send, error)
                    done.status, done.unsent = status or 0, status is None
                else:
                    await pass_on(send, answer, done, extra, rename)
        except TooLarge:  # a streamed body went over the limit before any answer
            await too_large(send)
            done.status = 413
        finally:
            done.done = True
    return done


async def to_replica(
    app: Relaying, request: Request, send: Send, replica: Replica, extra: Headers
) -> int:
    """Relays the request to ``replica``, ``extra`` headers added to the answer's; the
    status sent (0 when the client went away). The answer to a JSON request names the
    model as the request did (``renamed.py``): at the gateway that serves it, so that
    every front door passes it on as it is."""
    drop = _HOP_TO_OUR_SERVER if app.access.auth else _HOP_TO_OPEN_SERVER
    headers = [(k, v) for k, v in request.raw_headers if k.lower() not in drop]
    cancel = CancelScope()  # by the replica's cut, or by the client's disconnect
    replica.relays.add(cancel)
    failed = functools.partial(_failed, replica)
    rename = request.model if request.json_body is not None and request.model else None
    try:
        done = await exchange(
            request, send, replica.upstream, headers, extra, cancel, failed, app.too_large, rename
        )
    finally:
        replica.relay_ended(cancel)
    if done.gone:
        return 0
    if cancel.cancelled_caught and not done.status:  # cut before its answer began
        return await _stopped(send, replica)
    if done.status and done.event_stream and not done.ended:
        await _stream_cut(send, replica, cut=cancel.cancelled_caught)
    return done.status


async def to_peer(
    app: Relaying,
    request: Request,
    send: Send,
    gateway: str,
    model: str,
    lease_id: str | None,
) -> int | None:
    """Relays the request to gateway ``gateway`` as it comes and its answer as it
    comes; the status sent (0: the client went away), or None when the peer could
    not be reached (nothing of the request left: it may go elsewhere). Once the body
    has left it is never sent again; an answer cut short is the caller's, with a
    final error event on an event stream."""
    cluster = app.cluster
    assert cluster is not None
    peer = cluster.peers.get(gateway)
    if peer is None:
        return None
    headers = [(k, v) for k, v in request.raw_headers if k.lower() not in _HOP_TO_PEER]
    priority = "" if request.priority is None else str(request.priority)
    # the target as the caller sent it: a model server's (request.body.target) lacks the
    # /models/{name} of a prefix route, which the peer needs to find the model
    target = request.target(request.raw_path())
    relayed = Relayed(request.method, target, priority, lease_id or "")
    signed = cluster.sign(gateway, relayed)
    if signed is None:  # the view shows no key of it: no header can be made for it
        cluster.peer_down(gateway, "showed no public key in the view", said=True)
        return None
    headers.append((PEER, signed.encode()))
    if priority:
        headers.append((PRIORITY, priority.encode()))
    if lease_id is not None:
        headers.append((LEASE, lease_id.encode()))
    failed = functools.partial(_peer_failed, cluster, gateway, model)
    cancel, key = CancelScope(), (gateway, model)
    cluster.forwarding[key] += 1
    app.forwards.add(cancel)
    try:
        with cluster.relaying(gateway, cancel):
            done = await exchange(
                request,
                send,
                peer.upstream,
                headers,
                [],
                cancel,
                failed,
                app.too_large,
                target=target,
            )
    finally:
        cluster.forwarding[key] -= 1
        if cluster.forwarding[key] <= 0:
            del cluster.forwarding[key]
        app.forwards.discard(cancel)
    if done.unsent:
        return None
    if cancel.cancelled_caught and cancel.reason == UNRESPONSIVE and not done.gone:
        return await _silent(send, done, cluster, gateway, model)
    return await _forward_ended(send, done, cancel, f"{model} from {cluster.host_name(gateway)}")


async def pass_on(
    send: Send, answer: Any, done: Exchange, extra: Sequence[Any], rename: str | None = None
) -> None:
    """Sends an answer on as it comes, ``extra`` headers added, its ``model`` renamed
    ``rename`` when given (a JSON answer that says its length is held whole for that, an
    event stream renamed line by line: ``renamed.py``); a body cut short ends the answer
    short (an event stream's final event is the caller's to add)."""
    kept = [(k, v) for k, v in answer.headers if k.lower() not in _HOP_OUT]
    kept += extra
    head = kept  # as it came: for an answer cut while it was held
    done.event_stream = _is_event_stream(answer.headers)
    ok = 200 <= answer.status < 300
    events = Events(rename) if rename is not None and ok and done.event_stream else None
    held: bytes | None = None
    try:
        if rename is not None and ok and _holdable(answer.headers):
            held = await _read_all(answer)
            body = None if named_already(held, rename) else renamed(held, rename)
            if body is not None:
                held = body
                kept = [(k, v) for k, v in kept if k.lower() != b"content-length"]
                kept.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": answer.status, "headers": kept})
        done.status = answer.status
        if held is not None:
            await send({"type": "http.response.body", "body": held, "more_body": False})
            done.ended = True
            return
        more = True
        while more:  # the last bytes go with the end: one write less
            chunk = await answer.read()
            more = not answer.ended
            if events is not None:
                chunk = events.feed(chunk) + (b"" if more else events.end())
                if more and not chunk:
                    continue
            await send({"type": "http.response.body", "body": chunk, "more_body": more})
        done.ended = True
    except (OSError, httptools.HttpParserError):
        # cut mid-body: an event stream's final event says so, any other ends short (one
        # cut while it was held: its head as it came, and no body)
        if not done.status:
            with contextlib.suppress(OSError):
                await send(
                    {"type": "http.response.start", "status": answer.status, "headers": head}
                )
                done.status = answer.status
    finally:
        answer.close()


def _holdable(headers: Headers) -> bool:
    """Whether an answer is JSON that says its length, at most :data:`HELD_MAX` bytes."""
    json_type = length = False
    for name, value in headers:
        name = name.lower()
        if name == b"content-type":
            json_type = value.split(b";")[0].strip().lower() == b"application/json"
        elif name == b"content-length":
            length = value.strip().isdigit() and int(value) <= HELD_MAX
    return json_type and length


async def _read_all(answer: Any) -> bytes:
    """All of an answer's body (it said its length)."""
    parts = []
    while not answer.ended:
        chunk = await answer.read()
        if not chunk and not answer.ended:
            raise OSError("the answer ended short of its length")
        parts.append(chunk)
    return b"".join(parts)


async def watch_disconnect(
    receive: Receive, relay: CancelScope, done: Exchange, after: asyncio.Event | None
) -> None:
    """Cancels the relay's scope when the client goes away; with a streamed body, only
    once it has all been read (until then, reading it is how a disconnect is seen)."""
    if after is not None:
        await after.wait()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not done.done:
                done.gone = True
                relay.cancel("the client went away")
            return


def _is_event_stream(headers: Headers) -> bool:
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() == b"text/event-stream"
    return False


async def _stopped(send: Send, replica: Replica) -> int:
    """503 for a request the replica's stop cut off at the end of its grace."""
    ending = replica.ending
    why = ending.reason if ending is not None else "stopped"
    grace_s = replica.model.config.grace_s
    reason = (
        f"model {replica.model.name} stopped: {why}; the request did not finish "
        f"within its {grace_s:g}s grace"
    )
    await send_error(send, 503, reason, "unavailable", 1.0)
    return 503


async def _stream_cut(send: Send, replica: Replica, *, cut: bool) -> None:
    """Ends an event stream cut short with a final error event: 503 when its replica
    stopped (``cut``: at the end of the grace), else 502 (the server cut it)."""
    ending, name = replica.ending, replica.model.name
    if cut:
        grace_s = replica.model.config.grace_s
        why = ending.reason if ending is not None else "stopped"
        status, code = 503, "unavailable"
        message = (
            f"model {name} stopped: {why}; the answer did not finish within its {grace_s:g}s grace"
        )
    elif ending is not None and ending.kind.status == 503:
        status, code = 503, "unavailable"
        message = f"model {name} stopped: {ending.reason}; the answer ended early"
    else:
        status, code = 502, "model_failed"
        why = ending.reason if ending is not None else "it ended the answer early"
        message = f"model server {name} failed: {why}"
    await send_final_error(send, status, message, code)


async def _failed(replica: Replica, send: Send, error: UpstreamError) -> int:
    """The replica's server could not be reached, or failed before answering: 503 when
    its replica was stopped (a stop's ending), else 502 naming why."""
    await within(replica.exited, 1.0)  # did the server exit? Then say why.
    ending, name = replica.ending, replica.model.name
    if ending is not None and ending.kind.status == 503:
        reason = f"model {name} stopped: {ending.reason}"
        await send_error(send, 503, reason, "unavailable", 1.0)
        return 503
    why = ending.reason if ending is not None else f"{error.__class__.__name__} {error}"
    await send_error(send, 502, f"model server {name} failed: {why}", "model_failed")
    return 502


async def _peer_failed(
    cluster: Cluster, gateway: str, model: str, send: Send, error: UpstreamError
) -> int | None:
    """Gateway ``gateway`` could not be reached (None: nothing of the request left, the
    peer is left out of routing a while), or failed before answering (502: the request
    is never sent again)."""
    if isinstance(error, NotConnected):
        cluster.peer_down(gateway, str(error))
        return None
    message = (
        f"gateway {cluster.host_name(gateway)} failed before answering for {model}: {error}; "
        "the request is not sent again"
    )
    await send_error(send, 502, message, "peer_failed")
    return 502


async def _silent(send: Send, done: Exchange, cluster: Cluster, gateway: str, model: str) -> int:
    """A relay cut because its gateway fell silent (``cluster/liveness.py``): a 504
    naming it (an event stream begun: its final error event; any other answer begun
    ends short); never sent again, its body having left."""
    why = cluster.liveness.why(gateway) or UNRESPONSIVE
    message = (
        f"gateway {cluster.host_name(gateway)} {why}: {model} did not finish there; "
        "the request is not sent again"
    )
    if not done.status:
        await send_error(send, 504, message, "peer_unresponsive")
        return 504
    if done.event_stream and not done.ended:
        await send_final_error(send, 504, message, "peer_unresponsive")
    return done.status


async def _forward_ended(send: Send, done: Exchange, cancel: CancelScope, what: str) -> int:
    """The end of a relay to another gateway (``what``: the model and that gateway): the
    status sent; a relay the stop cut off is a 503 (or its event stream's final error
    event), one cut short by the other gateway a 502 event; 0 when the client went away."""
    if done.gone:
        return 0
    stopped = cancel.cancelled_caught and cancel.reason == STOPPING
    if stopped and not done.status:
        message = f"{STOPPING}: {what} did not answer in time"
        await send_error(send, 503, message, "unavailable", 1.0)
        return 503
    if done.status and done.event_stream and not done.ended:
        if stopped:
            message = f"{STOPPING}: the answer of {what} did not finish in time"
            await send_final_error(send, 503, message, "unavailable")
        else:
            await send_final_error(send, 502, f"the answer of {what} was cut short", "peer_failed")
    return done.status
