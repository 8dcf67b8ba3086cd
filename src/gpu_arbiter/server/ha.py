"""Several controllers on one shared store: exactly one leads, the others stand by.

The store elects the leader (a term with a fencing epoch, kept by the database
on the database's clock; see ``store/postgres.py``). This module only follows
what the store says::

    candidate ──try_lead() = epoch──▶ leader ──term lost / fenced / store error──┐
        ▲  └─ None: mirror() the leader's state, poll again                      │
        └────────────────────────────── demote() ◀─────────────────────────────────┘

Safety does not depend on this loop being timely: every commit of a leader is
fenced by its epoch inside the write transaction, so a leader that was deposed
while it was paused, partitioned or slow can never commit a grant. The loop only
decides how fast a standby takes over (about one term after the leader's death;
at once when a leader stops cleanly, since it ends its term) and how fresh a
standby's copy is (``poll_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable
from typing import Protocol

from ..controller import Controller, ServiceUnavailable
from ..store import StoreError

__all__ = ["Coordinator", "LeaderInfo", "LeaderStore"]

log = logging.getLogger("gpu_arbiter.ha")


class LeaderInfo(Protocol):
    @property
    def epoch(self) -> int: ...
    @property
    def url(self) -> str | None: ...
    @property
    def alive(self) -> bool: ...


class LeaderStore(Protocol):
    """What a store that can elect a leader offers (``PostgresStore``)."""

    @property
    def epoch(self) -> int | None: ...

    def try_lead(
        self,
        holder: str,
        url: str | None,
        ttl_s: float,
        on_lost: Callable[[], None] | None = None,
    ) -> int | None: ...

    def step_down(self) -> None: ...

    def leader(self) -> LeaderInfo: ...

    def version(self) -> int: ...


class Coordinator:
    """Runs beside the HTTP server: takes the leadership when it is free, keeps a
    standby's copy fresh, and steps down when the term is lost."""

    def __init__(
        self,
        controller: Controller,
        store: LeaderStore,
        *,
        url: str,
        ttl_s: float = 3.0,
        poll_s: float = 0.5,
    ) -> None:
        self.controller = controller
        self.store = store
        self.url = url
        self.ttl_s = ttl_s
        self.poll_s = poll_s
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.leading = False
        self._lost = asyncio.Event()
        self._seen_version: int | None = None

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()

        def on_lost() -> None:  # called from the store's thread
            loop.call_soon_threadsafe(self._lost.set)

        try:
            while not stop.is_set() and not self.controller.gate.stopping.is_set():
                if self.leading:
                    self._check_term()
                else:
                    self._campaign(on_lost)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake(stop), self.poll_s)
        finally:
            if self.leading and self.store.epoch is not None:
                self.leading = False
                with contextlib.suppress(StoreError):
                    self.store.step_down()  # a standby takes over at once
                log.info("stepped down")

    async def _wake(self, stop: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._lost.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()

    def _campaign(self, on_lost: Callable[[], None]) -> None:
        # A loss reported late, for a term already given up, means nothing now (and left
        # set, it would wake the loop at once, again and again).
        self._lost.clear()
        try:
            epoch = self.store.try_lead(self.holder, self.url, self.ttl_s, on_lost)
        except StoreError as error:
            log.warning("cannot reach the store to elect a leader: %s", error)
            return
        if epoch is not None:
            try:
                self.controller.start()
            except (StoreError, ServiceUnavailable) as error:  # give the term back
                log.error("won the leadership (epoch %d) but cannot load: %s", epoch, error)
                self._give_up()
                return
            self.leading = True
            log.info("leading, epoch %d, at %s", epoch, self.url)
            return
        self._refresh()

    def _refresh(self) -> None:
        """A standby's copy follows the leader's commits."""
        try:
            leader = self.store.leader()
            version = self.store.version()
            url = leader.url if leader.alive else None
            if version != self._seen_version or url != self.controller.gate.leader_url:
                self.controller.mirror(url)
                self._seen_version = version
        except StoreError as error:
            log.warning("cannot refresh from the store: %s", error)

    def _check_term(self) -> None:
        broken = self.controller.gate.broken
        if self._lost.is_set() or self.store.epoch is None:
            log.warning("the leadership term is over")
        elif broken is not None:
            log.warning("the store failed while leading (%s); stepping down", broken)
        else:
            return
        self._give_up()

    def _give_up(self) -> None:
        self.leading = False
        self._seen_version = None
        with contextlib.suppress(StoreError):
            self.store.step_down()
        self._lost.clear()
        try:
            self.controller.demote(None)
        except StoreError as error:  # the store is away: reads answer from what is held
            log.warning("cannot reload as a standby: %s", error)
