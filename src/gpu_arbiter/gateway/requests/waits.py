"""A request's wait for a replica of this gateway (:func:`acquire`) or for the cluster's
load of its model (``front_door.py``), as its caller sees it (:class:`Wait`): a
streaming one gets its answer's head at once and a comment line saying why, on each
change and every :data:`HEARTBEAT_S`. A cluster load the arbiter queues is said as
``gpu-arbiter queue -v`` says it (the host nearest to taking it, the lease in its way,
when that gives way: ``cluster/queued.py``), anew as its reason moves."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, Protocol

from ..base.clock import Clock
from ..base.race import first, running_if_waiting
from ..base.scopes import CancelScope
from ..cluster.cluster import Cluster
from ..servers.model import ModelServer, Refused
from ..servers.replica import Replica
from .answers import SSE_HEAD, STOPPING, AfterHead, Send
from .bodies import asks_stream
from .relay import Exchange, watch_disconnect
from .request import Request

__all__ = ["HEARTBEAT_S", "ClusterLoad", "Wait", "acquire"]

HEARTBEAT_S = 3.0
"""A streaming request that waits for a replica gets a comment line at once, when what it
waits for changes, and at least this often: it says why, and keeps the client's read
timeout from running out on a long load."""


class Awaited(Protocol):
    """What a request waits for: a model here, or the cluster's load of one."""

    clock: Clock

    def waiting_for(self) -> str: ...

    async def changed(self) -> None: ...


class ClusterLoad:
    """What a request waiting for the cluster's load of a model sees (:class:`Wait`)."""

    def __init__(self, cluster: Cluster, model: str) -> None:
        self.cluster = cluster
        self.model = model
        self.clock = cluster.clock

    def waiting_for(self) -> str:
        return f"{self.model}: {self.cluster.load_waiting(self.model)}"

    async def changed(self) -> None:
        await self.cluster.changed()


async def acquire(
    model: ModelServer, request: Request, wait: Wait, cancel: CancelScope
) -> tuple[Replica, float] | None:
    """A replica for the request; None when the client went away while it queued (its
    held body is then given back at once, not after ``queue_timeout``); :class:`Refused`
    (503) when the gateway stops meanwhile (``cancel`` cancelled with :data:`STOPPING`).
    A streamed body not read yet is the client's to send: its disconnect is seen by the
    relay. The comment lines of ``wait`` (if any) have ended when it returns."""
    try:
        async with watching(request, cancel), cancel:
            began = wait.began if request.body.body_read is None else None
            return await model.acquire(began, request.priority, request.json_body)
        if cancel.reason == STOPPING:
            raise Refused(503, f"{STOPPING}: model {model.name} takes no new requests", 1.0)
        return None
    finally:
        await wait.end()


def watching(request: Request, cancel: CancelScope) -> AbstractAsyncContextManager[Any]:
    """While a request waits: its client's disconnect cancels ``cancel``, when its body
    is held whole (a streamed body not read yet is the client's to send). Watched from
    its first wait: a request that takes a free slot at once starts no watcher."""
    if request.body.body_read is not None:
        return nullcontext()
    receive = request.receive
    return running_if_waiting(lambda: watch_disconnect(receive, cancel, Exchange(), None))


class Wait:
    """A request's wait for a replica, as its caller sees it. A streaming one (a JSON
    body with ``"stream": true``) that has to wait gets its answer's head at once (200,
    ``text/event-stream``, ``x-queued: true``: nothing later can change it), then an SSE
    comment line saying why: at once, on each change (``queued, position 1: ...``, then
    ``loading chat``) and every ``HEARTBEAT_S`` between. A request with a slot free is
    not touched: the body is scanned for ``stream`` only once the wait begins. The
    comment lines are a task of the wait's own: :meth:`end` waits for it."""

    def __init__(
        self,
        awaited: Awaited,
        send: Send,
        json_body: bytearray | None,
        *,
        head_sent: bool = False,
    ) -> None:
        """``head_sent``: the head went out already, while it waited for something else
        (the cluster's load): only comment lines from here."""
        self.awaited = awaited
        self.send = send
        self.json_body = json_body
        self.clock = awaited.clock  # the model's: its waits run on a virtual one in tests
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
        the rest of an event stream (:class:`.answers.AfterHead`)."""
        return AfterHead(self.send) if self.head_sent else self.send

    async def comment(self, text: str) -> None:
        line = f": {text}\n\n".encode()
        await self.send({"type": "http.response.body", "body": line, "more_body": True})

    async def _beat(self, json_body: bytearray) -> None:
        if not await asks_stream(json_body) or self._over.is_set():
            return
        if not self.head_sent:
            await self.send({"type": "http.response.start", "status": 200, "headers": SSE_HEAD})
            self.head_sent = True
        said, beat_at = "", 0.0
        while not self._over.is_set():
            now = self.clock.now()
            text = self.awaited.waiting_for()
            if text != said or now >= beat_at:
                await self.comment(f"{text} ({self.waited_s():.1f}s)")
                said, beat_at = text, now + HEARTBEAT_S
            await first(self.clock.sleep(beat_at - now), self.awaited.changed(), self._over.wait())
