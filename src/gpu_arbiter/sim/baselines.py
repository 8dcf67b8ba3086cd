"""Baseline policies: the ways GPUs are commonly shared today, simulated fairly.

Each is a small, working allocator with its own books (it does not use the
core). All share what is not the point of the comparison: the same placement
rule as ours (``binpack``: the GPUs left with the least room), the same
constraint matching (:func:`gpu_arbiter.core.filters.mismatch`), and a lease's
memory is freed only once its holder has stopped (a preempted holder takes
the world's ``stop_s`` to do so).

``fifo``
    First in, first out, without preemption: the oldest pending request is
    placed when it fits; while it does not, nothing behind it is (no
    overtaking, hence no starvation, but head-of-line blocking). Loads are not
    serialized. A finished run releases its lease (a batch queue's jobs).
``priority``
    Strict priority with nominations, as priority classes in Kubernetes: the
    queue is walked by (base priority desc, arrival asc) and every request that
    fits is placed (small requests overtake a large one that has no
    nomination; no aging). A request that fits nowhere preempts the cheapest
    set of preemptible leases of strictly lower priority on one worker (fewest,
    lowest priority, youngest), unless memory already being revoked will make
    room, and is nominated to the GPUs that memory frees: no request of lower
    or equal priority behind it takes that memory meanwhile. Loads are not
    serialized (a Kubernetes scheduler knows nothing of loads). A finished run
    releases its lease (a job's pod ends; no keep-warm: see ``prio-warm``).
``slots``
    Fixed, equal-size slots per GPU, counted as a generic resource (the way
    count-based schedulers and device plugins share a GPU): each GPU has
    ``slots_per_gpu`` slots of ``capacity / slots_per_gpu``; a request takes
    ``ceil(vram / slot)`` whole slots on each of its GPUs. Scheduled as
    ``priority`` (same order, same preemption, same nominations) over slots.
``prio-warm``
    ``priority`` run the way a competent operator runs model servers on
    Kubernetes: a finished model stays loaded (keep-warm) and serves the next
    request for it; idle models are reclaimed by a request of *any* priority,
    least recently used first, before any busy lease is preempted; at most one
    load at a time per GPU (a request that fits only on a GPU that is loading
    waits for it, nominated there).
``lru``
    Keep-loaded with LRU eviction (the way single-host model servers work): a
    finished model stays loaded (idle) and serves the next request for it
    without a load; requests are served first come, first served; when the
    oldest does not fit, idle models are evicted least recently used first
    (never a busy one; no priorities). One load at a time per worker. A request
    for a model that is busy loads another copy.
``ollama``
    As Ollama's scheduler: ``lru`` with one runner per model (a request for a
    model that has a runner, busy or loading, waits for that runner instead of
    loading a copy; requests for other models are not held up by it), one load
    at a time per GPU, idle runners unloaded least recently used first when
    the oldest request does not fit, and after the keep-alive. Not modelled:
    ``OLLAMA_MAX_LOADED_MODELS`` (a cap on the count of runners; memory binds
    first on these traces).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from ..core import GpuId
from ..core.filters import mismatch
from .base import Attempt, Step
from .cluster import Cluster

__all__ = [
    "BASELINES",
    "Fifo",
    "KeepLoadedLru",
    "Ollama",
    "PriorityWarm",
    "Slots",
    "StrictPriority",
]


@dataclass(slots=True)
class _Lease:
    """A lease in a baseline's books. Its flags change only through :class:`_Books`, which
    keeps the per-GPU figures derived from them."""

    attempt: Attempt
    gpus: tuple[GpuId, ...]
    reserved_mb: int
    granted_at: float
    loading: bool = True
    idle: bool = False
    revoking: bool = False
    last_used_at: float = 0.0

    @property
    def priority(self) -> int:
        return self.attempt.item.priority


@dataclass(slots=True)
class _Books:
    """Memory per GPU: what each lease reserved, and loads in progress per GPU and worker.

    Every figure a decision reads (free memory, loads, memory being revoked, the leases
    that could be victims) is kept up to date as leases come, change and go, so that a
    decision never recounts the leases: the simulator asks for these figures thousands of
    times a step on a large cluster."""

    capacity: dict[GpuId, int]
    workers: dict[str, list[GpuId]]
    leases: dict[str, _Lease] = field(default_factory=dict)
    by_gpu: dict[GpuId, dict[str, _Lease]] = field(default_factory=dict)
    free_mb: dict[GpuId, int] = field(default_factory=dict)
    loading: dict[GpuId, int] = field(default_factory=dict)
    loading_workers: Counter[str] = field(default_factory=Counter)
    revoking_mb: dict[GpuId, int] = field(default_factory=dict)
    revoking_count: int = 0
    busy_priorities: Counter[int] = field(default_factory=Counter)
    """Priorities of the preemptible leases that are neither idle nor being revoked."""
    busy_mb: dict[GpuId, Counter[int]] = field(default_factory=dict)
    """Their memory per GPU, by priority."""
    idle_count: int = 0
    """Idle leases not being revoked."""
    idle_mb: dict[GpuId, int] = field(default_factory=dict)
    """Their memory per GPU."""
    models: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        for gpu_id, capacity in self.capacity.items():
            self.by_gpu[gpu_id] = {}
            self.free_mb[gpu_id] = capacity
            self.loading[gpu_id] = 0
            self.revoking_mb[gpu_id] = 0
            self.busy_mb[gpu_id] = Counter()
            self.idle_mb[gpu_id] = 0

    def free(self, gpu_id: GpuId) -> int:
        return self.free_mb[gpu_id]

    def add(self, lease: _Lease) -> None:
        self.leases[lease.attempt.id] = lease
        for gpu_id in lease.gpus:
            self.by_gpu[gpu_id][lease.attempt.id] = lease
            self.free_mb[gpu_id] -= lease.reserved_mb
        self.models[lease.attempt.item.model] += 1
        self._count(lease, 1)

    def remove(self, lease_id: str) -> _Lease:
        lease = self.leases.pop(lease_id)
        self._count(lease, -1)
        for gpu_id in lease.gpus:
            del self.by_gpu[gpu_id][lease_id]
            self.free_mb[gpu_id] += lease.reserved_mb
        self.models[lease.attempt.item.model] -= 1
        if not self.models[lease.attempt.item.model]:
            del self.models[lease.attempt.item.model]
        return lease

    def change(
        self,
        lease: _Lease,
        *,
        loading: bool | None = None,
        idle: bool | None = None,
        revoking: bool | None = None,
    ) -> None:
        """Sets the lease's flags (None: unchanged), and the figures with them."""
        self._count(lease, -1)
        lease.loading = lease.loading if loading is None else loading
        lease.idle = lease.idle if idle is None else idle
        lease.revoking = lease.revoking if revoking is None else revoking
        self._count(lease, 1)

    def _count(self, lease: _Lease, sign: int) -> None:
        """Adds (``sign`` 1) or takes away (-1) the lease's share of the figures."""
        mb = sign * lease.reserved_mb
        busy = not lease.revoking and not lease.idle and lease.attempt.item.preemptible
        for gpu_id in lease.gpus:
            if lease.loading:
                self.loading[gpu_id] += sign
                self.loading_workers[gpu_id.worker] += sign
            if lease.revoking:
                self.revoking_mb[gpu_id] += mb
            elif lease.idle:
                self.idle_mb[gpu_id] += mb
            elif busy:
                _add(self.busy_mb[gpu_id], lease.priority, mb)
        if lease.revoking:
            self.revoking_count += sign
        elif lease.idle:
            self.idle_count += sign
        elif busy:
            _add(self.busy_priorities, lease.priority, sign)

    def busy_below_mb(self, gpu_id: GpuId, priority: int) -> int:
        """Memory on the GPU of the leases a busy preemption for ``priority`` could take."""
        return sum(mb for p, mb in self.busy_mb[gpu_id].items() if p < priority)

    def lowest_busy_priority(self) -> int | None:
        """The lowest priority of a lease a busy preemption could take (None: none)."""
        return min(self.busy_priorities, default=None)

    def on(self, gpu_id: GpuId) -> Iterable[_Lease]:
        return self.by_gpu[gpu_id].values()

    def loading_on(self, worker: str) -> bool:
        return self.loading_workers[worker] > 0

    def loading_gpu(self, gpu_id: GpuId) -> bool:
        return self.loading[gpu_id] > 0


