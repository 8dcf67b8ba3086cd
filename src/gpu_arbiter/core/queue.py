"""The pending queue: (effective priority desc, submission order asc).

Requests are kept in one bucket per base priority, each in submission order.
Within a bucket, an older request has waited longer and so has aged at least as
much: each bucket is already sorted by the queue's key. The queue order is
therefore a k-way merge of the buckets' heads (k = distinct base priorities,
a handful), produced lazily: finding the next candidates never scans the whole
queue, and iterating never changes it.

The same requests are also kept by *class*: base priority and shape (per-GPU
size, GPU count, constraints), each class in submission order. Members of a
class are interchangeable for placement except for their age, and the older
ones come first: when the head of a class can neither be placed nor preempt,
none of the rest can either in that cycle. :class:`Walk` merges the classes'
heads and lets the scheduler drop a class at once, so that a cycle touches one
request per class that failed, however many wait in it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterable, Iterator, Mapping

from .errors import NotFound
from .model import Constraints, Policy, Request

__all__ = ["PendingQueue", "Walk"]

Shape = tuple[int, int, Constraints]
ClassKey = tuple[int, Shape]


def _class_of(request: Request) -> ClassKey:
    return (request.priority, request.shape)


def _add_in_order(members: dict[str, Request], request: Request) -> None:
    """Appends ``request``; one restored out of order is put back in submission order."""
    last = next(reversed(members.values()), None)
    members[request.id] = request
    if last is not None and last.seq > request.seq:
        ordered = sorted(members.values(), key=lambda r: r.seq)
        members.clear()
        members.update((r.id, r) for r in ordered)


class PendingQueue:
    def __init__(self) -> None:
        self._buckets: dict[int, dict[str, Request]] = {}
        self._classes: dict[ClassKey, dict[str, Request]] = {}
        self._priority_of: dict[str, int] = {}
        self._sizes: dict[int, int] = {}  # per-GPU size -> how many pending

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
        _add_in_order(self._buckets.setdefault(request.priority, {}), request)
        _add_in_order(self._classes.setdefault(_class_of(request), {}), request)
        self._priority_of[request.id] = request.priority
        self._sizes[request.vram_mb] = self._sizes.get(request.vram_mb, 0) + 1

    def remove(self, request_id: str) -> Request:
        priority = self._priority_of.pop(request_id, None)
        if priority is None:
            raise NotFound(f"no pending request {request_id!r}")
        bucket = self._buckets[priority]
        request = bucket.pop(request_id)
        if not bucket:
            del self._buckets[priority]
        key = _class_of(request)
        members = self._classes[key]
        del members[request_id]
        if not members:
            del self._classes[key]
        left = self._sizes.pop(request.vram_mb) - 1
        if left:
            self._sizes[request.vram_mb] = left
        return request

    def only(self) -> Request | None:
        """The pending request when it is the only one, else None."""
        if len(self._priority_of) != 1:
            return None
        (bucket,) = self._buckets.values()
        return next(iter(bucket.values()))

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

    def walk(self, policy: Policy, now: float, alone: Collection[str] = ()) -> Walk:
        """The queue in order, class by class (see :class:`Walk`); the requests ``alone``
        are walked on their own, never dropped with their class."""
        return Walk(self._classes.values(), [self.get(r) for r in alone], policy, now)

    def class_count(self) -> int:
        return len(self._classes)


class Walk:
    """Every pending request in queue order, merged from the heads of the classes.

    After a request is yielded, :meth:`drop` skips the rest of its class for this walk
    (not the requests walked alone). Do not add or remove requests while walking."""

    def __init__(
        self,
        classes: Iterable[Mapping[str, Request]],
        alone: Collection[Request],
        policy: Policy,
        now: float,
    ) -> None:
        self._policy = policy
        self._now = now
        self._tie = itertools.count()
        self._heap: list[tuple[int, int, int, Request, Iterator[Request] | None]] = []
        self._dropped = False
        self.examined = 0  # requests yielded: what a cycle costs, whatever the queue holds
        alone_ids = {r.id for r in alone}
        for members in classes:
            rest = iter(members.values())
            if alone_ids:
                rest = (r for r in rest if r.id not in alone_ids)
            self._push(next(rest, None), rest)
        for request in alone:
            self._push(request, None)

    def _push(self, request: Request | None, rest: Iterator[Request] | None) -> None:
        if request is not None:
            key = -self._policy.effective_priority(request, self._now)
            heapq.heappush(self._heap, (key, request.seq, next(self._tie), request, rest))

    def drop(self) -> None:
        """Skips the rest of the last yielded request's class."""
        self._dropped = True

    def __iter__(self) -> Iterator[Request]:
        while self._heap:
            _, _, _, request, rest = heapq.heappop(self._heap)
            self._dropped = False
            self.examined += 1
            yield request
            if rest is not None and not self._dropped:
                self._push(next(rest, None), rest)
