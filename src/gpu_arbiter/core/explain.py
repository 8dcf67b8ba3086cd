"""Why a request waits, or why it is refused: a :class:`~.reasons.PendingReason` built
from the walk's :class:`~.diagnosis.Diagnosis`, never by asking the stages again.

A reason's code is the most useful thing to say, in the order an operator asks: paused?
any worker? being preempted for? a GPU fits (the next cycle grants it)? memory held for a
request ahead? a load gate? too full (naming the leases in the way on the GPU nearest to
taking it, :func:`~.reasons.lease_blockers`)? only GPUs that may take no new work? And a
request is refused (:func:`rejection`) when every GPU's outcome is one nothing will help
(:attr:`~.outcomes.Outcome.helped_by`): it matches no GPU at all.

A preemptor waits for its victims to stop (``preempting``) only while their memory will
make room for it: a request of higher base priority may take memory a preemption frees
(I6), and then the preemptor's reason names what stands in its way on that GPU, the
request ahead that holds it (``nominated_for``) or the lease granted there meanwhile
(``insufficient_vram``). Every figure is read against the holds ahead of the request at
its turn (the diagnosis' ``held``), never against its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

from .diagnosis import Diagnosis
from .model import GpuId, LeaseState, Request
from .nominations import Nomination
from .outcomes import Outcome, Why
from .plan import Plan
from .reasons import (
    Blocker,
    GpuVerdict,
    PendingReason,
    holding_sentence,
    lease_blockers,
    leases_in_the_way,
    loading_sentence,
    moment,
    offered_mb,
    revoking_sentence,
    summarize,
    waiting_sentence,
)
from .stages import outcome
from .units import format_mb
from .view import View

__all__ = ["explain", "rejection"]


class Explained(View, Protocol):
    """What a reason reads: the state, the last plan's diagnoses and holds."""

    def diagnosis(self, request: Request) -> Diagnosis: ...
    def held_by(self, request_id: str) -> tuple[GpuId, ...]: ...
    def waits_on(self, request_id: str) -> tuple[GpuId, ...]: ...
    @property
    def last_plan(self) -> Plan | None: ...
    def mismatches(self, request: Request) -> Mapping[Outcome, tuple[int, GpuId]]: ...
    def overdue_revocations(
        self, now: float, among: set[str] | None = None
    ) -> list[tuple[str, float]]: ...


def rejection(state: Explained, request: Request) -> PendingReason | None:
    """Why no registered GPU could ever take ``request``; None if one could (or no worker
    is registered yet: the request waits for one)."""
    if not state.workers or state.matching(request):
        return None
    unknown = [str(g) for g in request.constraints.gpu_ids if g not in state.ledger]
    if unknown:
        return PendingReason(
            Why.NO_MATCHING_GPU,
            f"constraints.gpu_ids: no GPU {', '.join(unknown)} is registered",
        )
    found = state.mismatches(request)  # every GPU: nothing will help any of them
    few = found.get(Outcome.TOO_FEW_GPUS_ON_WORKER)
    small = found.get(Outcome.TOO_SMALL)
    if few is not None:
        code, message = Why.TOO_FEW_GPUS, f"no worker has {request.gpus} matching GPUs"
    elif small is not None:
        largest = state.ledger.gpu(small[1]).capacity_mb
        code = Why.TOO_LARGE
        message = (
            f"{format_mb(request.vram_mb)} per GPU is more than any matching GPU "
            f"holds (largest capacity {format_mb(largest)})"
        )
    else:
        code, message = Why.NO_MATCHING_GPU, f"no GPU matches {request.constraints.describe()}"
    detail = ", ".join(
        f"{n} {c}" for c, (n, _) in sorted(found.items()) if c is not Outcome.TOO_FEW_GPUS_ON_WORKER
    )
    return PendingReason(code, f"{message} ({detail})" if detail else message)


