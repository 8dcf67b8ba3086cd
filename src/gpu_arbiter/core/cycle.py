"""The placement walk: one cycle's plan, made against a read-only view of the state.

:func:`plan` first reads what the timers due end (:mod:`.endings`: expiries, load
time-outs, drain deadlines, absent askers, unclaimed grants, waits over, and after the
cluster shrank the requests no GPU could ever take), then walks the pending requests in
queue order (effective priority desc, seq asc) and, for each, asks the stages
(:mod:`.stages`) where it fits, ranks those GPUs, and when none fits plans preemption or
holds a nomination (:mod:`.nominations`). Everything it decides goes into a
:class:`~.plan.Plan`; the state is only read (:class:`~.view.View`).

The walk sees its own decisions as it goes, as the next request must: what the plan has
ended and granted so far is kept in its :class:`~.overlay.Overlay` (the ledger's exact
accounting, I2, decides what is left), its revocations, nominations and victim counts
in the walk. For each request it examines and does not place, the walk writes down where
it stood (:class:`~.diagnosis.Turn`: the holds ahead of it, the grants before it); the plan
carries that, and every "why" is worked out from it (:mod:`.diagnosis`).

The walk goes class by class (base priority, shape): a class whose head can neither be
placed nor preempt is dropped for the cycle. It stops once no GPU has room for the
smallest pending request and no pending request could preempt anything. Afterwards no
pending request that the pause, a load gate, a hold ahead of it or its constraints do
not hold back could be granted (I10).
"""

from __future__ import annotations

import math
from dataclasses import replace

from .diagnosis import Turn
from .endings import Endings, endings
from .model import GpuId, Lease, LeaseState, Request, WorkerStatus
from .nominations import Holds, Nomination
from .plan import Plan
from .postfilter import PostFiltered
from .stages import usable
from .view import View

__all__ = ["plan"]


def plan(view: View, now: float) -> Plan:
    """What one cycle at ``now`` ends, grants, revokes and holds (see the module)."""
    queue = view.queue
    due = view.due(now)
    ended = _NOTHING_ENDS
    if due or view.reshaped:
        ended = endings(
            due,
            now,
            leases=view.leases,
            queue=queue,
            worker_leases=view.worker_lease_ids,
            revoked=view.revoked,
            reject=view.rejection_for if view.reshaped else None,
            ordered=lambda: list(queue.ordered(view.policy, now)),
        )
    walk = _Walk(view, now, ended)
    if not view.paused and not walk.place_alone():
        walk.place()
    granted = {lease.id for lease in walk.grants}
    timed_out = tuple(
        r for r in ended.waits if r in queue and r not in granted and r not in ended.requests
    )
    return Plan(
        now=now,
        first_token=view.next_token,
        expired=tuple(ended.expired),
        unclaimed=tuple(ended.unclaimed),
        loaded=tuple(ended.loaded),
        abandoned=tuple(ended.abandoned),
        rejected=tuple(ended.rejected),
        deadlines=tuple(ended.deadlines),
        grants=tuple(walk.grants),
        revocations=tuple(ended.revocations) + tuple(walk.preempted.values()),
        nominations=walk.nominations,
        timed_out=timed_out,
        drained=_drained(view, ended),
        retries=tuple(sorted(walk.retries)) if walk.retries else (),
        turns=walk.turns,
        holds=walk.final_holds(),
        preholds=walk.holds.preholds,
        examined=walk.examined,
    )


_NOTHING_ENDS = Endings()  # nothing due: read only, never changed


def _drained(view: View, ended: Endings) -> tuple[tuple[str, WorkerStatus, WorkerStatus], ...]:
    """Draining workers the plan leaves empty: (name, from, to)."""
    if not view.drain_check and not ended.leases:
        return ()
    gone = {lid for lid, lease in ended.leases.items() if lease is None}
    names = set(view.drain_check)
    names.update(view.leases[lid].worker for lid in gone)
    changes = []
    for name in sorted(names):
        worker = view.workers.get(name)
        if worker is None or worker.status is not WorkerStatus.DRAINING:
            continue
        if view.worker_lease_ids(name) <= gone:
            changes.append((name, WorkerStatus.DRAINING, WorkerStatus.DRAINED))
    return tuple(changes)


