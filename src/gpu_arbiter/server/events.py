"""``GET /v1/events``: the event history as Server-Sent Events.

Each event is sent as ``id: SEQ``, ``event: KIND``, ``data: JSON``. A client that
reconnects with ``Last-Event-ID`` (or ``?since=``) gets every retained event after
it, then the live ones; with neither it starts from now. If events it asks for
were already dropped from the bounded history (or were never stored: a change that
failed to commit), a ``stream.gap`` event says so. Filters: ``lease`` and ``worker``.
A comment line at least every 15 s keeps proxies from closing an idle
stream.

Fan-out costs little per stream: an :class:`EventFeed` (one per app) encodes each
event once, and the text of "every event after N" once for all the streams at N; the
controller wakes the streams together (see :mod:`gpu_arbiter.fanout`: coalesced, in
slices, spaced out while many are open), each wake carrying every event since. A
stream never holds the event loop: every turn of its loop awaits (the wake, or a zero
sleep while it catches up on a backlog), and a position the controller cannot serve
is skipped with a gap, never asked again at once. Streams end when the controller
stops.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..controller import Controller
from ..store import Event
from ..web.jsontext import dumps
from .schemas import event_out

__all__ = ["EventFeed", "EventStreamResponse", "event_stream"]

KEEPALIVE_S = 7.5
"""An idle stream sends a comment at least every 2 x KEEPALIVE_S (at the controller's tick)."""
READ_LIMIT = 500
RETRY = b"retry: 1000\n\n"
KEEPALIVE = b": keep-alive\n\n"


def _format(event: Event) -> bytes:
    data = dumps(event_out(event), what=f"event {event.seq}", ensure_ascii=True)
    return f"id: {event.seq}\nevent: {event.kind}\ndata: {data}\n\n".encode()


def _gap(after: int, first: int) -> bytes:
    data = json.dumps({"missed_after": after, "resumed_at": first})
    return f"event: stream.gap\ndata: {data}\n\n".encode()


@dataclass(frozen=True, slots=True)
class Chunk:
    """What a stream at ``after`` sends next: ``text`` (may be empty), its new position
    ``last``, and whether more events wait beyond it (``more``)."""

    text: bytes
    last: int
    more: bool


class EventFeed:
    """The streams' view of the controller's events: each event encoded once; the chunk
    for a position (without filters) built once for every stream at that position."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._encoded: OrderedDict[int, bytes] = OrderedDict()
        self._chunks: dict[tuple[int, str | None, str | None], Chunk] = {}
        self._chunks_at = -1  # the controller's last event when _chunks were built
        self._closed = False

    @property
    def closed(self) -> bool:
        """Streams end: the server is stopping (:meth:`close`), or the controller."""
        return self._closed or self.controller.gate.stopping.is_set()

    def close(self) -> None:
        """Ends every stream now (each sends its end): the server is stopping."""
        self._closed = True
        self.controller.events.wake_streams()

    def read(self, after: int, lease: str | None = None, worker: str | None = None) -> Chunk:
        """The events after ``after`` (at most :data:`READ_LIMIT`) that pass the filters."""
        current = self.controller.events.last_seq
        if current != self._chunks_at:
            self._chunks.clear()
            self._chunks_at = current
        key = (after, lease, worker)
        chunk = self._chunks.get(key)
        if chunk is None:
            chunk = self._chunks[key] = self._build(after, current, lease, worker)
        return chunk

    def _build(self, after: int, current: int, lease: str | None, worker: str | None) -> Chunk:
        if after >= current:
            return Chunk(b"", after, False)
        events = self.controller.events.after(after, READ_LIMIT)
        if not events:  # events the controller counted but cannot serve: skip them
            return Chunk(_gap(after, current + 1), current, False)
        parts = [_gap(after, events[0].seq)] if events[0].seq > after + 1 else []
        parts += [
            self._encode(e)
            for e in events
            if (lease is None or e.lease_id == lease) and (worker is None or e.worker == worker)
        ]
        last = events[-1].seq
        return Chunk(b"".join(parts), last, last < current)

    def _encode(self, event: Event) -> bytes:
        text = self._encoded.get(event.seq)
        if text is None:
            text = self._encoded[event.seq] = _format(event)
            while len(self._encoded) > self.controller.limits.event_buffer:
                self._encoded.popitem(last=False)
        return text


async def event_stream(
    feed: EventFeed, after: int, *, lease: str | None, worker: str | None
) -> AsyncIterator[bytes]:
    """The stream's body. Every turn awaits, whatever the controller answers."""
    loop = asyncio.get_running_loop()
    yield RETRY
    last, wrote = after, loop.time()
    while not feed.closed:
        chunk = feed.read(last, lease, worker)
        last = chunk.last
        if chunk.text or loop.time() - wrote >= KEEPALIVE_S:
            yield chunk.text or KEEPALIVE
            wrote = loop.time()
        if chunk.more:
            await asyncio.sleep(0)  # a backlog: other streams and requests go in between
        elif not feed.closed:  # (a write may have waited for the client)
            await feed.controller.events.wait_after(last)


class EventStreamResponse(StreamingResponse):
    """A streaming response that calls ``release`` when it ends, however it ends (the
    client went, the server stops, or it was never sent)."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