def explain(state: Explained, request_id: str, now: float) -> PendingReason:
    """Why a pending request is still pending (see the module)."""
    request = state.queue.get(request_id)
    if state.paused:
        return PendingReason(Why.PAUSED, "the arbiter is paused; nothing is granted until resume")
    if not state.workers:
        return PendingReason(Why.NO_WORKERS, "no worker is registered yet; waiting for one")
    nomination = state.nominations.get(request_id)
    if nomination is not None and nomination.preempting(state.ledger):
        diagnosis = state.diagnosis(request)
        in_the_way = _in_the_way(state, request, diagnosis, nomination, now)
        return in_the_way or _preempting(state, nomination, now)
    return _reason(state, request, state.diagnosis(request), state.held_by(request_id), now)


def _reason(
    state: Explained, request: Request, diagnosis: Diagnosis, own: tuple[GpuId, ...], now: float
) -> PendingReason:
    verdicts = diagnosis.verdicts
    codes = diagnosis.codes
    if Outcome.FITS in codes:
        return PendingReason(
            Why.QUEUED, "a GPU fits; waiting for the next scheduling cycle", verdicts, own
        )
    summary = summarize(verdicts, request.vram_mb)
    if Outcome.NOMINATED_FOR in codes:
        held = next(v for v in verdicts if v.code == Outcome.NOMINATED_FOR)
        rid = _holder(state, request, diagnosis, held.gpu)
        if rid is None:
            return PendingReason(Why.NOMINATED_FOR, summary, verdicts, own)
        blocker = _holding_blocker(state, rid, held.gpu)
        message = f"{summary}; {holding_sentence(blocker, held.held_mb)}"
        return PendingReason(Why.NOMINATED_FOR, message, verdicts, own, rid, blocker)
    if Outcome.LOAD_IN_PROGRESS in codes:
        loading = _loading_blocker(state, diagnosis.loading)
        if loading is None:
            return PendingReason(Why.LOAD_IN_PROGRESS, summary, verdicts, own)
        message = f"{summary}; {loading_sentence(loading, now)}"
        return PendingReason(Why.LOAD_IN_PROGRESS, message, verdicts, own, loading.id, loading)
    if Outcome.INSUFFICIENT_VRAM in codes:
        return _insufficient(state, request, diagnosis, own, summary, now)
    if any(code.helped_by == "an event" for code in codes):
        return PendingReason(Why.WORKERS_DRAINING, summary, verdicts, own)
    return PendingReason(Why.NO_MATCHING_GPU, summary, verdicts, own)


def _insufficient(
    state: Explained,
    request: Request,
    diagnosis: Diagnosis,
    own: tuple[GpuId, ...],
    summary: str,
    now: float,
) -> PendingReason:
    """Too full: the leases in the way by name, when nothing else is (see :mod:`.reasons`):
    on the GPUs where the walk had it wait for memory already being revoked, else on the
    GPU nearest to taking it (for several GPUs, on its worker)."""
    verdicts = candidates = diagnosis.verdicts
    waits_on = state.waits_on(request.id)  # memory being revoked there will make room
    if waits_on:
        on = set(waits_on)
        found = _on_worker(state, request, diagnosis, waits_on[0].worker)
        candidates = tuple(v for v in found if v.gpu in on)
    elif request.gpus > 1:
        nearest = next(v for v in verdicts if v.code == Outcome.INSUFFICIENT_VRAM)
        candidates = _on_worker(state, request, diagnosis, nearest.gpu.worker)
    blockers = lease_blockers(request, candidates, state.leases, state.ledger, state.policy)
    if not blockers:
        return PendingReason(Why.INSUFFICIENT_VRAM, summary, verdicts, own)
    message = f"{summary}; {waiting_sentence(blockers, request.priority, now)}"
    last = blockers[0]
    return PendingReason(
        Why.INSUFFICIENT_VRAM, message, verdicts, own, last.id, last, blockers=blockers
    )


