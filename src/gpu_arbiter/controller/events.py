"""Events: the history readers page through, the lease waiters (long-polls), and the
fan-out that wakes event streams.

Owns the event sequence (it advances only with a stored commit, so ``last_seq`` is
never ahead of the events it can return), the recent events in memory, the per-lease
waiters and the :class:`~..fanout.Fanout`. Its part of a change (a
:class:`~.change.Participant`): :meth:`Events.encode` numbers the change's events,
:meth:`Events.stored` announces a stored batch (and logs the serve log's line for a
grant, a revocation or the end of a held lease).

Calls only the store (for older history), the :class:`~.change.Gate` (its loop and
whether it stops) and the lease look-up it is built with (for :meth:`Events.wait_lease`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable, Sequence

from ..core import LeaseState, format_mb
from ..fanout import Fanout
from ..store import Batch, Event, LeaseRecord, Store
from .change import Change, Gate, Participant
from .values import Limits

__all__ = ["Events"]

log = logging.getLogger("gpu_arbiter.controller")


class Events(Participant):
    def __init__(
        self,
        store: Store,
        limits: Limits,
        gate: Gate,
        clock: Callable[[], float],
        lease: Callable[[str], LeaseRecord],
        *,
        flush_s: float,
        tick_s: float,
    ) -> None:
        self._store = store
        self._gate = gate
        self._clock = clock
        self._lease = lease
        self._seq = 0
        self._numbered = 0  # the last sequence number given to an event, stored or not
        self._events: deque[Event] = deque(maxlen=limits.event_buffer)
        self._fanout = Fanout(min_interval_s=flush_s, tick_s=tick_s)
        self._lease_changed: dict[str, asyncio.Event] = {}

    @property
    def last_seq(self) -> int:
        return self._seq

    def reset(self, last_seq: int) -> None:
        """After a reload: the history is what the store holds up to ``last_seq``."""
        self._numbered = last_seq
        if self._seq != last_seq or not self._events:
            self._seq = last_seq
            self._events.clear()
            self._events.extend(self._store.events_after(max(0, self._seq - 1000), 1000))

    # ------------------------------------------------------------------ the change

    def encode(self, change: Change, batch: Batch) -> None:
        """Numbers the change's events after those of every change encoded before it
        (with group commit, those may not be stored yet)."""
        for seq, (kind, subject, worker, data) in enumerate(change.events, self._numbered + 1):
            batch.events.append(Event(seq, change.now, kind, subject, worker, data))
            self._numbered = seq

    def stored(self, batch: Batch) -> None:
        """``batch`` is stored: its leases' waiters answer, its events are published."""
        for lease_id in batch.leases:
            waiter = self._lease_changed.pop(lease_id, None)
            if waiter is not None:
                waiter.set()
        if batch.events:
            self._seq = batch.events[-1].seq
            self._publish(batch.events)
            for event in batch.events:
                line = _lease_log_line(event, batch.leases.get(event.lease_id or ""))
                if line is not None:
                    log.info("%s", line)

    def _publish(self, events: Sequence[Event]) -> None:
        """Committed events: kept for readers; event streams are woken at most every
        flush interval (later while many streams are open), each wake carrying every
        event since the last."""
        self._events.extend(events)
        if self._gate.loop is not None:
            self._fanout.wake_soon(self._gate.loop)

    # ------------------------------------------------------------------ readers

    def wake_waiters(self, *, events: bool) -> None:
        for waiter in self._lease_changed.values():
            waiter.set()
        self._lease_changed.clear()
        if events:
            self.wake_streams()

    def wake_streams(self) -> None:
        """Wakes every :meth:`wait_after` now."""
        self._fanout.wake_now()

    async def wait_lease(self, lease_id: str, state: LeaseState, timeout_s: float) -> LeaseRecord:
        """The lease once its state differs from ``state``, or as it is after ``timeout_s``
        (a long-poll: it is woken when a stored change touched the lease)."""
        deadline = self._clock() + timeout_s
        while True:
            record = self._lease(lease_id)
            left = deadline - self._clock()
            if record.state is not state or record.state.is_final or left <= 0:
                return record
            if self._gate.stopping.is_set():
                return record
            changed = self._lease_changed.setdefault(lease_id, asyncio.Event())
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                return self._lease(lease_id)

    def after(self, seq: int, limit: int = 500) -> list[Event]:
        """Events after ``seq``: from memory when recent, else from the store's history."""
        events = self._events
        if events and events[0].seq <= seq + 1:
            if events[-1].seq - seq <= 64:  # a live reader: walk back from the newest
                tail = list(itertools.takewhile(lambda e: e.seq > seq, reversed(events)))
                return tail[::-1][:limit]
            start = max(0, seq + 1 - events[0].seq)
            return list(itertools.islice(events, start, start + limit))
        return self._store.events_after(seq, limit)

    async def wait_after(self, seq: int) -> bool:
        """Waits until an event after ``seq`` exists (True), or the next tick, or the
        controller stops (False). Always suspends, even when the answer is known at once:
        a caller looping on it never holds the event loop."""
        if self._seq > seq or self._gate.stopping.is_set():
            await asyncio.sleep(0)
        else:
            await self._fanout.wait()
        return self._seq > seq


_LOGGED = ("lease.granted", "lease.revoked", "lease.released", "lease.expired")


def _lease_log_line(event: Event, record: LeaseRecord | None) -> str | None:
    """The serve log's one line for a grant, a revocation or the end of a held lease:
    the lease, its holder, its GPUs and why; None for any other event."""
    if event.kind not in _LOGGED or record is None or record.lease is None:
        return None
    lease = record.lease
    gpus = ",".join(map(str, lease.gpus))
    who = f"lease {record.id} (holder {record.request.holder or '-'!r}) on {gpus}"
    if event.kind == "lease.granted":
        waited = float(event.data.get("waited_s") or 0.0)
        return (
            f"granted {who}: {format_mb(lease.vram_mb)}, priority {lease.base_priority}, "
            f"token {lease.token}, waited {waited:.1f}s"
        )
    if event.kind == "lease.revoked":
        reason = str(event.data.get("reason") or "revoked")
        preemptor = event.data.get("for_request")
        return f"revoked {who}: {reason}" + (f" for {preemptor}" if preemptor else "")
    return f"ended {who}: {event.data.get('reason') or event.kind.removeprefix('lease.')}"
