"""``Controller``: builds the controller's concerns, declares in one ordered tuple
which of them take part in every change (``changes.participants``: see
:mod:`.change`), and exposes each one as a public attribute; a caller calls the module
that owns what it asks for::

    controller.leases    submit, get, all, queue, pending_view, positions, renew, ready,
                         set_idle, shrink, release, revoke            (:mod:`.leases`)
    controller.workers   register, heartbeat, drain, cancel_drain, remove, get, all,
                         leases_on, gpu_figures, last_seen            (:mod:`.workers`)
    controller.updates   start, get, running, for_agent, report       (:mod:`.updates`)
    controller.names     get, take, forget: which token holds each gateway name
                                                                      (:mod:`.names`)
    controller.catalogue current, revision, history, apply, wait_after: the cluster's
                         catalogue, as numbered revisions             (:mod:`.catalogue`)
    controller.events    after, wait_after, wait_lease, wake_streams, last_seq
                                                                      (:mod:`.events`)
    controller.changes   commit_in_groups, failures, settled, flush, wait_times,
                         grant_latency                                (:mod:`.change`)
    controller.gate      started, standby, leader_url, broken, stopping
                                                                      (:class:`~.change.Gate`)

What concerns the whole arbiter is the controller's own: its life (``start``,
``mirror``, ``demote``, ``close``: see :mod:`.roles`), ``pause`` and ``resume`` (a
change of the core alone), ``status`` (a summary of all of it) and ``scheduler``
(the core now: a reload replaces it). It holds no state of its own beyond its
configuration.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from ..core import Gpu, Policy, Scheduler
from ..store import Store
from .catalogue import CatalogueRevisions
from .change import Changes, Gate
from .events import Events
from .leases import Leases
from .names import GatewayNames
from .roles import Roles
from .timer import Timer
from .updates import Updates
from .values import Limits
from .workers import Workers

__all__ = ["Controller"]


class Controller:
    EVENT_FLUSH_S = 0.05
    """Event streams are woken at most this often: one wake carries every event since."""
    EVENT_TICK_S = 7.5
    """Event streams are woken at least this often (an idle one sends a keep-alive)."""

    def __init__(
        self,
        store: Store,
        *,
        policy: Policy | None = None,
        limits: Limits | None = None,
        heartbeat_timeout_s: float = 15.0,
        simulated: Sequence[Gpu] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.policy = policy or Policy()
        self.limits = limits or Limits()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.changes = changes = Changes(store, Scheduler(self.policy, presence=True), clock)
        self.gate: Gate = changes.gate
        self.leases = leases = Leases(changes, store, self.limits)
        self.events = events = Events(
            store,
            self.limits,
            changes.gate,
            clock,
            leases.get,
            flush_s=self.EVENT_FLUSH_S,
            tick_s=self.EVENT_TICK_S,
        )
        self.workers = workers = Workers(changes, leases, self.limits, heartbeat_timeout_s)
        self.updates = updates = Updates(changes, store, leases, workers)
        workers.listen(updates)
        self.names = names = GatewayNames(changes)
        self.catalogue = catalogue = CatalogueRevisions(changes)
        deadlines = [changes.next_deadline, workers.next_deadline, updates.next_deadline]
        self._timer = timer = Timer(changes, deadlines)
        self._roles = Roles(
            changes,
            policy=self.policy,
            events=events,
            leases=leases,
            workers=workers,
            updates=updates,
            names=names,
            catalogue=catalogue,
            timer=timer,
            simulated=simulated,
        )
        # Who takes part in every change, in order: each hook of a change (sweep, absorb,
        # encode, stored, committed, recover: see change.py) runs for each of them in this
        # order, so a change reads top to bottom here.
        changes.participants = (
            leases,  # absorb: records what the core decided; encode: the leases touched
            workers,  # sweep: silent workers go offline; encode: the workers touched
            updates,  # sweep: late updates fail; encode: the operations touched
            names,  # encode: the gateway names taken or forgotten
            catalogue,  # encode: the catalogue's new revision; stored: wakes its readers
            events,  # encode: numbers the change's events, last; stored: wakes waiters, streams
            timer,  # committed: the alarm follows the deadlines
            self._roles,  # recover: any failure reloads what the store holds
        )

    # ------------------------------------------------------------------ the arbiter

    @property
    def scheduler(self) -> Scheduler:
        """The decision core as it is now (a reload after a failure replaces it)."""
        return self.changes.scheduler

    def start(self) -> None:
        """Loads the acknowledged state and leads (see :mod:`.roles`)."""
        self._roles.start()

    def mirror(self, leader_url: str | None = None) -> None:
        """A standby: reloads what the leader committed, for reads."""
        self._roles.mirror(leader_url)

    def demote(self, leader_url: str | None = None) -> None:
        """The leader's term is over: a standby at once, then a reload."""
        self._roles.demote(leader_url)

    def close(self) -> None:
        """Stops: long-polls and event streams answer now, the timers stop."""
        self._roles.close()

    def pause(self) -> None:
        """Grants nothing until :meth:`resume` (pending reasons say so); everything else
        still runs. Stored, with one event when it was not paused."""
        self.gate.check_available()
        with self.changes.change() as change:
            if not self.scheduler.paused:
                change.event("arbiter.paused")
            self.scheduler.pause()

    def resume(self) -> None:
        """Grants again (stored, with one event when it was paused)."""
        self.gate.check_available()
        with self.changes.change() as change:
            if self.scheduler.paused:
                change.event("arbiter.resumed")
            self.scheduler.resume()

    def status(self) -> dict[str, Any]:
        """The whole arbiter in counts: the queue (by priority), leases and workers by
        state, the core's counters, the last event, the role."""
        scheduler = self.scheduler
        leases: Counter[str] = Counter(str(lease.state) for lease in scheduler.leases.values())
        workers: Counter[str] = Counter(str(w.status) for w in scheduler.workers.values())
        return {
            "paused": scheduler.paused,
            "pending": len(scheduler.queue),
            "pending_by_priority": {
                str(p): n for p, n in sorted(scheduler.queue.count_by_priority().items())
            },
            "leases_by_state": dict(leases),
            "workers_by_state": dict(workers),
            "counters": dict(scheduler.counters),
            "next_token": scheduler.next_token,
            "last_event": self.events.last_seq,
            "role": "standby" if self.gate.standby else "leader",
            "leader": self.gate.leader_url,
        }