def _on_worker(
    state: Explained, request: Request, diagnosis: Diagnosis, worker: str
) -> tuple[GpuVerdict, ...]:
    """What the stages say of each matching GPU of ``worker`` now, against the memory held
    against the request at its turn (its own hold is not in its way); GPUs that fit say
    ``too_few_gpus_on_worker`` (for a request not placed)."""
    held, ledger, matching = _held(state, request, diagnosis), state.ledger, state.matching(request)
    found = []
    for gpu_id in state.gpu_ids(worker):
        if gpu_id not in matching:
            continue
        code = outcome(state, request, gpu_id, held) or Outcome.TOO_FEW_GPUS_ON_WORKER
        found.append(
            GpuVerdict(
                gpu_id,
                code,
                need_mb=request.vram_mb,
                free_mb=offered_mb(code, ledger.free_mb(gpu_id)),
                committed_mb=ledger.committed_mb(gpu_id),
                observed_mb=ledger.observed_mb(gpu_id),
                held_mb=held.get(gpu_id, 0),
            )
        )
    return tuple(found)


def _held(state: Explained, request: Request, diagnosis: Diagnosis) -> Mapping[GpuId, int]:
    """The memory held against ``request`` per GPU: the holds ahead of it at its turn, or,
    for a request the walk did not reach (no turn), every hold of the plan but its own."""
    plan = state.last_plan
    if plan is None or request.id in plan.turns:
        return diagnosis.held
    held = dict(diagnosis.held)
    for rid, gpus, mb in plan.holds:
        if rid == request.id:
            for gpu_id in gpus:
                held[gpu_id] = held.get(gpu_id, 0) - mb
    return held


def _in_the_way(
    state: Explained, request: Request, diagnosis: Diagnosis, nomination: Nomination, now: float
) -> PendingReason | None:
    """What stands in a preemptor's way by name once the memory being revoked on its GPUs
    is back, if anything (None: only its victims and the probe's next reading,
    :func:`_preempting`): on the first GPU of its nomination where the leases not being
    revoked leave too little room for it, those leases (one granted meanwhile to a request
    of higher base priority, I6); where they leave room but not beyond the holds ahead of
    it, the request ahead that holds the memory."""
    ledger, need, against = state.ledger, request.vram_mb, _held(state, request, diagnosis)
    for gpu_id in nomination.gpus:
        if gpu_id not in ledger:
            continue
        revoking = [
            lid
            for lid in ledger.lease_ids(gpu_id)
            if state.leases[lid].state is LeaseState.REVOKING
        ]
        staying = ledger.committed_mb(gpu_id) - sum(
            ledger.reserved_mb(gpu_id, lid) for lid in revoking
        )
        room = ledger.gpu(gpu_id).capacity_mb - staying  # the probe's figures left to it
        held = against.get(gpu_id, 0)
        if room - held >= need:
            continue
        lead = summarize(diagnosis.verdicts, need) + (
            f"; its preemption on {', '.join(map(str, nomination.gpus))} will not make room "
            f"enough on {gpu_id}"
        )
        if room < need:
            blockers = leases_in_the_way(request, gpu_id, state.leases, ledger, state.policy)
            if not blockers:
                continue
            message = f"{lead}: {waiting_sentence(blockers, request.priority, now)}"
            last = blockers[0]
            return PendingReason(
                Why.INSUFFICIENT_VRAM,
                message,
                diagnosis.verdicts,
                nomination.gpus,
                last.id,
                last,
                blockers=blockers,
            )
        rid = _holder(state, request, diagnosis, gpu_id)
        if rid is not None:
            blocker = _holding_blocker(state, rid, gpu_id)
            message = f"{lead}: {holding_sentence(blocker, held)}"
            return PendingReason(
                Why.NOMINATED_FOR, message, diagnosis.verdicts, nomination.gpus, rid, blocker
            )
    return None


