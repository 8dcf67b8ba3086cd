"""The change and its commit: the one path by which anything the controller holds
changes, and the gate that says whether a change may run now.

Owns the decision core (``scheduler``) and the stored counters (``meta``), both
replaced only by :mod:`.roles` when it reloads, the grant histograms, and the
:class:`Gate`. A change
runs as: the caller applies its event to the core in the body of :meth:`Changes.change`;
then each sweep runs (offline workers, late updates), the core decides, and what it
decided is absorbed; each encoder writes its slice of the :class:`~..store.Batch`
(leases, workers, operations, events); the store commits it; then, and only then,
the stored batch is announced (waiters, event streams) and the timer is armed.

One rule for every failure: an exception while applying, deciding, encoding or storing
(not only a :class:`~..store.StoreError`) hands the error to the recovery callback,
which reloads what the store holds; only a refusal (:class:`~..core.ArbiterError`) in
the body stores what was applied before it.

Calls only the store, the core and the callbacks handed to :meth:`Changes.connect`;
it knows no other module of the package.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..core import ArbiterError, Decisions, Scheduler
from ..store import Batch, LeaseRecord, OperationRecord, Store
from .values import (
    GRANT_LATENCY_BOUNDS_S,
    WAIT_BOUNDS_S,
    Histogram,
    NotLeader,
    ServiceUnavailable,
)

__all__ = ["Change", "Changes", "Gate"]


@dataclass(slots=True)
class Change:
    """What one change touched: the modules add to it, the encoders read it."""

    now: float
    leases: set[str] = field(default_factory=set)
    ended: dict[str, LeaseRecord] = field(default_factory=dict)
    workers: set[str] = field(default_factory=set)
    removed_workers: set[str] = field(default_factory=set)
    events: list[tuple[str, str | None, str | None, dict[str, Any]]] = field(default_factory=list)
    operations: dict[str, OperationRecord] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    grants: int = 0
    waited_s: list[float] = field(default_factory=list)  # of each grant, once stored

    def event(
        self, kind: str, lease_id: str | None = None, worker: str | None = None, **data: Any
    ) -> None:
        self.events.append((kind, lease_id, worker, data))


class Gate:
    """Whether changes are accepted now: the role (leader or standby, and who leads),
    whether the controller is running or stopping, and why changes are refused after a
    failed reload (``broken``). :mod:`.roles` sets it; every verb asks it first."""

    def __init__(self) -> None:
        self.broken: str | None = None
        self.started = False
        self.standby = False
        self.leader_url: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = asyncio.Event()

    def check_available(self) -> None:
        if self.standby:
            where = f"; the leader is {self.leader_url}" if self.leader_url else ""
            raise NotLeader(f"this controller is a standby{where}", leader=self.leader_url or "")
        if self.broken is not None:
            raise ServiceUnavailable(f"the controller is not accepting changes: {self.broken}")
        if not self.started and self.loop is not None:
            raise ServiceUnavailable("the controller is stopping")

    @property
    def idle(self) -> bool:
        """No timer may run: no loop yet, stopping, or a standby."""
        return self.loop is None or self.stopping.is_set() or self.standby


Sweep = Callable[[Change], None]
Encoder = Callable[[Change, Batch], None]


def _nothing(*_: object) -> None:
    return None


class Changes:
    """Builds, applies, encodes, stores and announces changes (see the module)."""

    def __init__(self, store: Store, scheduler: Scheduler, clock: Callable[[], float]) -> None:
        self.store = store
        self.scheduler = scheduler
        self.clock = clock
        self.gate = Gate()
        self.meta: dict[str, int] = {}
        self.wait_times = Histogram(WAIT_BOUNDS_S)  # submitted -> granted
        self.grant_latency = Histogram(GRANT_LATENCY_BOUNDS_S)  # change start -> grant stored
        self._sweeps: Sequence[Sweep] = ()
        self._absorb: Callable[[Change, Decisions], None] = _nothing
        self._encoders: Sequence[Encoder] = ()
        self._stored: Callable[[Batch], None] = _nothing
        self._recover: Callable[[BaseException], None] = _nothing
        self._committed: Callable[[], None] = _nothing

    def connect(
        self,
        *,
        sweeps: Sequence[Sweep],
        absorb: Callable[[Change, Decisions], None],
        encoders: Sequence[Encoder],
        stored: Callable[[Batch], None],
        recover: Callable[[BaseException], None],
        committed: Callable[[], None],
    ) -> None:
        """The modules' parts of every change: ``sweeps`` before the core decides,
        ``absorb`` for what it decided, ``encoders`` in order for the batch, ``stored``
        once the store has it, ``recover`` for any failure, ``committed`` last."""
        self._sweeps = tuple(sweeps)
        self._absorb = absorb
        self._encoders = tuple(encoders)
        self._stored = stored
        self._recover = recover
        self._committed = committed

    @contextmanager
    def change(self) -> Iterator[Change]:
        """One change: the caller applies it in the body; then the cycle runs, and all of
        it is stored in one transaction. A refusal (:class:`ArbiterError`) in the body
        stores what was applied before it; any other exception, in the body or in the
        cycle, sends memory back to what the store holds."""
        change = Change(self.clock())
        try:
            yield change
        except ArbiterError:
            self.commit(change)
            raise
        except BaseException as error:
            self._recover(error)
            raise
        try:
            for sweep in self._sweeps:
                sweep(change)
            self._absorb(change, self.scheduler.decide(change.now))
        except BaseException as error:
            self._recover(error)
            raise
        self.commit(change)
        for waited_s in change.waited_s:
            self.wait_times.observe(waited_s)
        if change.grants:  # each grant of this cycle waited for the whole change to be stored
            self.grant_latency.observe(time.perf_counter() - change.started, change.grants)

    def commit(self, change: Change) -> None:
        """Encodes and stores ``change``; only then is anyone told (waiters, streams). Any
        exception on the way sends memory back to what the store holds."""
        try:
            self.write(change)
        except BaseException as error:
            self._recover(error)
            if isinstance(error, Exception):
                raise ServiceUnavailable(f"the change could not be stored: {error}") from error
            raise
        self._committed()

    def write(self, change: Change) -> None:
        """Encodes and stores ``change``, then announces it; no recovery here (the
        reload that writes what restoring ended calls this directly)."""
        batch = self._batch(change)
        if batch:
            self.store.commit(batch)
        self.meta.update(batch.meta)
        self._stored(batch)

    def _batch(self, change: Change) -> Batch:
        """What ``change`` writes. Counters and the event sequence are not advanced here:
        they advance once the store has it."""
        batch = Batch()
        for encode in self._encoders:
            encode(change, batch)
        meta = {
            "next_token": self.scheduler.next_token,
            "next_seq": self.scheduler.next_seq,
            "paused": int(self.scheduler.paused),
        }
        batch.meta = {k: v for k, v in meta.items() if self.meta.get(k) != v}
        return batch
