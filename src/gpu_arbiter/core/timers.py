"""The core's timers: when the cycle must run again if no event comes first.

One heap of (time, seq, kind, key). An entry is never removed when what it times moves
or ends (a lease renewed, a request granted): it is checked when it comes due and
skipped if stale, which the scheduler decides (``live``). So arming is O(log n) and
nothing scans the heap.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from enum import StrEnum

__all__ = ["TimerKind", "Timers"]


class TimerKind(StrEnum):
    TTL = "ttl"  # a lease's TTL lapses (key: lease id)
    LOAD = "load"  # a load runs past its load_timeout_s (key: lease id)
    DRAIN = "drain"  # a graceful drain's deadline (key: worker name)
    WAIT = "wait"  # a pending request's max_wait_s ends (key: request id)
    RETRY = "retry"  # a victim becomes eligible: run the cycle once more (key: "")
    ABSENT = "absent"  # a pending request's asker unseen for its ttl_s (key: request id)
    CLAIM = "claim"  # a grant not taken up within its claim bound (key: lease id)


Entry = tuple[float, int, TimerKind, str]


class Timers:
    __slots__ = ("_heap", "_retries", "_seq")

    def __init__(self) -> None:
        self._heap: list[Entry] = []
        self._seq = 0
        self._retries: set[float] = set()  # times of pending RETRY entries

    def push(self, at: float, kind: TimerKind, key: str) -> None:
        """Arms a timer; one at infinity (never) is not kept."""
        if not math.isfinite(at):
            return
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, key))

    def retry(self, at: float) -> None:
        """Runs the cycle again at ``at`` (once, however often asked)."""
        if at not in self._retries and math.isfinite(at):
            self._retries.add(at)
            self.push(at, TimerKind.RETRY, "")

    def retry_pending(self, at: float) -> bool:
        return at in self._retries

    def next(self, live: Callable[[Entry], bool]) -> float | None:
        """When the first live timer is due (None: none is armed); stale ones are dropped."""
        heap = self._heap
        while heap and not live(heap[0]):
            entry = heapq.heappop(heap)
            if entry[2] is TimerKind.RETRY:
                self._retries.discard(entry[0])
        return heap[0][0] if heap else None

    def due(self, now: float, live: Callable[[Entry], bool]) -> list[tuple[TimerKind, str]]:
        """The live timers due at ``now``, in order; changes nothing (a plan reads them,
        :meth:`drop_due` removes them once it is applied). Only the heap's entries due are
        visited: a child is never earlier than its parent."""
        heap = self._heap
        found: list[Entry] = []
        stack = [0] if heap else []
        while stack:
            i = stack.pop()
            entry = heap[i]
            if entry[0] > now:
                continue
            if entry[2] is not TimerKind.RETRY and live(entry):
                found.append(entry)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    stack.append(child)
        found.sort()
        return [(entry[2], entry[3]) for entry in found]

    def drop_due(self, now: float) -> None:
        """Removes every timer due at ``now`` (what :meth:`due` said has been carried out)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if entry[2] is TimerKind.RETRY:
                self._retries.discard(entry[0])