def _preempting(state: Explained, nomination: Nomination, now: float) -> PendingReason:
    """Waiting for victims to stop: the one that bounds the wait, by name (a victim past
    its grace first), or for the probe to show their memory free."""
    where = ", ".join(map(str, nomination.gpus))
    victims = [state.leases[v] for v in sorted(nomination.victims) if v in state.leases]
    if not victims:
        message = (
            f"the preempted leases on {where} have stopped; waiting for the GPU's next "
            "probe reading to show their memory free"
        )
        return PendingReason(Why.PREEMPTING, message, nominated=nomination.gpus)
    stuck = state.overdue_revocations(now, among=nomination.victims)
    grace_s = state.policy.grace_s
    victim = (
        state.leases[stuck[0][0]]
        if stuck
        else max(victims, key=lambda v: (v.revoked_at or now, v.id))
    )
    blocker = Blocker(
        "revoking",
        victim.id,
        victim.request.holder,
        victim.gpus,
        since=victim.revoked_at if victim.revoked_at is not None else now,
        until=moment(victim.grace_ends_at(grace_s)),
        expires_at=moment(victim.expires_at),
    )
    message = (
        f"waiting for {len(victims)} preempted lease(s) on {where} to stop and the memory "
        f"to show free: {revoking_sentence(blocker, now, grace_s)}"
    )
    return PendingReason(
        Why.PREEMPTING,
        message,
        nominated=nomination.gpus,
        blocked_by=victim.id if stuck else None,
        blocker=blocker,
    )


def _loading_blocker(state: Explained, gpus: tuple[GpuId, ...]) -> Blocker | None:
    """The loading lease whose gate opens first among the GPUs held only by their gate."""
    found: list[Blocker] = []
    for gpu_id in gpus:
        if gpu_id not in state.ledger:
            continue
        for lease_id in sorted(state.ledger.lease_ids(gpu_id)):
            lease = state.leases[lease_id]
            if lease.loading:  # revoking while loading holds the gate too
                found.append(
                    Blocker(
                        "loading",
                        lease.id,
                        lease.request.holder,
                        lease.gpus,
                        since=lease.granted_at,
                        until=moment(lease.load_deadline),
                        expires_at=moment(lease.expires_at),
                    )
                )
    return min(
        found, key=lambda b: (min(_or_never(b.until), _or_never(b.expires_at)), b.id), default=None
    )


def _or_never(at: float | None) -> float:
    return math.inf if at is None else at


def _holder(state: Explained, request: Request, diagnosis: Diagnosis, gpu_id: GpuId) -> str | None:
    """The request ahead whose hold stands against ``request`` on ``gpu_id`` at its turn,
    the first in walk order (:mod:`.nominations`): never itself; a prehold only while it
    stands, that of a preemptor of equal or higher base priority whose turn comes after
    (one of lower base priority is lifted for the turn; one whose turn came is named by
    what it held then)."""
    plan = state.last_plan
    if plan is None:
        return None
    policy = state.policy

    def place(r: Request) -> tuple[int, int]:  # in the plan's walk
        return (-policy.effective_priority(r, plan.now), r.seq)

    for i, rid in diagnosis.holds_on(gpu_id):
        if rid == request.id:
            continue
        if i < plan.preholds:
            preemptor = state.queue.get(rid) if rid in state.queue else None
            if (
                preemptor is None
                or preemptor.priority < request.priority
                or place(preemptor) < place(request)
            ):
                continue
        return rid
    return None


def _holding_blocker(state: Explained, request_id: str, gpu_id: GpuId) -> Blocker:
    """The request ahead whose nomination holds memory of ``gpu_id``."""
    ahead = state.queue.get(request_id) if request_id in state.queue else None
    return Blocker(
        "request",
        request_id,
        None if ahead is None else ahead.holder,
        (gpu_id,),
        since=0.0 if ahead is None else ahead.submitted_at,
    )
