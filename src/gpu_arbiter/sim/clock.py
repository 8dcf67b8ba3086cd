"""A virtual clock: a heap of (time, seq, event), SimPy's core in a dozen lines.

Events at the same time come out in the order they were scheduled (``seq``),
so a run is a pure function of its inputs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["EventHeap"]

E = TypeVar("E")


@dataclass(slots=True)
class EventHeap(Generic[E]):
    _heap: list[tuple[float, int, E]] = field(default_factory=list)
    _seq: int = 0

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, at: float, event: E) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, event))

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[E]:
        """Every event scheduled at ``now`` or before, in order."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            due.append(heapq.heappop(self._heap)[2])
        return due
