"""Whether each peer gateway answers: a front door's own liveness check of the others,
apart from the requests it relays to them. A relayed request's silence says nothing (a
non-stream answer, or a request queued behind a load, may rightly send nothing for
minutes), and a frozen gateway (SIGSTOP, a hung event loop, a host out of memory)
still accepts connections: its kernel does, so only an answer tells.

Every ``check_s`` each peer is asked ``GET /healthz`` on a connection of its own (not
one its relays use), one ask at a time. What the asks say:

- **answered** (any status): the peer is alive; a peer seen silent before is routable
  again at once.
- **refused** (nothing listens): :meth:`Cluster.peer_down`, as a refused relay does,
  each time (so a dead host stays out of routing while it is dead, requests or not).
- **silent**: an ask unanswered for ``timeout_s``: the peer is seen silent then; it
  takes no new request (``why``: not answering since when) and the loads this front
  door asks name it unreachable. A freeze is so seen within ``check_s + timeout_s``
  (4 s with the defaults).
- still silent ``cut_s`` after it was seen: the requests relayed to it are cut
  (:meth:`Cluster.cut`): each ends with a 504 naming the host, or a stream with its
  final error event, and is never sent elsewhere (its body has left). Until then a
  short stall (a loaded machine, a long pause of its collector) costs no request.

The figures are the ``[gateway]`` table's ``peer_check``, ``peer_timeout`` and
``peer_cut`` (``config.py``): a shorter timeout sees a freeze sooner and takes a
stall for one more often; "A frozen host" in docs/cluster.md says how to tune them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import httptools

from ..base.clock import Clock
from ..base.race import first
from ..base.upstream import NotConnected, UpstreamError

__all__ = ["Liveness", "LivenessSettings"]

log = logging.getLogger("gpu_arbiter.gateway")


@dataclass(frozen=True, slots=True)
class LivenessSettings:
    check_s: float = 1.0
    """How often each peer is asked."""
    timeout_s: float = 3.0
    """An ask unanswered this long: the peer is seen silent."""
    cut_s: float = 5.0
    """Silent this long after it was seen: the requests relayed to it are cut."""


@dataclass(slots=True)
class _Watch:
    asked_at: float | None = None  # the clock's time of the oldest ask not answered
    seen_at: float | None = None  # the clock's time it was seen silent
    since: float = 0.0  # the wall time the silence began (for the caller's error)
    task: asyncio.Future[None] | None = None


Ping = Callable[[str], Awaitable[None]]
"""Asks a peer once; returns when it answered, raises :class:`NotConnected` when it
refused the connection (any other error: no answer)."""
Spawn = Callable[[Coroutine[Any, Any, None]], asyncio.Future[None]]


class Liveness:
    """The peers' liveness as this front door sees it (one :class:`_Watch` each)."""

    def __init__(
        self,
        settings: LivenessSettings,
        clock: Clock,
        ping: Ping,
        *,
        refused: Callable[[str, str], None],
        silent: Callable[[str], None],
        cut: Callable[[str], None],
        answers: Callable[[str], None],
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._ping = ping
        self._refused = refused
        self._silent = silent
        self._cut = cut
        self._answers = answers
        self._watches: dict[str, _Watch] = {}

    def why(self, peer: str) -> str:
        """Why ``peer`` takes no request for its silence ('' when it is not silent)."""
        watch = self._watches.get(peer)
        if watch is None or watch.seen_at is None:
            return ""
        when = time.strftime("%H:%M:%S", time.localtime(watch.since))
        return f"not answering its liveness check since {when}"

    def silent(self) -> list[str]:
        """The peers seen silent now."""
        return sorted(n for n, w in self._watches.items() if w.seen_at is not None)

    async def watch(self, peers: Callable[[], Iterable[str]], spawn: Spawn) -> None:
        """Asks each of ``peers()`` every ``check_s``, for as long as it runs (the
        gateway's life); ``spawn`` runs each ask (the cluster's task group)."""
        while True:
            names = set(peers())
            for gone in set(self._watches) - names:
                watch = self._watches.pop(gone)
                if watch.task is not None:
                    watch.task.cancel()
            now = self.clock.now()
            for name in names:
                watch = self._watches.setdefault(name, _Watch())
                if watch.task is None or watch.task.done():
                    watch.task = spawn(self._ask(name, watch))
                self._judge(name, watch, now)
            await self.clock.sleep(self.settings.check_s)

    async def _ask(self, name: str, watch: _Watch) -> None:
        if watch.asked_at is None:
            watch.asked_at = self.clock.now()
        try:
            won = await first(self._ping(name), self.clock.sleep(self.settings.timeout_s))
        except NotConnected as error:
            watch.asked_at = None  # dead, not silent: refused is its own state
            self._clear(name, watch)
            self._refused(name, str(error))
            return
        except (UpstreamError, OSError, httptools.HttpParserError):
            won = 1  # no answer: as silent as none
        if won == 0:
            watch.asked_at = None
            self._clear(name, watch)
        else:
            self._judge(name, watch, self.clock.now())

    def _judge(self, name: str, watch: _Watch, now: float) -> None:
        if watch.asked_at is None:
            return
        quiet_s = now - watch.asked_at
        if watch.seen_at is None:
            if quiet_s < self.settings.timeout_s:
                return
            watch.seen_at = now
            watch.since = time.time() - quiet_s
            log.warning(
                "gateway %s: no answer to its liveness check for %.1fs: routing around it",
                name, quiet_s,
            )  # fmt: skip
            self._silent(name)
        if now - watch.seen_at >= self.settings.cut_s:
            self._cut(name)

    def _clear(self, name: str, watch: _Watch) -> None:
        if watch.seen_at is None:
            return
        log.warning(
            "gateway %s: answers its liveness check again after %.1fs",
            name, self.clock.now() - watch.seen_at,
        )  # fmt: skip
        watch.seen_at = None
        self._answers(name)
