"""``GET /v1/events``: the event history as Server-Sent Events.

Each event is sent as ``id: SEQ``, ``event: KIND``, ``data: JSON``. A client that
reconnects with ``Last-Event-ID`` (or ``?since=``) gets every retained event after
it, then the live ones; with neither it starts from now. If events it asks for
were already dropped from the bounded history, a ``stream.gap`` event says so.
Filters: ``lease`` and ``worker``. A comment line every 15 s keeps proxies from
closing an idle stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from ..controller import Controller
from ..store import Event
from .schemas import event_out

__all__ = ["event_stream"]

KEEPALIVE_S = 15.0


def _format(event: Event) -> str:
    data = json.dumps(event_out(event), separators=(",", ":"))
    return f"id: {event.seq}\nevent: {event.kind}\ndata: {data}\n\n"


def _gap(after: int, first: int) -> str:
    data = json.dumps({"missed_after": after, "resumed_at": first})
    return f"event: stream.gap\ndata: {data}\n\n"


async def event_stream(
    controller: Controller, after: int, *, lease: str | None, worker: str | None
) -> AsyncIterator[str]:
    yield "retry: 1000\n\n"
    last = after
    while not controller.stopping.is_set():
        events = controller.events_after(last, 500)
        if events:
            if events[0].seq > last + 1 and last < controller.last_event_seq:
                yield _gap(last, events[0].seq)
            for event in events:
                last = event.seq
                if (lease is None or event.lease_id == lease) and (
                    worker is None or event.worker == worker
                ):
                    yield _format(event)
            continue
        if not await controller.wait_events(last, KEEPALIVE_S):
            yield ": keep-alive\n\n"
