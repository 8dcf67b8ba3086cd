"""The pending queue: (effective priority desc, submission order asc).

Requests are kept in one bucket per base priority, each in submission order.
Within a bucket, an older request has waited longer and so has aged at least as
much: each bucket is already sorted by the queue's key. The queue order is
therefore a k-way merge of the buckets' heads (k = distinct base priorities,
a handful), produced lazily: finding the next candidates never scans the whole
queue, and iterating never changes it.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterator

from .errors import NotFound
from .model import Policy, Request

__all__ = ["PendingQueue"]


class PendingQueue:
    def __init__(self) -> None:
        self._buckets: dict[int, dict[str, Request]] = {}
        self._priority_of: dict[str, int] = {}
        self._sizes: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._priority_of)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._priority_of

    def get(self, request_id: str) -> Request:
        try:
            return self._buckets[self._priority_of[request_id]][request_id]
        except KeyError:
            raise NotFound(f"no pending request {request_id!r}") from None

    def add(self, request: Request) -> None:
        if request.id in self._priority_of:
            raise ValueError(f"request {request.id!r} is already queued")
        bucket = self._buckets.setdefault(request.priority, {})
        last = next(reversed(bucket.values()), None)
        bucket[request.id] = request
        if last is not None and last.seq > request.seq:  # restored out of order: re-sort
            ordered = sorted(bucket.values(), key=lambda r: r.seq)
            bucket.clear()
            bucket.update((r.id, r) for r in ordered)
        self._priority_of[request.id] = request.priority
        self._sizes[request.vram_mb] += 1

    def remove(self, request_id: str) -> Request:
        priority = self._priority_of.pop(request_id, None)
        if priority is None:
            raise NotFound(f"no pending request {request_id!r}")
        bucket = self._buckets[priority]
        request = bucket.pop(request_id)
        if not bucket:
            del self._buckets[priority]
        self._sizes[request.vram_mb] -= 1
        if not self._sizes[request.vram_mb]:
            del self._sizes[request.vram_mb]
        return request

    def smallest_vram_mb(self) -> int | None:
        """The smallest per-GPU size pending (distinct sizes are few)."""
        return min(self._sizes) if self._sizes else None

    def priorities(self) -> list[int]:
        """Distinct base priorities pending, highest first."""
        return sorted(self._buckets, reverse=True)

    def count_by_priority(self) -> dict[int, int]:
        return {p: len(b) for p, b in self._buckets.items()}

    def ordered(self, policy: Policy, now: float) -> Iterator[Request]:
        """Every pending request in queue order. Do not add or remove while iterating."""
        heap: list[tuple[int, int, int, Request, Iterator[Request]]] = []
        for priority, bucket in self._buckets.items():
            it = iter(bucket.values())
            head = next(it)
            heap.append((-policy.effective_priority(head, now), head.seq, priority, head, it))
        heapq.heapify(heap)
        while heap:
            _, _, priority, head, it = heap[0]
            yield head
            following = next(it, None)
            if following is None:
                heapq.heappop(heap)
            else:
                key = -policy.effective_priority(following, now)
                heapq.heapreplace(heap, (key, following.seq, priority, following, it))

    def bucket(self, priority: int) -> Iterator[Request]:
        """The requests of one base priority, in submission order."""
        return iter(self._buckets.get(priority, {}).values())
