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

import bisect
import heapq
import itertools
from collections.abc import Collection, Iterable, Iterator, Mapping

from .errors import NotFound
from .model import Constraints, Policy, Request

__all__ = ["PendingQueue", "Walk"]

Shape = tuple[int, int, Constraints]
ClassKey = tuple[int, Shape]


Members = dict[str, Request]  # one bucket or class, by request id, in submission order
Entry = tuple[Request, Members, Members, ClassKey]  # a request, its bucket, its class


def _add_in_order(members: Members, request: Request) -> None:
    """Appends ``request``; one restored out of order is put back in submission order."""
    in_order = not members or next(reversed(members.values())).seq <= request.seq
    members[request.id] = request
    if not in_order:
        ordered = sorted(members.values(), key=lambda r: r.seq)
        members.clear()
        members.update((r.id, r) for r in ordered)


class PendingQueue:
    def __init__(self) -> None:
        self._buckets: dict[int, Members] = {}
        self._classes: dict[ClassKey, Members] = {}
        # Where each request is kept: removing one finds its bucket and class without
        # working out (and hashing) its class key again.
        self._entries: dict[str, Entry] = {}
        self._sizes: dict[int, int] = {}  # per-GPU size -> how many pending

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> Request:
        try:
            return self._entries[request_id][0]
        except KeyError:
            raise NotFound(f"no pending request {request_id!r}") from None

    def add(self, request: Request) -> None:
        if request.id in self._entries:
            raise ValueError(f"request {request.id!r} is already queued")
        bucket = self._buckets.setdefault(request.priority, {})
        key = (request.priority, request.shape)
        members = self._classes.setdefault(key, {})
        _add_in_order(bucket, request)
        _add_in_order(members, request)
        self._entries[request.id] = (request, bucket, members, key)
        self._sizes[request.vram_mb] = self._sizes.get(request.vram_mb, 0) + 1

    def remove(self, request_id: str) -> Request:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            raise NotFound(f"no pending request {request_id!r}")
        request, bucket, members, key = entry
        del bucket[request_id]
        if not bucket:
            del self._buckets[request.priority]
        del members[request_id]
        if not members:
            del self._classes[key]
        left = self._sizes.pop(request.vram_mb) - 1
        if left:
            self._sizes[request.vram_mb] = left
        return request

    def only(self) -> Request | None:
        """The pending request when it is the only one, else None."""
        if len(self._entries) != 1:
            return None
        (entry,) = self._entries.values()
        return entry[0]

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

    def position(self, request_id: str, policy: Policy, now: float) -> int:
        """Where :meth:`ordered` yields the pending request ``request_id`` (from 1),
        without walking the requests ahead of it: each bucket is sorted by the queue's
        key, so the requests of a bucket that come before it are found by bisection (a
        few calls per bucket, not one per request ahead: 10,000 pending made every
        answer of a queued request walk them all)."""
        request = self.get(request_id)
        key = (-policy.effective_priority(request, now), request.seq)

        def order(other: Request) -> tuple[int, int]:
            return (-policy.effective_priority(other, now), other.seq)

        ahead = 0
        for bucket in self._buckets.values():
            ahead += bisect.bisect_left(list(bucket.values()), key, key=order)
        return ahead + 1

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
