"""One HTTP request as the gateway knows it (as Starlette's and httpx's ``Request``):
built once at the ASGI entry, with what every step after reads: the method and path,
the headers as sent and by lower-case name, which peer gateway sent it (its signed
header verified once), the caller's key and priority; then, once the route found
them, the model it names and its body (:class:`Outbound`: what goes to the model server,
read once)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import quote

from ...peer_identity import HEADER, Refusal, Relayed
from ..base.upstream import Body
from .access import Access, ApiKey
from .answers import Headers, Receive, Scope, Send

__all__ = ["LEASE", "PEER", "PRIORITY", "Outbound", "Request", "chain", "declared_length"]

PEER = HEADER.encode()
"""The header a relaying gateway signs (``peer_identity.py``: who sent it, for which
gateway, when, for which method and target); with it verified, on a model's route only,
``x-arbiter-lease`` is believed, and ``x-arbiter-priority`` up to the highest priority a
key of this gateway gives (:attr:`Access.max_priority`)."""
PRIORITY = b"x-arbiter-priority"
LEASE = b"x-arbiter-lease"
Verify = Callable[[str, Relayed], "str | Refusal"]
"""A peer's header and what it relays -> the sender it proves, or why not."""


@dataclass(slots=True)
class Outbound:
    """What goes to the model server: the target, the body (held bytes, or chunks as
    the client sends them) and its length when known. ``body_read`` is set once a
    streamed body has all been read: only then may anyone else wait on the client."""

    target: bytes
    body: Body
    length: int | None = None
    body_read: asyncio.Event | None = None


@dataclass(slots=True)
class Request:
    """A request to the gateway. ``peer``: the peer gateway that relayed it, its signed
    header verified (None: no peer, or one refused); ``peer_refused``: why a peer header
    it carries was not taken (None: none, or taken). ``key``: the caller's API key, if
    any; ``priority``: the one its key (or, from a peer, its front door) gives it (None:
    the model's). ``model``,
    ``outbound`` and ``json_body`` (a JSON body held whole: it may ask for a stream)
    are set once the body named the model."""

    scope: Scope
    receive: Receive
    send: Send
    method: str
    path: str
    raw_headers: Headers
    headers: Mapping[bytes, str]
    peer: str | None
    peer_refused: Refusal | None
    key: ApiKey | None
    priority: int | None
    model: str = ""
    outbound: Outbound | None = None
    json_body: bytearray | None = None

    @classmethod
    def build(
        cls,
        scope: Scope,
        receive: Receive,
        send: Send,
        access: Access,
        verify: Verify,
    ) -> Request:
        """The request ``scope`` describes; ``verify``: the sender a peer's header proves,
        or why not (asked once, only when the request carries one)."""
        raw: Headers = scope["headers"]
        headers = {name.lower(): value.decode("latin-1") for name, value in raw}
        method, path = scope["method"], scope["path"]
        signed = headers.get(PEER)
        peer, refused = None, None
        if signed is not None:
            target = _target(scope)
            relayed = Relayed(method, target, headers.get(PRIORITY, ""), headers.get(LEASE, ""))
            verdict = verify(signed, relayed)
            peer, refused = (verdict, None) if isinstance(verdict, str) else (None, verdict)
        key = access.key_of(headers) if access.auth else None  # no keys: none matches
        if peer:
            given = headers.get(PRIORITY, "")
            priority = int(given) if given.isdigit() and int(given) <= 1000 else None
            cap = access.max_priority
            priority = None if priority is None or cap is None else min(priority, cap)
        else:
            priority = None if key is None else key.priority
        return cls(scope, receive, send, method, path, raw, headers, peer, refused, key, priority)

    @property
    def body(self) -> Outbound:
        """What goes to the model server (once the route read what it needed of it)."""
        assert self.outbound is not None
        return self.outbound

    def raw_path(self) -> bytes:
        return _raw_path(self.scope)

    def target(self, path: bytes) -> bytes:
        """The request target for the model server: ``path`` as the client sent it
        (percent-encoded), and its query."""
        query: bytes = self.scope.get("query_string") or b""
        return path + b"?" + query if query else path

    def media_type(self) -> str:
        return self.headers.get(b"content-type", "").partition(";")[0].strip().lower()


def _raw_path(scope: Scope) -> bytes:
    raw: bytes | None = scope.get("raw_path")
    return raw if raw else quote(scope["path"]).encode()


def _target(scope: Scope) -> bytes:
    """The request's target as it came (path and query): what a peer signed."""
    query: bytes = scope.get("query_string") or b""
    path = _raw_path(scope)
    return path + b"?" + query if query else path


def declared_length(headers: Mapping[bytes, str]) -> int:
    """The ``Content-Length`` the client declared; -1 when none (uvicorn checked it)."""
    value = headers.get(b"content-length", "")
    return int(value) if value.isdigit() else -1


async def chain(
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
