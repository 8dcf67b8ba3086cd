"""The placement walk: one cycle's plan, made against the scheduler's state.

:func:`plan` walks the pending requests in queue order (effective priority desc, seq
asc) and, for each, asks the stages (:mod:`.stages`) where it fits, ranks those GPUs,
and when none fits plans preemption or holds a nomination (:mod:`.nominations`). What
it decides goes into a :class:`~.plan.Plan`; the state is left as it was.

The walk sees its own decisions as it goes, as the next request must: a lease granted
earlier in the walk is committed to the ledger for the rest of the walk (the ledger's
exact accounting, I2, decides what is left) and uncommitted when the walk ends;
revocations, nominations and the victim counts are kept in the walk's overlay.

The walk goes class by class (base priority, shape): a class whose head can neither be
placed nor preempt is dropped for the cycle. It stops once no GPU has room for the
smallest pending request and no pending request could preempt anything. Afterwards no
pending request that the pause, a load gate, a hold ahead of it or its constraints do
not hold back could be granted (I10).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .model import Constraints, GpuId, Lease, LeaseState, Request, WorkerStatus
from .nominations import Holds, Nomination
from .plan import Plan
from .preemption import Victims, eligible_from, plan_for_gpu
from .stages import fits, usable

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["plan"]


def plan(
    state: Scheduler,
    now: float,
    waits: Sequence[str] = (),
    drained: tuple[tuple[str, WorkerStatus, WorkerStatus], ...] = (),
) -> Plan:
    """What one cycle at ``now`` grants, revokes and holds (see the module); ``waits``:
    pending requests whose ``max_wait_s`` ended, timed out unless granted now;
    ``drained``: the draining workers left empty, as the state says."""
    walk = _Walk(state, now)
    if not state.paused and not walk.place_alone():
        try:
            walk.place()
        finally:
            walk.undo()
    timed_out: tuple[str, ...] = ()
    if waits:
        granted = {lease.id for lease in walk.grants}
        timed_out = tuple(r for r in waits if r in state.queue and r not in granted)
    return Plan(
        now=now,
        first_token=state.next_token,
        grants=tuple(walk.grants),
        revocations=tuple(walk.revoked.values()),
        nominations=walk.nominations,
        timed_out=timed_out,
        drained=drained,
        retries=tuple(sorted(walk.retries)) if walk.retries else (),
        journal=tuple(walk.holds.journal),
        examined=walk.examined,
    )


class _Walk:
    """One cycle's scratch: its holds, its decisions so far, the state as they change it."""

    def __init__(self, state: Scheduler, now: float) -> None:
        self.state = state
        self.ledger = state.ledger
        self.policy = state.policy
        self.now = now
        self.holds = _NO_HOLDS  # the lone request's grant holds nothing; the walk does
        self.grants: list[Lease] = []
        self.granted: set[str] = set()  # their ids, while walking
        self.revoked: dict[str, Lease] = {}
        self.nominations: dict[str, Nomination] | None = None  # copied once changed
        self.retries: set[float] = set()
        self.failed_shapes: dict[tuple[int, int, Constraints], int] = {}
        self.examined = 0
        self.victims: dict[int, int] | None = None  # the state's counts, copied once changed
        self.idle: dict[int, int] | None = None
        self.walking = False  # the queue walk (not the lone request's grant) is on

    # ------------------------------------------------------------------ the overlay

    def undo(self) -> None:
        """The walk's own grants leave the ledger: the state is as it was."""
        for lease in reversed(self.grants):
            self.ledger.uncommit(lease)

    def nomination(self, request_id: str) -> Nomination | None:
        noms = self.state.nominations if self.nominations is None else self.nominations
        return noms.get(request_id)

    def _nominations(self) -> dict[str, Nomination]:
        if self.nominations is None:
            self.nominations = dict(self.state.nominations)
        return self.nominations

    def _count(self, lease: Lease, delta: int) -> None:
        if lease.state is LeaseState.REVOKING or not (lease.idle or lease.request.preemptible):
            return
        if self.victims is None or self.idle is None:
            self.victims, self.idle = self.state.victim_counts()
        counter = self.idle if lease.idle else self.victims
        count = counter.pop(lease.base_priority, 0) + delta
        if count > 0:
            counter[lease.base_priority] = count

    def could_preempt(self, highest_pending: int) -> bool:
        """Whether a request of this base priority might find a victim (now or, for idle
        leases, once time has passed: the plan then says when)."""
        if self.victims is None or self.idle is None:
            victims, idle = self.state.victim_counts(copy=False)
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
        if math.isfinite(at) and not self.state.retry_pending(at):
            self.retries.add(at)

    # ------------------------------------------------------------------ placement

    def place_alone(self) -> bool:
        """Grants a lone pending request where it fits now, when no memory is held for a
        preemptor; False (nothing done) otherwise, for :meth:`place` to walk the queue.

        The uncontended arbiter's case (an in-process ``acquire``): the walk would examine
        this one request and grant it on exactly these GPUs, without its machinery."""
        request = self.state.queue.only()
        if request is None or self.state.nominations:
            return False
        gpus = self.fit(request)
        if gpus is None:
            return False
        self.grant(request, gpus)
        self.examined += 1
        return True

    def place(self) -> None:
        """Walks the queue class by class (see :class:`~.queue.Walk`): a class whose head
        can neither be placed nor preempt is dropped for the rest of the cycle, so the
        cycle's cost follows the number of classes, not of requests. A request holding
        memory freed by its own preemption is walked on its own, never dropped with its
        class: that memory is held for it alone (I10)."""
        queue = self.state.queue
        smallest = queue.smallest_vram_mb()
        if smallest is None:
            return
        highest = max(queue.priorities())
        self.walking = True
        self.holds = Holds()
        self.prehold()
        walk = queue.walk(self.policy, self.now, alone=list(self.holds.preheld))
        for request in walk:
            preheld, lifted = self.holds.turn(request)
            room_left = self.max_room() >= smallest
            if not room_left and not self.holds.preheld and not self.could_preempt(highest):
                break
            outcome = self.turn(request, room_left=room_left, preheld=preheld)
            self.holds.end_turn(lifted)
            if outcome is False:
                walk.drop()
        self.examined += walk.examined
        if self.grants and self.state.nominations:
            noms = self._nominations()
            for lease in self.grants:
                noms.pop(lease.id, None)

    def turn(self, request: Request, *, room_left: bool, preheld: bool) -> bool | None:
        """One request's turn: True when granted, None when memory is on its way back for it,
        False when neither it nor the rest of its class (younger, no more rights, less room)
        can be placed in this cycle."""
        shape = request.shape
        if not preheld and self.failed_shapes.get(shape, -1) >= request.priority:
            if room_left:  # it cannot fit either, but it still holds its best GPU (I6)
                self.holds.hold(request, self.nominate(request))
            return False
        if not room_left and not preheld and not self.could_preempt(request.priority):
            return False  # can neither fit nor preempt, and nobody behind can fit: no hold needed
        gpus = self.fit(request)
        if gpus is not None:
            self.grant(request, gpus)
            return True
        if self.preempt_or_nominate(request):
            return None
        self.failed_shapes[shape] = max(self.failed_shapes.get(shape, -1), request.priority)
        return False

    def prehold(self) -> None:
        """Pre-holds the memory preemption frees for its preemptors (see
        :mod:`.nominations`). A nomination whose victims are gone and where its preemptor
        no longer fits at all (memory taken by strangers meanwhile) is dropped first: it
        would hold memory for nobody."""
        queue = self.state.queue
        for request_id, nomination in list(self.state.nominations.items()):
            if not all(g in self.ledger for g in nomination.gpus):  # its worker was removed
                del self._nominations()[request_id]
            elif request_id in queue:
                request = queue.get(request_id)
                if not self.state.holds_memory(request, nomination):
                    del self._nominations()[request_id]
                    continue
                self.holds.prehold(request, nomination.gpus)

    def max_room(self) -> int:
        """The most memory any usable GPU has beyond the holds of this cycle."""
        best = -(1 << 62)
        state, ledger = self.state, self.ledger
        for gpu_id, hold in self.holds.by_gpu.items():
            if usable(state, gpu_id):
                best = max(best, ledger.free_mb(gpu_id) - hold)
        index = ledger.by_free
        for i in range(len(index) - 1, -1, -1):
            free, gpu_id = index[i]
            if free <= best:
                break
            if gpu_id not in self.holds.by_gpu and usable(state, gpu_id):
                return free
        return best

    def fit(self, request: Request) -> tuple[GpuId, ...] | None:
        """The best GPUs where the request fits now (the stages: I1, I2, I3, I6, I7), or
        None. Its own nomination first, then its preferred workers (:meth:`preferred`),
        then every GPU."""
        holds = self.holds.by_gpu
        nomination = self.nomination(request.id) if self.walking else None
        if nomination is not None and all(
            fits(self.state, request, g, holds) for g in nomination.gpus
        ):
            return nomination.gpus
        spread = self.policy.placement == "spread"
        if request.constraints.prefer_workers:
            preferred = self.preferred(request, spread=spread)
            if preferred is not None:
                return preferred
        if request.gpus == 1:
            one = self.pick_one(request, need=request.vram_mb, spread=spread, gate=True)
            return None if one is None else (one,)
        fitting = [g for g in self.state.matching(request) if fits(self.state, request, g, holds)]
        return self.best(request, fitting, spread=spread)

    def preferred(self, request: Request, *, spread: bool) -> tuple[GpuId, ...] | None:
        """The rank stage's affinity: the best GPUs, by binpack or spread, among those of
        the request's preferred workers where it fits now (the same stages as every GPU),
        or None for placement to go on as if it preferred nothing. A rank, never a filter:
        it changes where a request is placed, never whether (nor its reasons, victims or
        nomination)."""
        state, holds = self.state, self.holds.by_gpu
        fitting = [
            gpu_id
            for name in request.constraints.prefer_workers
            for gpu_id in state.gpu_ids(name)
            if fits(state, request, gpu_id, holds)
        ]
        return self.best(request, fitting, spread=spread) if fitting else None

    def room(self, gpu_id: GpuId) -> int:
        return self.ledger.free_mb(gpu_id) - self.holds.by_gpu.get(gpu_id, 0)

    def pick_one(
        self, request: Request, *, need: int | None, spread: bool, gate: bool
    ) -> GpuId | None:
        """The best single GPU by bisection of the ledger's free-memory index: the stages'
        rules (a matching, usable GPU with room >= ``need``, any room if None, and with
        ``gate`` a free load slot), ranked by least room (binpack) or most (spread), then
        GPU id. GPUs holding nominations this cycle are checked one by one (they are few)."""
        matching = self.state.matching(request)
        state, ledger = self.state, self.ledger
        limit = self.policy.max_concurrent_loads
        floor = -(1 << 62) if need is None else need
        sign = -1 if spread else 1
        best: tuple[int, GpuId] | None = None

        def consider(room: int, gpu_id: GpuId) -> None:
            nonlocal best
            if room < floor or gpu_id not in matching or not usable(state, gpu_id):
                return
            if gate and ledger.loading(gpu_id) >= limit:
                return
            if best is None or (sign * room, gpu_id) < (sign * best[0], best[1]):
                best = (room, gpu_id)

        holds = self.holds.by_gpu
        for gpu_id, hold in holds.items():
            consider(ledger.free_mb(gpu_id) - hold, gpu_id)
        index = ledger.by_free
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
            if gpu_id not in holds:
                consider(free, gpu_id)
        return None if best is None else best[1]

    def best(
        self, request: Request, gpu_ids: Iterable[GpuId], *, spread: bool
    ) -> tuple[GpuId, ...] | None:
        """Ranks workers' best ``gpus`` GPUs: binpack (least room left) or spread (most)."""
        best: tuple[tuple[int, str], tuple[GpuId, ...]] | None = None
        sign = -1 if spread else 1
        for worker, ids in _by_worker(gpu_ids).items():
            if len(ids) < request.gpus:
                continue
            ranked = sorted(ids, key=lambda g: (sign * self.room(g), g))[: request.gpus]
            score = (sign * sum(self.room(g) for g in ranked), worker)
            if best is None or score < best[0]:
                best = (score, tuple(sorted(ranked)))
        return None if best is None else best[1]

    def grant(self, request: Request, gpus: tuple[GpuId, ...]) -> None:
        now = self.now
        lease = Lease(
            request=request,
            gpus=gpus,
            token=self.state.next_token + len(self.grants),
            state=LeaseState.LOADING,
            granted_at=now,
            expires_at=math.inf if request.ttl_s is None else now + request.ttl_s,
            load_deadline=now + request.load_timeout_s,
            last_used_at=now,
            claimed=self.state.presence.claimed_at_grant(request.id),
        )
        self.grants.append(lease)
        if self.walking:  # for the rest of the walk; undone when it ends
            self.granted.add(request.id)
            self.ledger.commit(lease)
            self._count(lease, 1)

    # ------------------------------------------------------------------ post-filter

    def preempt_or_nominate(self, request: Request) -> bool:
        """Holds memory for a request that does not fit (a nomination, I6). True when memory is
        on its way back for it (its victims, or leases already being revoked)."""
        nomination = self.nomination(request.id)
        if nomination is not None and nomination.preempting(self.ledger):
            self.holds.hold(request, nomination.gpus, own=True)
            return True
        if nomination is not None:
            del self._nominations()[request.id]
        found = self.plan_victims(request) if self.could_preempt(request.priority) else None
        if found is not None and not found[1]:  # memory already on its way back: wait for it
            self.holds.hold(request, found[0])
            return True
        if found is not None:
            gpus, victims = found
            for victim in victims:
                self.revoke(victim, request)
            self._nominations()[request.id] = Nomination(gpus, {v.id for v in victims})
            self.holds.hold(request, gpus, own=True)
            return True
        self.holds.hold(request, self.nominate(request))
        return False

    def revoke(self, victim: Lease, preemptor: Request) -> None:
        self._count(victim, -1)
        self.revoked[victim.id] = self.state.revoked(victim, "preempted", self.now, preemptor.id)

    def nominate(self, request: Request) -> tuple[GpuId, ...]:
        """The GPUs where the request is closest to fitting (most room); () if none usable."""
        if request.gpus == 1:
            one = self.pick_one(request, need=None, spread=True, gate=False)
            return () if one is None else (one,)
        usable_ids = [g for g in self.state.matching(request) if usable(self.state, g)]
        return self.best(request, usable_ids, spread=True) or ()

    def plan_victims(self, request: Request) -> tuple[tuple[GpuId, ...], tuple[Lease, ...]] | None:
        """The cheapest victims on one worker that make room for the request (I5); no victims
        when memory already being revoked will make room."""
        best: tuple[tuple[object, ...], tuple[GpuId, ...], tuple[Lease, ...]] | None = None
        candidates = [g for g in self.state.matching(request) if usable(self.state, g)]
        for worker, ids in _by_worker(candidates).items():
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
        granted, revoked, leases = self.granted, self.revoked, self.state.leases
        revoking: set[str] = set()
        candidates = []
        for lid in self.ledger.lease_ids(gpu_id):
            if lid in granted:
                continue  # never take back in the cycle that granted it
            lease = revoked.get(lid) or leases[lid]
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


_NO_HOLDS = Holds()


def _by_worker(gpu_ids: Iterable[GpuId]) -> dict[str, list[GpuId]]:
    grouped: dict[str, list[GpuId]] = {}
    for gpu_id in gpu_ids:
        grouped.setdefault(gpu_id.worker, []).append(gpu_id)
    return grouped
