"""The post-filter stages: what may help a request that fits nowhere.

Tried in order (:data:`POST_FILTER`), the first that answers decides; each holds memory
for the request against the requests behind it (I6, :mod:`.nominations`)::

    victims_stopping   its own preemption's victims are still stopping: it keeps their
                       memory (True: memory is on its way back for it)
    preempt            leases to revoke, the cheapest on one worker, that make room (I5,
                       :mod:`.preemption`: keep-warm reclaim first); none needed when
                       memory already being revoked will do (True)
    nominate           nothing will help now: it holds the GPUs where it is closest to
                       fitting (False: its class may be dropped for the cycle)

A new way of making room (a MIG reconfiguration, a swap to host memory) is one more
stage here.
"""

from __future__ import annotations

from collections.abc import Callable

from .model import GpuId, Lease, LeaseState, Request
from .nominations import Nomination
from .preemption import Victims, eligible_from, plan_for_gpu
from .rank import Ranked, by_worker
from .stages import usable

__all__ = ["POST_FILTER", "PostFiltered"]


class PostFiltered(Ranked):
    def post_filter(self, request: Request) -> bool:
        """Holds memory for a request that does not fit; True when memory is on its way
        back for it (see the module)."""
        for stage in POST_FILTER:
            answer = stage(self, request)
            if answer is not None:
                return answer
        return False

    def victims_stopping(self, request: Request) -> bool | None:
        nomination = self.nomination(request.id)
        if nomination is not None and nomination.preempting(self.view.ledger):
            self.holds.hold(request, nomination.gpus, own=True)
            return True
        if nomination is not None:  # its victims are gone, and it does not fit: a new plan
            del self._nominations()[request.id]
        return None

    def preempt(self, request: Request) -> bool | None:
        found = self.plan_victims(request) if self.could_preempt(request.priority) else None
        if found is None:
            return None
        gpus, victims = found
        if not victims:  # memory already on its way back: wait for it
            self.holds.hold(request, gpus)
            self.waits_on = gpus  # the why names the revoked leases there
            return True
        for victim in victims:
            self.revoke(victim, request)
        self._nominations()[request.id] = Nomination(gpus, {v.id for v in victims})
        self.holds.hold(request, gpus, own=True)
        return True

    def nominate_best(self, request: Request) -> bool:
        self.holds.hold(request, self.nominate(request))
        return False

    def revoke(self, victim: Lease, preemptor: Request) -> None:
        self._count(victim, -1)
        revoked = self.view.revoked(victim, "preempted", self.now, preemptor.id)
        self.preempted[victim.id] = self.current[victim.id] = revoked

    def nominate(self, request: Request) -> tuple[GpuId, ...]:
        """The GPUs where the request is closest to fitting (most room); () if none usable."""
        if request.gpus == 1:
            one = self.pick_one(request, need=None, spread=True, gate=False)
            return () if one is None else (one,)
        usable_ids = [g for g in self.matching(request) if usable(self, g)]
        return self.best(request, usable_ids, spread=True) or ()

    def plan_victims(self, request: Request) -> tuple[tuple[GpuId, ...], tuple[Lease, ...]] | None:
        """The cheapest victims on one worker that make room for the request (I5); no victims
        when memory already being revoked will make room."""
        best: tuple[tuple[object, ...], tuple[GpuId, ...], tuple[Lease, ...]] | None = None
        candidates = [g for g in self.matching(request) if usable(self, g)]
        for worker, ids in by_worker(candidates).items():
            if len(ids) < request.gpus:
                continue
            plans: list[tuple[tuple[object, ...], GpuId, Victims]] = []
            for gpu_id in ids:
                victims = self.victims_on(request, gpu_id)
                if victims is not None:
                    plans.append((victims.cost, gpu_id, victims))
            if len(plans) < request.gpus:
                continue
            plans.sort(key=lambda item: (item[0], item[1]))
            chosen = plans[: request.gpus]
            union = {v.id: v for _, _, found in chosen for v in found.victims}
            combined = Victims(tuple(sorted(union.values(), key=lambda v: v.id)))
            key = (combined.cost, worker)
            if best is None or key < best[0]:
                best = (key, tuple(sorted(g for _, g, _ in chosen)), combined.victims)
        return None if best is None else (best[1], best[2])

    def victims_on(self, request: Request, gpu_id: GpuId) -> Victims | None:
        """The cheapest victims on one GPU (None: none make room). No victims when the GPU
        has the room beyond the holds ahead, its load gate closed or memory on its way back:
        that empty plan is the cheapest, so the request waits for the gate (a load ends
        within its load timeout) instead of interrupting busy work elsewhere."""
        held = self.holds.by_gpu.get(gpu_id, 0)
        revoking: set[str] = set()
        candidates = []
        for lid in self.ledger.lease_ids(gpu_id):  # the plan's own grants are not there
            lease = self.lease(lid)
            if lease is None:
                continue
            if lease.state is LeaseState.REVOKING:
                revoking.add(lid)
                continue
            since = eligible_from(lease, request, self.policy)
            if since <= self.now:
                candidates.append(lease)
            else:  # eligible later (age, idle time, wait): run the cycle again then
                self.retry_at(since)

        def enough(victims: set[str]) -> bool:
            return self.ledger.free_after(gpu_id, victims | revoking) - held >= request.vram_mb

        if enough(set()):  # memory already on its way back: wait for it, revoke nothing
            return Victims(())
        if not candidates:
            return None
        deficit = request.vram_mb - (self.ledger.free_after(gpu_id, revoking) - held)
        return plan_for_gpu(candidates, deficit, enough)


POST_FILTER: tuple[Callable[[PostFiltered, Request], bool | None], ...] = (
    PostFiltered.victims_stopping,
    PostFiltered.preempt,
    PostFiltered.nominate_best,
)
