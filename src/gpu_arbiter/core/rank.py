"""The walk's scratch, and the rank stages: where a request that fits goes.

A cycle's walk (:mod:`.cycle`) keeps, over the state it only reads, what the plan has
decided so far (:class:`Ranked`): the overlay of its grants and endings, its holds, its
revocations and nominations, the victim counts. For a request, the filters of
:mod:`.stages` say which GPUs may take it now; the rank stages, tried in order, say which
of those (:data:`RANK`: the first that finds GPUs decides)::

    own_nomination   memory its own preemption freed, held for it (I6)
    preferred        the workers it prefers, where a model last ran (affinity)
    by_room          binpack (least room left) or spread (most room), then GPU id

A rank is an order, never a "no": it changes where a request is placed, never whether.
A new preference (NUMA, a MIG slice's neighbours) is one more stage here.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping

from .diagnosis import Turn
from .endings import Endings
from .model import Constraints, GpuId, Lease, LeaseState, Request, Worker
from .nominations import Holds, Nomination
from .overlay import Overlay
from .stages import fit_code, fits
from .view import View

__all__ = ["RANK", "Ranked", "by_worker"]

_NO_LIMIT = 1 << 62  # no load gate: a nomination asks for room, not for a load slot


class Ranked:
    """One cycle's scratch: its holds, its decisions so far, the state as they leave it.
    Reads like the stages' :class:`~.stages.State` (``policy``, ``workers``, ``ledger``:
    the overlay, ``matching``)."""

    def __init__(self, view: View, now: float, ended: Endings) -> None:
        self.view = view
        self.policy = view.policy
        self.spread = view.policy.placement == "spread"
        self.workers: Mapping[str, Worker] = view.workers
        self.matching = view.matching
        self.mismatches = view.mismatches
        self.unusable = view.unusable
        self.index = view.ledger.by_free
        self.ledger = overlay = Overlay(view.ledger)
        self.now = now
        self.holds = Holds()  # the queue walk's; the lone request's grant holds nothing
        self.grants: list[Lease] = []
        self.granted: set[str] = set()  # their ids, while walking
        self.preempted: dict[str, Lease] = {}  # revoked by this walk, for its preemptors
        self.current: dict[str, Lease | None] = dict(ended.leases)  # leases as the plan leaves them
        self.ended = ended.requests  # pending requests the plan ends before placement
        self.nominations: dict[str, Nomination] | None = None  # copied once changed
        self.retries: set[float] = set()
        self.failed_at: dict[tuple[int, int, Constraints], int] = {}
        self.turns: dict[str, Turn] = {}  # requests examined and not placed
        self.waits_on: tuple[GpuId, ...] = ()  # the post-filter's: memory being revoked there
        self.examined = 0
        self.victims: dict[int, int] | None = None  # the state's counts, copied once changed
        self.idle: dict[int, int] | None = None
        self.walking = False  # the queue walk (not the lone request's grant) is on
        for lease_id, now_as in ended.leases.items():
            before = view.leases[lease_id]
            if now_as is None:
                overlay.end(before, loading=before.loading)
                self._count(before, -1)
            elif now_as.state is LeaseState.REVOKING and before.state is not LeaseState.REVOKING:
                self._count(before, -1)
                if before.loading and not now_as.loading:
                    overlay.finish_loading(before)
            elif before.loading and not now_as.loading:
                overlay.finish_loading(before)

    # ------------------------------------------------------------------ the overlay

    def lease(self, lease_id: str) -> Lease | None:
        """A held lease as the plan leaves it so far (None: the plan ends it)."""
        if lease_id in self.current:
            return self.current[lease_id]
        return self.view.leases[lease_id]

    def nomination(self, request_id: str) -> Nomination | None:
        noms = self.view.nominations if self.nominations is None else self.nominations
        return noms.get(request_id)

    def _nominations(self) -> dict[str, Nomination]:
        if self.nominations is None:
            self.nominations = dict(self.view.nominations)
        return self.nominations

    def _count(self, lease: Lease, delta: int) -> None:
        if lease.state is LeaseState.REVOKING or not (lease.idle or lease.request.preemptible):
            return
        if self.victims is None or self.idle is None:
            self.victims, self.idle = self.view.victim_counts()
        counter = self.idle if lease.idle else self.victims
        count = counter.pop(lease.base_priority, 0) + delta
        if count > 0:
            counter[lease.base_priority] = count

    def could_preempt(self, highest_pending: int) -> bool:
        """Whether a request of this base priority might find a victim (now or, for idle
        leases, once time has passed: the plan then says when)."""
        if self.victims is None or self.idle is None:
            victims, idle = self.view.victim_counts(copy=False)
        else:
            victims, idle = self.victims, self.idle
        if victims and min(victims) < highest_pending:
            return True
        if not idle:
            return False
        policy = self.policy
        reclaim_later = math.isfinite(policy.idle_reclaim_s) or math.isfinite(policy.starvation_s)
        return reclaim_later or min(idle) <= highest_pending

    def retry_at(self, at: float) -> None:
        if math.isfinite(at) and not self.view.retry_pending(at):
            self.retries.add(at)

    def final_holds(self) -> tuple[tuple[str, tuple[GpuId, ...], int], ...]:
        return tuple(self.holds.journal)

    def special(self) -> Iterator[tuple[GpuId, int, int]]:
        """The GPUs the index cannot rank: held this cycle or changed by the plan, with
        their free memory and what is held there (:meth:`indexed` says the others)."""
        holds, ledger = self.holds.by_gpu, self.ledger
        touched = ledger.touched
        for gpu_id, hold in holds.items():
            yield gpu_id, ledger.free_mb(gpu_id), hold
        for gpu_id, free in touched.items():
            if gpu_id not in holds:
                yield gpu_id, free, 0

    def indexed(self, gpu_id: GpuId) -> bool:
        """Whether the index's free memory is the GPU's, with nothing held there."""
        return gpu_id not in self.holds.by_gpu and gpu_id not in self.ledger.touched

    def fit(self, request: Request) -> tuple[GpuId, ...] | None:
        """The best GPUs where the request fits now (the filters of :mod:`.stages`: I1,
        I2, I3, I6, I7), or None: the rank stages (:data:`RANK`) in order, the first that
        finds GPUs deciding."""
        for stage in RANK:
            gpus = stage(self, request)
            if gpus is not None:
                return gpus
        return None

    def own_nomination(self, request: Request) -> tuple[GpuId, ...] | None:
        """Memory its own preemption freed: its nomination's GPUs, if it fits on them."""
        nomination = self.nomination(request.id) if self.walking else None
        holds = self.holds.by_gpu
        if nomination is not None and all(fits(self, request, g, holds) for g in nomination.gpus):
            return nomination.gpus
        return None

    def preferred(self, request: Request) -> tuple[GpuId, ...] | None:
        """Affinity: the best GPUs, by binpack or spread, among those of the request's
        preferred workers where it fits now (``constraints.prefer_workers``: where a model
        last ran), or None for placement to go on as if it preferred nothing. A rank,
        never a filter: it changes where a request is placed, never whether (nor its
        reasons, victims or nomination)."""
        if not request.constraints.prefer_workers:
            return None
        holds = self.holds.by_gpu
        fitting = [
            gpu_id
            for name in request.constraints.prefer_workers
            for gpu_id in self.view.gpu_ids(name)
            if fits(self, request, gpu_id, holds)
        ]
        return self.best(request, fitting, spread=self.spread) if fitting else None

    def by_room(self, request: Request) -> tuple[GpuId, ...] | None:
        """Binpack (least room left) or spread (most), over every GPU where it fits."""
        if request.gpus == 1:
            one = self.pick_one(request, need=request.vram_mb, spread=self.spread, gate=True)
            return None if one is None else (one,)
        holds = self.holds.by_gpu
        fitting = [g for g in self.matching(request) if fits(self, request, g, holds)]
        return self.best(request, fitting, spread=self.spread)

    def room(self, gpu_id: GpuId) -> int:
        return self.ledger.free_mb(gpu_id) - self.holds.by_gpu.get(gpu_id, 0)

    def pick_one(
        self, request: Request, *, need: int | None, spread: bool, gate: bool
    ) -> GpuId | None:
        """The best single GPU by bisection of the ledger's free-memory index: the stages
        (a matching, usable GPU where :func:`~.stages.fit_code` lets ``need`` through, any
        room if None, the load gate only with ``gate``), ranked by least room (binpack) or
        most (spread), then GPU id. GPUs held this cycle or changed by the plan are checked
        one by one (they are few)."""
        matching = self.matching(request)
        ledger = self.ledger
        limit = self.policy.max_concurrent_loads if gate else _NO_LIMIT
        floor = -(1 << 62) if need is None else need
        sign = -1 if spread else 1
        best: tuple[int, GpuId] | None = None

        idle = self.unusable()  # GPUs that may take no new work (cached by the state)

        def consider(free: int, hold: int, gpu_id: GpuId, loads: Callable[[GpuId], int]) -> None:
            nonlocal best
            if gpu_id not in matching or (idle and gpu_id in idle):
                return
            loading = loads(gpu_id) if gate else 0
            if fit_code(free, hold, loading, floor, limit) is not None:
                return
            room = free - hold
            if best is None or (sign * room, gpu_id) < (sign * best[0], best[1]):
                best = (room, gpu_id)

        for gpu_id, free, hold in self.special():
            consider(free, hold, gpu_id, ledger.loading)  # the plan's loads too
        holds, touched = self.holds.by_gpu, ledger.touched
        unchanged = ledger.ledger.loading  # a GPU the plan did not touch: the ledger's
        index = self.index
        if spread:
            positions: Iterable[int] = range(len(index) - 1, -1, -1)
        else:
            positions = range(bisect.bisect_left(index, (floor,)), len(index))
        for i in positions:
            free, gpu_id = index[i]
            if free < floor or (best is not None and sign * free > sign * best[0]):
                break
            if not spread and best is not None and (free, gpu_id) > best:
                break  # the index ascends by (room, id), binpack's own order: none can win
            if gpu_id not in holds and gpu_id not in touched:  # else considered above
                consider(free, 0, gpu_id, unchanged)
        return None if best is None else best[1]

    def best(
        self, request: Request, gpu_ids: Iterable[GpuId], *, spread: bool
    ) -> tuple[GpuId, ...] | None:
        """Ranks workers' best ``gpus`` GPUs: binpack (least room left) or spread (most)."""
        best: tuple[tuple[int, str], tuple[GpuId, ...]] | None = None
        sign = -1 if spread else 1
        for worker, ids in by_worker(gpu_ids).items():
            if len(ids) < request.gpus:
                continue
            ranked = sorted(ids, key=lambda g: (sign * self.room(g), g))[: request.gpus]
            score = (sign * sum(self.room(g) for g in ranked), worker)
            if best is None or score < best[0]:
                best = (score, tuple(sorted(ranked)))
        return None if best is None else best[1]


RANK: tuple[Callable[[Ranked, Request], tuple[GpuId, ...] | None], ...] = (
    Ranked.own_nomination,
    Ranked.preferred,
    Ranked.by_room,
)


def by_worker(gpu_ids: Iterable[GpuId]) -> dict[str, list[GpuId]]:
    grouped: dict[str, list[GpuId]] = {}
    for gpu_id in gpu_ids:
        grouped.setdefault(gpu_id.worker, []).append(gpu_id)
    return grouped