def _add(counter: Counter[int], key: int, amount: int) -> None:
    """Adds to a count, dropping the key at zero (so that its keys are those present)."""
    counter[key] += amount
    if not counter[key]:
        del counter[key]


class _Baseline:
    """Shared books and verbs; subclasses decide."""

    name: ClassVar[str] = ""
    keeps_warm: ClassVar[bool] = False

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._labels = {worker.name: worker.labels for worker, _ in cluster.workers}
        self._gpus = {gpu.id: gpu for gpu in cluster.gpus}
        self.books = _Books(
            capacity=cluster.capacity_mb(),
            workers={worker.name: [g.id for g in gpus] for worker, gpus in cluster.workers},
        )
        self.pending: dict[str, Attempt] = {}
        self._queue = _Queue(self._queue_key)
        self._match_cache: dict[tuple[object, ...], dict[str, list[GpuId]]] = {}
        self._need_cache: dict[int, dict[GpuId, int]] = {}

    # verbs
    def submit(self, attempt: Attempt, now: float) -> str | None:
        if not self._placeable(attempt):
            return "no worker has enough matching GPUs large enough"
        self.pending[attempt.id] = attempt
        self._queue.add(attempt)
        return None

    def cancel(self, attempt_id: str) -> None:
        self._queue.discard(self.pending.pop(attempt_id))

    def ready(self, lease_id: str, now: float) -> None:
        lease = self.books.leases[lease_id]
        self.books.change(lease, loading=False)
        lease.last_used_at = now

    def set_idle(self, lease_id: str, idle: bool, now: float) -> None:
        lease = self.books.leases[lease_id]
        self.books.change(lease, idle=idle)
        lease.last_used_at = now

    def release(self, lease_id: str, now: float) -> None:
        self.books.remove(lease_id)

    def next_deadline(self) -> float | None:
        return None

    def check(self, now: float, step: Step, present: Mapping[str, tuple[GpuId, ...]]) -> list[str]:
        return []  # the world counts over-commit and concurrent loads for every policy

    def decide(self, now: float) -> Step:
        raise NotImplementedError

    # the queue
    @staticmethod
    def _queue_key(attempt: Attempt) -> tuple[int, ...]:
        """The order pending requests are considered in: first come, first served."""
        return (attempt.seq,)

    def _order(self) -> list[Attempt]:
        """The pending requests in queue order (a copy: granting changes the queue)."""
        return list(self._queue)

    # placement
    def _reserve_mb(self, vram_mb: int, capacity_mb: int) -> int:
        """What a request of ``vram_mb`` reserves on a GPU of ``capacity_mb``."""
        return vram_mb

    def _needs(self, attempt: Attempt) -> dict[GpuId, int]:
        """What the attempt reserves on each GPU (it depends on its size alone)."""
        vram_mb = attempt.item.vram_mb
        needs = self._need_cache.get(vram_mb)
        if needs is None:
            needs = {g: self._reserve_mb(vram_mb, c) for g, c in self.books.capacity.items()}
            self._need_cache[vram_mb] = needs
        return needs

    def _matching(self, attempt: Attempt) -> dict[str, list[GpuId]]:
        item = attempt.item
        key = (item.constraints, item.vram_mb, item.gpus)
        cached = self._match_cache.get(key)
        if cached is not None:
            return cached
        out: dict[str, list[GpuId]] = {}
        self._match_cache[key] = out
        for worker, ids in self.books.workers.items():
            fitting = [
                g
                for g in ids
                if mismatch(self._gpus[g], self._labels[worker], item.constraints, item.vram_mb)
                is None
            ]
            if len(fitting) >= item.gpus:
                out[worker] = fitting
        return out

    def _placeable(self, attempt: Attempt) -> bool:
        return bool(self._matching(attempt))

    def _fit(
        self, attempt: Attempt, room: Mapping[GpuId, int], gate: str | None = None
    ) -> tuple[GpuId, ...] | None:
        """Binpack: on the worker whose best GPUs are left with the least room. ``gate``:
        ``worker`` skips workers with a load under way, ``gpu`` GPUs with one."""
        best: tuple[tuple[int, str], tuple[GpuId, ...]] | None = None
        needs = self._needs(attempt)
        count = attempt.item.gpus
        loading = self.books.loading
        for worker, ids in self._matching(attempt).items():
            if gate == "worker" and self.books.loading_on(worker):
                continue
            if gate == "gpu":
                fits = [g for g in ids if room[g] >= needs[g] and not loading[g]]
            else:
                fits = [g for g in ids if room[g] >= needs[g]]
            if len(fits) < count:
                continue
            ranked = sorted(fits, key=lambda g: (room[g], g))[:count]
            score = (sum(room[g] for g in ranked), worker)
            if best is None or score < best[0]:
                best = (score, tuple(sorted(ranked)))
        return None if best is None else best[1]

    def _grant(self, attempt: Attempt, gpus: tuple[GpuId, ...], now: float) -> None:
        del self.pending[attempt.id]
        self._queue.discard(attempt)
        needs = self._needs(attempt)
        reserved = max(needs[g] for g in gpus)
        self.books.add(_Lease(attempt, gpus, reserved, now, last_used_at=now))

    def _take(self, attempt: Attempt, gpus: tuple[GpuId, ...], room: dict[GpuId, int]) -> None:
        """The attempt's memory on ``gpus`` is spoken for in this decision."""
        needs = self._needs(attempt)
        for g in gpus:
            room[g] -= needs[g]

    def _room(self) -> dict[GpuId, int]:
        return dict(self.books.free_mb)


