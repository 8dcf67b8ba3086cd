"""Answers leave only once what they may show is stored (I9 with group commit).

With group commit (:mod:`..controller.change`) the controller's memory runs ahead of
its store by the changes whose transaction is in flight. Any answer may show them —
the lease a POST created, a lease list, a long-poll's new state — so every HTTP answer
waits, before its first byte, until every change made before it is durable. A change
that failed meanwhile (its transaction, or one before it) may be what the answer
shows: the answer becomes a 503 ``unavailable`` instead, and the controller reloads
what the store holds. Without group commit the wait returns at once.

Only the start of an answer waits: a stream (``/v1/events``) sends only stored events.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..controller import Controller, ServiceUnavailable
from .errors import error_response

__all__ = ["DurableAnswers"]


class DurableAnswers:
    """ASGI middleware: an answer's start awaits ``controller.changes.settled``."""

    def __init__(self, app: ASGIApp, controller: Controller) -> None:
        self.app = app
        self.controller = controller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        changes = self.controller.changes
        failed_before = changes.failures
        replaced = False

        async def send_stored(message: Message) -> None:
            nonlocal replaced
            if replaced:  # the answer was replaced by a 503: the rest of it is dropped
                return
            if message["type"] == "http.response.start":
                try:
                    await changes.settled(failed_before)
                except ServiceUnavailable as error:
                    replaced = True
                    await error_response(503, "unavailable", str(error))(scope, receive, send)
                    return
            await send(message)

        await self.app(scope, receive, send_stored)
