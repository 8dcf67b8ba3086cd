"""Roles and restore: leader (``start``), standby (``mirror``, ``demote``), stopping
(``close``), and the reload that follows any failed change.

Roles, when several controllers share one store (PostgreSQL)::

    standby ──start()──▶ leader ──demote()──▶ standby
       ▲ │                 (its term ended,     │
       └─┘ mirror()         or it was fenced)   ▼
     (reload what the leader committed)      mirror()

Its part of every change (a :class:`~.change.Participant`): :meth:`Roles.recover`, the
reload after any failure of one.

Owns the reload retry (its handle and back-off) and sets the :class:`~.change.Gate`
(role, leader, started, broken). Rebuilding replaces the core in ``changes.scheduler``
and hands each module what the store holds through its public ``clear``/``restore``/
``reset`` calls; it reaches into no module's state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from ..core import Gpu, Policy, Scheduler
from ..store import Fenced, Snapshot, StoreError
from .catalogue import CatalogueRevisions
from .change import Change, Changes, Participant
from .events import Events
from .leases import Leases
from .names import GatewayNames
from .timer import Timer
from .updates import Updates
from .values import RELOAD_RETRY_MAX_S
from .workers import Workers

__all__ = ["Roles"]

log = logging.getLogger("gpu_arbiter.controller")


class Roles(Participant):
    def __init__(
        self,
        changes: Changes,
        *,
        policy: Policy,
        events: Events,
        leases: Leases,
        workers: Workers,
        updates: Updates,
        names: GatewayNames,
        catalogue: CatalogueRevisions,
        timer: Timer,
        simulated: Sequence[Gpu],
    ) -> None:
        self._changes = changes
        self._gate = changes.gate
        self._policy = policy
        self._events = events
        self._leases = leases
        self._workers = workers
        self._updates = updates
        self._names = names
        self._catalogue = catalogue
        self._timer = timer
        self._simulated = tuple(simulated)
        self._reload_retry: asyncio.TimerHandle | None = None
        self._reload_delay_s = 0.0

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Loads the acknowledged state and starts the timer: this controller leads.
        Call on the running loop."""
        gate = self._gate
        gate.loop = asyncio.get_running_loop()
        self._stop_timers()
        snapshot = self._changes.store.load()
        self._rebuild(snapshot)
        gate.standby = False
        gate.leader_url = None
        gate.broken = None
        with self._changes.change() as change:
            self._leases.restore(snapshot.leases, change)  # each TTL re-armed from now
            if self._simulated:
                self._workers.put_simulated(change, self._simulated)
            change.event("controller.started", leases=len(self._changes.scheduler.leases))
        gate.started = True
        self._events.wake_waiters(events=False)  # long-polls a standby held ask again

    def mirror(self, leader_url: str | None = None) -> None:
        """Standby: reloads what the leader committed, for reads; changes raise
        :class:`NotLeader` (naming ``leader_url``). Commits nothing, runs no timer."""
        gate = self._gate
        gate.loop = asyncio.get_running_loop()
        self._stop_timers()
        gate.started = False
        gate.standby = True
        gate.leader_url = leader_url
        snapshot = self._changes.store.load()  # a StoreError leaves the last copy
        gate.broken = None  # what was not committed is gone with the reload
        before = self._events.last_seq
        self._rebuild(snapshot)
        self._leases.restore(snapshot.leases, Change(self._changes.clock()))  # nothing written
        self._events.wake_waiters(events=self._events.last_seq != before)

    def demote(self, leader_url: str | None = None) -> None:
        """The leader's term is over (or it was fenced): it becomes a standby at once
        (changes raise :class:`NotLeader`), then reloads what was committed; what it
        held in memory but could not commit is dropped."""
        log.warning("no longer the leader; continuing as a standby")
        self._events.wake_waiters(events=True)
        self.mirror(leader_url)  # a standby before it loads: a failed load leaves one

    def close(self) -> None:
        self._gate.stopping.set()
        self._events.wake_waiters(events=True)  # event streams and long-polls answer now
        self._stop_timers()
        self._gate.started = False

    def _rebuild(self, snapshot: Snapshot) -> None:
        """Replaces the in-memory state by ``snapshot``'s workers, counters, operations,
        gateway names and catalogue revisions (leases are restored by the caller, which
        decides whether that is a change)."""
        now = self._changes.clock()
        meta = dict(snapshot.meta)
        scheduler = Scheduler(
            self._policy,
            next_token=meta.get("next_token", 1),
            next_seq=meta.get("next_seq", 1),
            presence=True,  # its clients can vanish: their requests end (I8)
        )
        self._changes.scheduler = scheduler
        self._changes.meta = meta
        self._leases.clear()
        self._workers.clear()
        self._events.reset(snapshot.last_event_seq)
        if meta.get("paused"):
            scheduler.pause()
        self._updates.restore(snapshot.operations)
        self._names.restore(snapshot.gateway_names)
        self._catalogue.restore(snapshot.catalogue)
        for worker in snapshot.workers:
            self._workers.restore(worker, now)

    def _stop_timers(self) -> None:
        self._timer.stop()
        if self._reload_retry is not None:
            self._reload_retry.cancel()
            self._reload_retry = None

    # ------------------------------------------------------------------ recovery

    def recover(self, error: BaseException) -> None:
        """A change failed before it was stored: memory goes back to what the store holds."""
        if isinstance(error, StoreError):
            log.error("a change could not be stored (%s); reloading what the store holds", error)
        else:
            log.error("a change failed (%r); reloading what the store holds", error, exc_info=error)
        self._reload_or_refuse(fenced=isinstance(error, Fenced))

    def _reload_or_refuse(self, *, fenced: bool = False) -> None:
        """Reloads; if the store cannot be read, refuses changes and tries again later."""
        self._stop_timers()
        try:
            self._reload()
        except Exception as error:
            self._gate.broken = f"the store cannot be read, so changes are refused: {error}"
            log.error("%s; trying again", self._gate.broken)
            self._retry_reload_later()
        else:
            self._reload_delay_s = 0.0
            self._gate.broken = "this controller no longer leads the store" if fenced else None
            self._timer.arm()
        finally:
            self._events.wake_waiters(events=True)

    def _reload(self) -> None:
        """Memory becomes what the store holds (what was acknowledged), as at ``start()``."""
        snapshot = self._changes.store.load()
        self._rebuild(snapshot)
        change = Change(self._changes.clock())
        self._leases.restore(snapshot.leases, change)  # ends what no GPU can hold any more
        self._changes.write(change)

    def _retry_reload_later(self) -> None:
        gate = self._gate
        if gate.loop is None or gate.idle:
            return
        self._reload_delay_s = min(RELOAD_RETRY_MAX_S, max(0.1, 2 * self._reload_delay_s))
        self._reload_retry = gate.loop.call_later(self._reload_delay_s, self._reload_again)

    def _reload_again(self) -> None:
        self._reload_retry = None
        gate = self._gate
        if gate.broken is not None and not gate.standby and not gate.stopping.is_set():
            self._reload_or_refuse()