class _Queue:
    """The pending requests kept in order as they come and go, so that a decision does not
    sort the whole queue again (most steps change it by a request or two)."""

    def __init__(self, key: Callable[[Attempt], tuple[int, ...]]) -> None:
        self._key = key
        self._keys: list[tuple[int, ...]] = []
        self._attempts: list[Attempt] = []

    def __iter__(self) -> Iterator[Attempt]:
        return iter(self._attempts)

    def add(self, attempt: Attempt) -> None:
        key = self._key(attempt)
        at = bisect.bisect(self._keys, key)
        self._keys.insert(at, key)
        self._attempts.insert(at, attempt)

    def discard(self, attempt: Attempt) -> None:
        key = self._key(attempt)
        at = bisect.bisect_left(self._keys, key)
        while self._attempts[at] is not attempt:
            at += 1
        del self._keys[at]
        del self._attempts[at]


class Fifo(_Baseline):
    name: ClassVar[str] = "fifo"

    def decide(self, now: float) -> Step:
        room = self._room()
        grants = []
        for attempt in self._order():
            gpus = self._fit(attempt, room)
            if gpus is None:
                break  # head-of-line: nothing overtakes the oldest request
            self._grant(attempt, gpus, now)
            grants.append((attempt.id, gpus))
            self._take(attempt, gpus, room)
        return Step(grants=tuple(grants))


