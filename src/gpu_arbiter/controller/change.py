"""The change and its commit: the one path by which anything the controller holds
changes, and the gate that says whether a change may run now.

Owns the decision core (``scheduler``) and the stored counters (``meta``), both
replaced only by :mod:`.roles` when it reloads, the grant histograms, and the
:class:`Gate`. The modules take part in every change as participants
(:class:`Participant`), one ordered tuple declared once (:attr:`Changes.participants`,
set in ``facade.py``); each hook runs for every participant, in that order::

    body        the caller applies its event to the core (Changes.change's body)
    sweep       what came due before the core decides (offline workers, late updates)
    decide      the core decides (Scheduler.decide)
    absorb      what it decided is recorded in the change (leases, events)
    encode      each writes its slice of the Batch (leases, workers, operations, gateway
                names, catalogue revisions, events)
    commit      the store commits the batch
    stored      then, and only then, the stored batch is announced (waiters, streams)
    committed   last: the timer follows the deadlines
    recover     any failure on the way: memory goes back to what the store holds

One rule for every failure: an exception while applying, sweeping, deciding, absorbing,
encoding or storing (not only a :class:`~..store.StoreError`), or in a hook that runs
once the batch is stored (``stored``, ``committed``), hands the error to the ``recover``
hook, which reloads what the store holds; only a refusal (:class:`~..core.ArbiterError`)
in the body stores what was applied before it.

Group commit (:meth:`Changes.commit_in_groups`, what the server turns on for SQLite)::

    loop:   apply+decide A, encode A ─┐  apply+decide B, encode B ─┐  C ─┐
    thread:                           └─ commit [A] ───────────────┴────┴─ commit [B+C]
    loop:                                 announce A, answer A ──────────  announce B, C

The core applies every change at once and in order (the next change's decisions need
it); only the store transaction waits. A batch handed over while a commit is in flight
goes, with every other one handed over meanwhile, into the next transaction, merged in
order (:meth:`~..store.Batch.merge`); that transaction runs on a thread of its own, so
the loop serves other requests meanwhile. What the batches cause once stored — the
``stored`` hooks (waiters and event streams woken), histograms, the ``committed`` hooks
(the timer armed) — runs on the loop, in order, after their transaction is durable, and
an answer leaves only once every change handed over before it is durable
(:meth:`Changes.settled`; the server's ``DurableAnswers`` awaits it for every HTTP
answer): memory may be ahead of the store, but nobody is told what the store does not
hold. A failed transaction fails every batch in it and every batch handed over after it
(they were built on it): their answers become errors, the queued ones are dropped, and
the ``recover`` hooks reload what the store holds, once no transaction is in flight
(changes are refused until then). A crash between apply and commit loses only what
nobody was told: the restart state is the last committed one.

Calls only the store, the core and its participants' hooks; it knows no other module
of the package.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..core import ArbiterError, Decisions, Scheduler
from ..store import (
    Batch,
    CatalogueRevision,
    GatewayNameRecord,
    LeaseRecord,
    OperationRecord,
    Store,
)
from .values import (
    GRANT_LATENCY_BOUNDS_S,
    WAIT_BOUNDS_S,
    Histogram,
    NotLeader,
    ServiceUnavailable,
)

__all__ = ["Change", "Changes", "Gate", "GroupCommit", "Participant"]


@dataclass(slots=True)
class Change:
    """What one change touched: the participants add to it, their ``encode`` reads it."""

    now: float
    leases: set[str] = field(default_factory=set)
    ended: dict[str, LeaseRecord] = field(default_factory=dict)
    workers: set[str] = field(default_factory=set)
    removed_workers: set[str] = field(default_factory=set)
    events: list[tuple[str, str | None, str | None, dict[str, Any]]] = field(default_factory=list)
    operations: dict[str, OperationRecord] = field(default_factory=dict)
    names: dict[str, GatewayNameRecord | None] = field(default_factory=dict)  # None: forgotten
    catalogue: list[CatalogueRevision] = field(default_factory=list)  # revisions applied
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


class Participant:
    """A module's part in every change: the hooks below, in the order a change runs them
    (see the module). Each does nothing here; a participant overrides those it takes
    part in. :attr:`Changes.participants` runs each hook for every participant in the
    order they are declared, so that one tuple says who takes part and in which order."""

    __slots__ = ()

    def sweep(self, change: Change) -> None:
        """Before the core decides: what came due is applied in ``change``."""

    def absorb(self, change: Change, decisions: Decisions) -> None:
        """What the core decided is recorded in ``change`` (its records, its events)."""

    def encode(self, change: Change, batch: Batch) -> None:
        """Its slice of what ``change`` writes, into ``batch``."""

    def stored(self, batch: Batch) -> None:
        """``batch`` is durable: who waits for it may be told."""

    def committed(self) -> None:
        """Last, once a change is done (or a deadline of the core moved outside one)."""

    def recover(self, error: BaseException) -> None:
        """A change failed (``error``): memory goes back to what the store holds."""


class GroupCommit:
    """Stores batches in order, one transaction for every batch handed over while the
    one before was in flight, on a thread of its own (see the module). Counts batches
    handed over and settled (stored, or failed) and failures, so that an answer waits
    for exactly the batches handed over before it, and knows whether one failed."""

    def __init__(
        self,
        store: Store,
        loop: asyncio.AbstractEventLoop,
        *,
        stored: Callable[[list[tuple[Batch, Change]]], None],
        recover: Callable[[BaseException], None],
    ) -> None:
        self._store = store
        self._loop = loop
        self._stored = stored
        self._recover = recover
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commit")
        self._queue: list[tuple[Batch, Change]] = []
        self._flight: asyncio.Task[None] | None = None
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._reload_due: BaseException | None = None
        self.writing = False
        self.handed = 0
        self.settled = 0
        self.failures = 0
        self.error: BaseException | None = None

    def hand_over(self, batch: Batch, change: Change) -> None:
        self._queue.append((batch, change))
        self.handed += 1
        if self._flight is None:
            self._flight = self._loop.create_task(self._fly())

    async def wait(self) -> None:
        """Returns once every batch handed over so far is settled."""
        ticket = self.handed
        if self.settled >= ticket:
            return
        future = self._loop.create_future()
        self._waiters.append((ticket, future))
        await future

    def fail(self, error: BaseException) -> bool:
        """A change failed: every batch not stored yet fails with it (it was built on
        it). True when the reload must wait for the transaction being written."""
        self.error = error
        self.failures += 1
        self._queue = []
        self.settled = self.handed
        self._wake()
        if self.writing:
            self._reload_due = error
        return self.writing

    async def flush(self) -> None:
        """Waits for the transactions in flight (at a stop, before the store closes)."""
        while self._flight is not None:
            await asyncio.shield(self._flight)
        self._thread.shutdown(wait=True)

    async def _fly(self) -> None:
        try:
            while self._queue:
                items, self._queue = self._queue, []
                await self._commit(items)
        finally:
            self._flight = None

    async def _commit(self, items: list[tuple[Batch, Change]]) -> None:
        merged = Batch()
        for batch, _ in items:
            merged.merge(batch)
        failures = self.failures
        self.writing = True
        try:
            if merged:
                await self._loop.run_in_executor(self._thread, self._store.commit, merged)
        except Exception as error:
            self.writing = False
            if not self.fail(error) and self._reload_due is None:
                self._recover(error)
        else:
            self.writing = False
            if self.failures == failures:  # no change failed meanwhile
                self.settled += len(items)
                self._stored(items)
                self._wake()
        due, self._reload_due = self._reload_due, None
        if due is not None:  # a change failed while this one was written
            self._recover(due)

    def _wake(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.settled:
            _, future = self._waiters.popleft()
            if not future.done():
                future.set_result(None)


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
        self.participants: tuple[Participant, ...] = ()
        """Who takes part in every change, in order (see the module)."""
        self._group: GroupCommit | None = None

    def next_deadline(self) -> float | None:
        """The core's next deadline (the core of now: a reload replaces it)."""
        return self.scheduler.next_deadline()

    def deadline_moved(self) -> None:
        """A deadline of the core moved outside a change (an asker was seen, which is
        not stored): the timer follows it."""
        self._committed()

    def _committed(self) -> None:
        for participant in self.participants:
            participant.committed()

    def _stored(self, batch: Batch) -> None:
        for participant in self.participants:
            participant.stored(batch)

    def _recover(self, error: BaseException) -> None:
        for participant in self.participants:
            participant.recover(error)

    # ------------------------------------------------------------------ group commit

    def commit_in_groups(self) -> None:
        """From now on each change is stored by a :class:`GroupCommit` on a thread of its
        own, together with those handed over meanwhile (see the module). Call on the
        running loop, with a store whose commit may run on another thread while the
        loop reads it (:class:`~..store.SqliteStore`)."""
        self._group = GroupCommit(
            self.store,
            asyncio.get_running_loop(),
            stored=self._announce,
            recover=self._recover,
        )

    @property
    def failures(self) -> int:
        """Changes that failed since group commit began (0 without it): read it before
        an answer is made, hand it to :meth:`settled` before it leaves."""
        return 0 if self._group is None else self._group.failures

    async def settled(self, failures: int) -> None:
        """Returns once every change made so far is stored; raises
        :class:`ServiceUnavailable` if any change failed since ``failures`` was read
        (what the answer saw may be gone). At once without group commit."""
        group = self._group
        if group is None:
            return
        await group.wait()
        if group.failures != failures:
            raise ServiceUnavailable(f"a change could not be stored: {group.error}")

    async def flush(self) -> None:
        """Waits until what was handed over is stored (or failed); group commit ends."""
        group, self._group = self._group, None
        if group is not None:
            await group.flush()

    # ------------------------------------------------------------------ one change

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
            self._fail(error)
            raise
        try:
            for participant in self.participants:
                participant.sweep(change)
            decisions = self.scheduler.decide(change.now)
            for participant in self.participants:
                participant.absorb(change, decisions)
        except BaseException as error:
            self._fail(error)
            raise
        self.commit(change)

    def commit(self, change: Change) -> None:
        """Encodes and stores ``change``; only then is anyone told (the ``stored`` hooks,
        then the ``committed`` hooks). Any exception on the way, those hooks' included,
        sends memory back to what the store holds. With group commit, the store's part
        and what follows it run once its transaction is done."""
        try:
            if self._group is not None:
                batch = self._batch(change)
                self.meta.update(batch.meta)
                self._group.hand_over(batch, change)
                return
            self.write(change)
            self._observe(change)
            self._committed()
        except BaseException as error:
            self._fail(error)
            if isinstance(error, Exception):
                raise ServiceUnavailable(f"the change could not be stored: {error}") from error
            raise

    def write(self, change: Change) -> None:
        """Encodes and stores ``change``, then announces it; no recovery here (the
        reload that writes what restoring ended calls this directly)."""
        batch = self._batch(change)
        if batch:
            self.store.commit(batch)
        self.meta.update(batch.meta)
        self._stored(batch)

    def _fail(self, error: BaseException) -> None:
        """Any failure of a change: memory goes back to what the store holds; with group
        commit every change not stored yet fails too, and while a transaction is being
        written the reload waits for it (changes are refused meanwhile)."""
        if self._group is not None and self._group.fail(error):
            self.gate.broken = f"a change failed ({error}); reloading what the store holds"
            return
        self._recover(error)

    def _announce(self, items: list[tuple[Batch, Change]]) -> None:
        """Group commit: these batches are stored; tell, in order, what they changed."""
        try:
            for batch, change in items:
                self._stored(batch)
                self._observe(change)
            self._committed()
        except Exception as error:  # a bug: memory goes back to what the store holds
            self._fail(error)

    def _observe(self, change: Change) -> None:
        for waited_s in change.waited_s:
            self.wait_times.observe(waited_s)
        if change.grants:  # each grant of this cycle waited for the whole change to be stored
            self.grant_latency.observe(time.perf_counter() - change.started, change.grants)

    def _batch(self, change: Change) -> Batch:
        """What ``change`` writes: the counters it moved, and its events numbered (the
        sequence readers see advances once the store has them)."""
        batch = Batch()
        for participant in self.participants:
            participant.encode(change, batch)
        meta = {
            "next_token": self.scheduler.next_token,
            "next_seq": self.scheduler.next_seq,
            "paused": int(self.scheduler.paused),
        }
        batch.meta = {k: v for k, v in meta.items() if self.meta.get(k) != v}
        return batch