class _Walk(PostFiltered):
    """The walk: the queue in order, each request placed, or held for (see the module)."""

    # ------------------------------------------------------------------ placement

    def place_alone(self) -> bool:
        """Grants a lone pending request where it fits now, when no memory is held for a
        preemptor; False (nothing done) otherwise, for :meth:`place` to walk the queue.

        The uncontended arbiter's case (an in-process ``acquire``): the walk would examine
        this one request and grant it on exactly these GPUs, without its machinery."""
        request = self.view.queue.only()
        if request is None or self.view.nominations or request.id in self.ended:
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
        queue = self.view.queue
        smallest = queue.smallest_vram_mb()
        if smallest is None:
            return
        highest = max(queue.priorities())
        self.walking = True
        self.holds = Holds()
        self.prehold()
        walk = queue.walk(self.policy, self.now, alone=list(self.holds.preheld))
        for request in walk:
            if request.id in self.ended:
                continue
            preheld, lifted = self.holds.turn(request)
            room_left = self.max_room() >= smallest
            if (
                not room_left
                and not preheld  # its own memory: it keeps it, and its turn is diagnosed
                and not self.holds.preheld
                and not self.could_preempt(highest)
            ):
                break
            outcome = self.turn(request, room_left=room_left, preheld=preheld)
            self.holds.end_turn(lifted)
            if outcome is False:
                walk.drop()
        self.examined += walk.examined
        if self.grants and self.view.nominations:
            noms = self._nominations()
            for lease in self.grants:
                noms.pop(lease.id, None)

    def turn(self, request: Request, *, room_left: bool, preheld: bool) -> bool | None:
        """One request's turn: True when granted, None when memory is on its way back for it,
        False when neither it nor the rest of its class (younger, no more rights, less room)
        can be placed in this cycle."""
        shape = request.shape
        if not preheld and self.failed_at.get(shape, -1) >= request.priority:
            if room_left:  # it cannot fit either, but it still holds its best GPU (I6)
                self.diagnose(request)
                self.holds.hold(request, self.nominate(request))
            return False
        if not room_left and not preheld and not self.could_preempt(request.priority):
            self.diagnose(request)
            return False  # can neither fit nor preempt, and nobody behind can fit: no hold needed
        gpus = self.fit(request)
        if gpus is not None:
            self.grant(request, gpus)
            return True
        turn = self.diagnose(request)
        waits = self.post_filter(request)
        if self.waits_on:  # the post-filter's answer: memory already being revoked
            self.turns[request.id] = replace(turn, waits_on=self.waits_on)
            self.waits_on = ()
        if waits:
            return None
        self.failed_at[shape] = max(self.failed_at.get(shape, -1), request.priority)
        return False

    def diagnose(self, request: Request) -> Turn:
        """Writes down where the walk stands as ``request`` is not placed: the holds ahead
        of it and the grants before it (:class:`~.diagnosis.Turn`; its diagnosis is worked
        out from that when a "why" first asks)."""
        turn = self.turns[request.id] = Turn(
            dict(self.holds.by_gpu), len(self.holds.journal), len(self.grants)
        )
        return turn

    def prehold(self) -> None:
        """Pre-holds the memory preemption frees for its preemptors (see
        :mod:`.nominations`). A nomination whose victims are gone and where its preemptor
        no longer fits at all (memory taken by strangers meanwhile) is dropped first: it
        would hold memory for nobody."""
        queue = self.view.queue
        for request_id, nomination in list(self.view.nominations.items()):
            if not all(g in self.ledger for g in nomination.gpus):  # its worker was removed
                del self._nominations()[request_id]
            elif request_id in queue and request_id not in self.ended:
                request = queue.get(request_id)
                if not self.holds_memory(request, nomination):
                    del self._nominations()[request_id]
                    continue
                self.holds.prehold(request, nomination.gpus)

    def holds_memory(self, request: Request, nomination: Nomination) -> bool:
        """Whether a preemptor's nomination still holds its memory: its victims have not all
        stopped (or the probe has not shown it yet), or the preemptor fits there now."""
        return nomination.preempting(self.view.ledger) or all(
            usable(self, g) and self.ledger.free_mb(g) >= request.vram_mb for g in nomination.gpus
        )

    def max_room(self) -> int:
        """The most memory any usable GPU has beyond the holds of this cycle."""
        best = -(1 << 62)
        idle = self.unusable()
        for gpu_id, free, hold in self.special():
            if free - hold > best and not (idle and gpu_id in idle):
                best = free - hold
        index = self.index
        for i in range(len(index) - 1, -1, -1):
            free, gpu_id = index[i]
            if free <= best:
                break
            if self.indexed(gpu_id) and not (idle and gpu_id in idle):
                return free
        return best

    def grant(self, request: Request, gpus: tuple[GpuId, ...]) -> None:
        now = self.now
        lease = Lease(
            request=request,
            gpus=gpus,
            token=self.view.next_token + len(self.grants),
            state=LeaseState.LOADING,
            granted_at=now,
            expires_at=math.inf if request.ttl_s is None else now + request.ttl_s,
            load_deadline=now + request.load_timeout_s,
            last_used_at=now,
            claimed=self.view.claimed_at_grant(request.id),
        )
        self.grants.append(lease)
        if self.walking:  # for the rest of the walk
            self.granted.add(request.id)
            self.ledger.commit(lease)
            self._count(lease, 1)