_Plan = tuple[tuple[GpuId, ...], list[_Lease]]


class StrictPriority(_Baseline):
    """See the module docstring. A decision walks the queue once; a request that can
    neither be placed nor make room by preemption is skipped without a search when one of
    the same shape (constraints, size, GPUs, priority) already failed in this decision
    and nothing was granted since: free memory only shrinks within a decision, and
    marking a victim moves its memory from "could be preempted" to "being revoked", so
    what could not be made room for stays so until a grant adds a lease."""

    name: ClassVar[str] = "priority"
    gate: ClassVar[str | None] = None

    @staticmethod
    def _queue_key(attempt: Attempt) -> tuple[int, ...]:
        return (-attempt.item.priority, attempt.seq)

    def decide(self, now: float) -> Step:
        room = self._room()
        grants: list[tuple[str, tuple[GpuId, ...]]] = []
        revocations: list[tuple[str, str]] = []
        hopeless: set[tuple[object, ...]] = set()
        for attempt in self._order():
            item = attempt.item
            shape = (item.constraints, item.vram_mb, item.gpus, item.priority)
            if shape in hopeless:
                continue
            gpus = self._fit(attempt, room, self.gate)
            if gpus is not None:
                self._grant(attempt, gpus, now)
                grants.append((attempt.id, gpus))
                self._take(attempt, gpus, room)
                hopeless.clear()  # the new lease may be a victim for the next ones
                continue
            gated = self._fit(attempt, room) if self.gate else None
            plan = (gated, []) if gated is not None else self._victims(attempt, room)
            if plan is None:
                hopeless.add(shape)
                continue  # nothing to preempt: it waits, and others may overtake
            held, victims = plan
            for victim in victims:
                self.books.change(victim, revoking=True)
                revocations.append((victim.attempt.id, "preempted"))
            self._take(attempt, held, room)  # nominated: no lower request takes this memory
        return Step(grants=tuple(grants), revocations=tuple(revocations))

    def _victim_key(self, attempt: Attempt, lease: _Lease) -> tuple[float, ...] | None:
        """Where ``lease`` comes in the order of victims for ``attempt`` (None: it may not be
        one): preemptible leases of strictly lower priority, lowest and youngest first."""
        if lease.revoking or lease.idle:
            return None
        if not lease.attempt.item.preemptible or lease.priority >= attempt.item.priority:
            return None
        return (1, lease.priority, -lease.granted_at, lease.attempt.seq)

    def _may_take(self, attempt: Attempt) -> bool:
        """Whether any lease at all could be a victim for ``attempt``."""
        lowest = self.books.lowest_busy_priority()
        return lowest is not None and lowest < attempt.item.priority

    def _revoked_will_do(self, attempt: Attempt, room: Mapping[GpuId, int]) -> bool:
        """Whether memory being revoked alone makes room for ``attempt`` on some worker."""
        needs = self._needs(attempt)
        revoking = self.books.revoking_mb
        return any(
            sum(room[g] + revoking[g] >= needs[g] for g in ids) >= attempt.item.gpus
            for ids in self._matching(attempt).values()
        )

    def _victims_mb(self, attempt: Attempt, gpu_id: GpuId) -> int:
        """The memory of every lease on the GPU that may be a victim for ``attempt``."""
        return self.books.busy_below_mb(gpu_id, attempt.item.priority)

    def _victims(self, attempt: Attempt, room: Mapping[GpuId, int]) -> _Plan | None:
        """The cheapest victims on one worker, and the GPUs they free (no victims while
        revoked memory will do); None when no set of victims makes room."""
        if not self._may_take(attempt) and not (
            self.books.revoking_count and self._revoked_will_do(attempt, room)
        ):
            return None  # what the search would find: with no victims, only revoked memory
        best: tuple[tuple[int, int, int, str], _Plan] | None = None
        needs = self._needs(attempt)
        for worker, ids in self._matching(attempt).items():
            plans = []
            for gpu_id in ids:
                plan = self._victims_on(attempt, gpu_id, room[gpu_id], needs[gpu_id])
                if plan is not None:
                    plans.append((_cost(plan), gpu_id, plan))
            if len(plans) < attempt.item.gpus:
                continue
            plans.sort(key=lambda p: (p[0], p[1]))
            chosen = plans[: attempt.item.gpus]
            victims = {v.attempt.id: v for *_, plan in chosen for v in plan}
            key = (*_cost(list(victims.values())), worker)
            if best is None or key < best[0]:
                gpus = tuple(sorted(gpu_id for _, gpu_id, _ in chosen))
                best = (key, (gpus, sorted(victims.values(), key=lambda v: v.attempt.id)))
        return None if best is None else best[1]

    def _victims_on(
        self, attempt: Attempt, gpu_id: GpuId, room: int, need: int
    ) -> list[_Lease] | None:
        room += self.books.revoking_mb[gpu_id]
        if room >= need:
            return []
        if room + self._victims_mb(attempt, gpu_id) < need:
            return None  # not even with every lease it may take
        keyed = [
            (key, lease)
            for lease in self.books.on(gpu_id)
            if (key := self._victim_key(attempt, lease))
        ]
        chosen = []
        for _, lease in sorted(keyed, key=lambda pair: pair[0]):
            if room >= need:
                break
            chosen.append(lease)
            room += lease.reserved_mb
        return chosen if room >= need else None


