"""Bounds on what one caller can hold open.

- Request bodies larger than the limit are refused with 413 before they are parsed
  (:class:`BodyLimit`).
- Open event streams and concurrent long-polls are counted per token and in all
  (:class:`Slots`); past either limit the answer is 429 ``too_many_requests``
  naming the limit, with ``Retry-After``. With auth off every caller is the one
  ``anonymous`` principal (the server then listens on loopback only, where peer
  addresses tell callers apart no better), so the per-token limit is the global one.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..controller import TooManyRequests

__all__ = ["BodyLimit", "ClientLimits", "Slots"]


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """How many event streams and long-polls may be open, per token and in all."""

    max_streams: int = 10_000
    max_streams_per_token: int = 100
    max_long_polls: int = 10_000
    max_long_polls_per_token: int = 1_000


class Slots:
    """Open things of one kind (``streams``, ``long_polls``): at most ``per_token`` for
    one token and ``total`` for all."""

    def __init__(self, kind: str, per_token: int, total: int) -> None:
        self.kind = kind
        self.per_token = per_token
        self.total = total
        self.open: Counter[str] = Counter()
        self.open_total = 0

    def take(self, token: str) -> None:
        """Takes a slot for ``token``, or raises :class:`TooManyRequests`. Give it back
        with :meth:`give`."""
        for name, value, current in (
            (f"max_{self.kind}_per_token", self.per_token, self.open[token]),
            (f"max_{self.kind}", self.total, self.open_total),
        ):
            if current >= value:
                what = self.kind.replace("_", "-")
                raise TooManyRequests(
                    f"{current} {what} are already open ({name} is {value}); retry later",
                    limit=name,
                    value=value,
                    current=current,
                )
        self.open[token] += 1
        self.open_total += 1

    def give(self, token: str) -> None:
        self.open[token] -= 1
        if not self.open[token]:
            del self.open[token]
        self.open_total -= 1

    @contextmanager
    def hold(self, token: str) -> Iterator[None]:
        self.take(token)
        try:
            yield
        finally:
            self.give(token)


def _too_large(limit: int) -> bytes:
    return json.dumps(
        {
            "error": {
                "code": "body_too_large",
                "message": f"the request body is larger than {limit} bytes",
                "details": {"limit": limit},
            }
        }
    ).encode()


class BodyLimit:
    """ASGI middleware: a declared ``Content-Length`` over the limit is refused at once; a
    body without one is read up to the limit and refused past it. ``larger``: the limit
    of the paths whose bodies may be larger (a catalogue's text), by path."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, larger: Mapping[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = dict(larger or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self.larger.get(scope["path"], self.max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > limit:
                await self._refuse(send, limit)
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(send, limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, limit: int) -> None:
        body = _too_large(limit)
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