def _cost(victims: list[_Lease]) -> tuple[int, int, int]:
    """How much a set of victims costs: busy ones, then how many, then their priorities."""
    return (
        sum(not v.idle for v in victims),
        len(victims),
        sum(v.priority for v in victims),
    )


class Slots(StrictPriority):
    name: ClassVar[str] = "slots"
    slots_per_gpu: ClassVar[int] = 4

    def _reserve_mb(self, vram_mb: int, capacity_mb: int) -> int:
        slot_mb = capacity_mb // self.slots_per_gpu
        slots = -(-vram_mb // slot_mb)
        return min(slots * slot_mb, capacity_mb)


class PriorityWarm(StrictPriority):
    name: ClassVar[str] = "prio-warm"
    keeps_warm: ClassVar[bool] = True
    gate: ClassVar[str | None] = "gpu"

    def _victim_key(self, attempt: Attempt, lease: _Lease) -> tuple[float, ...] | None:
        """Idle models first, by anyone, least recently used first; then busy ones as
        ``priority``."""
        if lease.idle and not lease.revoking:
            return (0, 0, lease.last_used_at, lease.attempt.seq)
        return super()._victim_key(attempt, lease)

    def _may_take(self, attempt: Attempt) -> bool:
        return self.books.idle_count > 0 or super()._may_take(attempt)

    def _victims_mb(self, attempt: Attempt, gpu_id: GpuId) -> int:
        return self.books.idle_mb[gpu_id] + super()._victims_mb(attempt, gpu_id)


class KeepLoadedLru(_Baseline):
    name: ClassVar[str] = "lru"
    keeps_warm: ClassVar[bool] = True
    gate: ClassVar[str] = "worker"
    one_runner_per_model: ClassVar[bool] = False

    def decide(self, now: float) -> Step:
        room = self._room()
        grants: list[tuple[str, tuple[GpuId, ...]]] = []
        runners = self._runners()
        for attempt in self._order():
            if attempt.item.model in runners:
                continue  # the model's one runner serves it when it is free
            gpus = self._fit(attempt, room, self.gate)
            if gpus is not None:
                self._grant(attempt, gpus, now)
                grants.append((attempt.id, gpus))
                self._take(attempt, gpus, room)
                if self.one_runner_per_model:
                    runners.add(attempt.item.model)
                continue
            if self._fit(attempt, room) is not None:
                break  # it fits, once the load under way there is done
            victims = self._evict(attempt, room)
            return Step(
                grants=tuple(grants),
                revocations=tuple((v.attempt.id, "preempted") for v in victims),
            )  # first come, first served: the oldest waits for its memory
        return Step(grants=tuple(grants))

    def _runners(self) -> set[str]:
        """Models that have a runner (loading, running, idle or unloading) when each model
        has one runner at most; none otherwise (a busy model gets another copy)."""
        if not self.one_runner_per_model:
            return set()
        return set(self.books.models)

    def _evict(self, attempt: Attempt, room: Mapping[GpuId, int]) -> list[_Lease]:
        """Idle models, least recently used first, until the request fits on one worker;
        none while evictions under way will do."""
        best: tuple[tuple[int, float, str], list[_Lease]] | None = None
        need = attempt.item.vram_mb
        for worker, ids in self._matching(attempt).items():
            plans = []
            for gpu_id in ids:
                plan = self._lru_on(gpu_id, room[gpu_id], need)
                if plan is not None:
                    plans.append((len(plan), gpu_id, plan))
            if len(plans) < attempt.item.gpus:
                continue
            plans.sort(key=lambda p: (p[0], p[1]))
            victims = {v.attempt.id: v for *_, plan in plans[: attempt.item.gpus] for v in plan}
            key = (len(victims), max((v.last_used_at for v in victims.values()), default=0), worker)
            if best is None or key < best[0]:
                best = (key, sorted(victims.values(), key=lambda v: v.attempt.id))
        chosen = [] if best is None else best[1]
        for victim in chosen:
            self.books.change(victim, revoking=True)
        return chosen

    def _lru_on(self, gpu_id: GpuId, room: int, need: int) -> list[_Lease] | None:
        room += self.books.revoking_mb[gpu_id]
        chosen: list[_Lease] = []
        if room >= need:
            return chosen
        idle = sorted(
            (lease for lease in self.books.on(gpu_id) if lease.idle and not lease.revoking),
            key=lambda lease: (lease.last_used_at, lease.attempt.seq),
        )
        for lease in idle:
            if room >= need:
                break
            chosen.append(lease)
            room += lease.reserved_mb
        return chosen if room >= need else None


class Ollama(KeepLoadedLru):
    name: ClassVar[str] = "ollama"
    gate: ClassVar[str] = "gpu"
    one_runner_per_model: ClassVar[bool] = True


BASELINES: dict[str, type[_Baseline]] = {
    cls.name: cls for cls in (Fifo, StrictPriority, Slots, KeepLoadedLru, PriorityWarm, Ollama)
}
