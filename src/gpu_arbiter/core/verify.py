"""Plan verification: a plan checked against the state it was made from.

What :func:`check_plan` recomputes, independently of the walk that made the plan:

- every grant is of a pending request, once, with the next fencing tokens in order;
  on ``gpus`` matching GPUs of one worker that is online, with a fresh probe (I7, I2);
  nothing is granted while paused;
- memory (I1, I2) and the load gate (I3), grant after grant, through a copy of the
  ledger: each grant fits what the ones before it left;
- every revocation is of a held lease not already being revoked nor granted in this
  plan, for a pending request that may take it (I5), and a preemptor's victims, with
  what is already being revoked, free enough on each GPU it is nominated to;
- what time ends is due: a lease expires or is given back unclaimed only past its TTL
  or claim bound and is then not granted or revoked again in the plan; a load counts as
  done only past its load timeout; a request abandoned or rejected is pending and not
  granted;
- a request timed out has waited its ``max_wait_s`` and is not granted; a worker marked
  drained was draining and holds no lease the plan does not end;
- order (:func:`check_order`, I6 and I10) against the holds the plan's walk made (its
  own record, :meth:`~.plan.Plan.held`, never a "why"): each grant fits beyond the holds
  ahead of it at its turn, and no request left pending fitted there at its turn.

It returns the problems found (empty: the plan is sound). Tests run it on every plan,
and the simulator runs :func:`check_order` on every step.
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict

from .model import GpuId, Lease, LeaseState, Request, WorkerStatus, evolve
from .nominations import Hold
from .overlay import Overlay
from .plan import Plan
from .preemption import eligible
from .stages import usable
from .view import View

__all__ = ["check_order", "check_plan"]


def check_plan(state: View, plan: Plan) -> list[str]:
    """The ways ``plan`` breaks an invariant against ``state``, the state it was made from."""
    return (
        _tokens(state, plan)
        + [p for lease in plan.grants for p in _grant(state, lease)]
        + _memory(state, plan)
        + _revocations(state, plan)
        + _endings(state, plan)
        + _timed(state, plan)
        + check_order(state, plan)
    )


def check_order(state: View, plan: Plan) -> list[str]:
    """I6 and I10 for ``plan``, made against ``state``, from the holds its walk made.

    The walk goes in queue order (effective priority desc, seq asc). At a request's turn
    the memory held against it on a GPU is (:mod:`.nominations`):

    - every hold made at the turn of a request ahead of it, and
    - every prehold of a preemptor whose turn has not come (behind it), unless that
      preemptor's base priority is lower than its own (lifted for its turn);
      its own prehold never.

    Each grant fits (I1, I2) beyond what is held against it at its turn, through the
    ledger as the plan's endings and the grants ahead of it leave it (I6). Unless the
    plan is paused, a request left pending (ended by no timer first) fitted on no
    worker's GPUs at its turn (I10: its constraints, I7 and the probe's freshness,
    memory beyond the holds, the load gate). Exact, with no allowance: a
    breach of either is a problem.

    Memory is read through an :class:`~.overlay.Overlay` of the state's ledger (the
    ledger's exact accounting, without a copy: cheap enough for every simulated step);
    :func:`_memory` checks the same grants through a copy of the ledger itself."""
    return _Order(state, plan).problems()


class _Order:
    """:func:`check_order`'s walk: the queue in order, the holds the plan made as it goes."""

    def __init__(self, state: View, plan: Plan) -> None:
        self.state, self.plan = state, plan
        self.overlay = _ended(state, plan)
        self.limit = state.policy.max_concurrent_loads
        self.preheld: dict[GpuId, list[tuple[tuple[int, int], int, int]]] = defaultdict(list)
        self.made: dict[str, list[Hold]] = defaultdict(list)
        for hold in plan.held():
            if hold.preheld:
                request = state.queue.get(hold.request_id)
                key = _key(state, request, plan.now)
                for gpu_id in hold.gpus:
                    self.preheld[gpu_id].append((key, request.priority, hold.vram_mb))
            else:
                self.made[hold.request_id].append(hold)
        self.running: dict[GpuId, int] = defaultdict(int)  # held at the turns so far

    def problems(self) -> list[str]:
        state, plan = self.state, self.plan
        granted = {lease.id: lease for lease in plan.grants}
        gone = {r.id for r in plan.abandoned} | {r.id for r, _ in plan.rejected}
        problems: list[str] = []
        for request in state.queue.ordered(state.policy, plan.now):
            if request.id in gone:
                continue
            key = _key(state, request, plan.now)
            lease = granted.get(request.id)
            if lease is not None:
                problems += self.granted(lease, key)
            elif not state.paused:
                problems += self.left(request, key)
            for hold in self.made.get(request.id, ()):
                for gpu_id in hold.gpus:
                    self.running[gpu_id] += hold.vram_mb
        return problems

    def against(self, request: Request, key: tuple[int, int], gpu_id: GpuId) -> int:
        """Memory held against ``request`` on ``gpu_id`` at its turn (see check_order)."""
        held = self.running.get(gpu_id, 0)
        for other, priority, mb in self.preheld.get(gpu_id, ()):
            if other > key and priority >= request.priority:
                held += mb
        return held

    def granted(self, lease: Lease, key: tuple[int, int]) -> list[str]:
        """I6 for a grant, which then counts for the turns after it (I3: :func:`_memory`)."""
        problems = []
        overlay = self.overlay
        for gpu_id in lease.gpus:
            if gpu_id not in overlay:
                continue  # reported by _grant
            room = overlay.free_mb(gpu_id) - self.against(lease.request, key, gpu_id)
            if room < lease.vram_mb:
                problems.append(
                    f"I6: {lease.id} took {lease.vram_mb} MiB of {gpu_id} with {room} MiB "
                    "there beyond the holds ahead of it"
                )
        overlay.commit(lease)
        return problems

    def left(self, request: Request, key: tuple[int, int]) -> list[str]:
        """I10 for a request left pending: it fitted on no worker at its turn."""
        overlay, state = self.overlay, self.state
        fits = [
            g
            for g in state.matching(request)
            if usable(state, g)
            and overlay.loading(g) < self.limit
            and overlay.free_mb(g) - self.against(request, key, g) >= request.vram_mb
        ]
        if any(n >= request.gpus for n in Counter(g.worker for g in fits).values()):
            return [f"I10: {request.id} fitted on {sorted(fits)} at its turn but was left pending"]
        return []


def _key(state: View, request: Request, now: float) -> tuple[int, int]:
    """A request's place in the walk."""
    return (-state.policy.effective_priority(request, now), request.seq)


def _ended(state: View, plan: Plan) -> Overlay:
    """The ledger as what time ends in the plan leaves it (memory back, loads done)."""
    overlay = Overlay(state.ledger)
    loaded = set()
    for lease in plan.loaded:
        held = state.leases.get(lease.id)
        if held is not None and held.loading:
            overlay.finish_loading(held)
            loaded.add(held.id)
    for lease in plan.expired + plan.unclaimed:
        held = state.leases.get(lease.id)
        if held is not None:
            overlay.end(held, loading=held.loading and held.id not in loaded)
    return overlay


def _timed(state: View, plan: Plan) -> list[str]:
    """What time ends: each ending due, and nothing ended twice or also granted."""
    problems = []
    ended = [lease.id for lease in plan.expired + plan.unclaimed]
    if len(set(ended)) != len(ended):
        problems.append(f"a lease is ended twice: {ended}")
    for lease in plan.expired:
        held = state.leases.get(lease.id)
        if held is None or held.supervised or lease.ended_at is None:
            problems.append(f"{lease.id} expires but is not a held, unsupervised lease")
        elif held.expires_at > plan.now:
            problems.append(f"{lease.id} expires before its TTL lapsed")
    for lease in plan.unclaimed:
        held = state.leases.get(lease.id)
        if held is None or held.claimed:
            problems.append(f"{lease.id} is given back unclaimed but was taken up")
    for lease in plan.loaded:
        held = state.leases.get(lease.id)
        if held is None or not held.loading or held.load_deadline > plan.now:
            problems.append(f"{lease.id} counts as loaded before its load timeout")
    granted = {lease.id for lease in plan.grants}
    revoked = {lease.id for lease in plan.revocations}
    gone = {r.id for r in plan.abandoned} | {r.id for r, _ in plan.rejected}
    for request_id in sorted(gone):
        if request_id not in state.queue or request_id in granted:
            problems.append(f"{request_id} ends ungranted but is not a pending request")
    for lease_id in sorted(set(ended) & revoked):
        problems.append(f"{lease_id} is ended and revoked in one plan")
    return problems


def _tokens(state: View, plan: Plan) -> list[str]:
    problems = []
    if plan.first_token != state.next_token:
        problems.append(f"first token {plan.first_token}, the state's next is {state.next_token}")
    tokens = [lease.token for lease in plan.grants]
    if tokens != list(range(plan.first_token, plan.first_token + len(tokens))):
        problems.append(f"tokens {tokens} are not consecutive from {plan.first_token}")
    ids = [lease.id for lease in plan.grants]
    if len(set(ids)) != len(ids):
        problems.append(f"a request is granted twice: {ids}")
    if state.paused and plan.grants:
        problems.append("grants while paused")
    return problems


def _grant(state: View, lease: Lease) -> list[str]:
    request = lease.request
    if request.id not in state.queue or state.queue.get(request.id) != request:
        return [f"{request.id} is granted but is not that pending request"]
    problems = []
    if len(set(lease.gpus)) != request.gpus or len({g.worker for g in lease.gpus}) != 1:
        problems.append(f"{request.id}: {lease.gpus} are not {request.gpus} GPUs of one worker")
    matching = state.matching(request)
    for gpu_id in lease.gpus:
        if gpu_id not in matching:
            problems.append(f"{request.id}: {gpu_id} does not match its constraints")
        elif not usable(state, gpu_id):
            problems.append(f"{request.id}: {gpu_id} may take no new work (I7, I2)")
    if lease.state is not LeaseState.LOADING or lease.granted_at != lease.last_used_at:
        problems.append(f"{request.id}: a new lease must be loading, granted now")
    return problems


def _memory(state: View, plan: Plan) -> list[str]:
    """Each grant against what the ones before it left (I1, I2), and the load gate (I3),
    once what time ends in the plan has ended (its memory back, its loads done)."""
    ledger = copy.deepcopy(state.ledger)
    loaded = set()
    for lease in plan.loaded:
        held = state.leases.get(lease.id)
        if held is not None and held.loading:  # else reported by _timed
            ledger.finish_loading(held)
            loaded.add(held.id)
    for lease in plan.expired + plan.unclaimed:
        held = state.leases.get(lease.id)
        if held is not None:
            ledger.uncommit(evolve(held, loading=False) if held.id in loaded else held)
    limit = state.policy.max_concurrent_loads
    problems = []
    for lease in plan.grants:
        for gpu_id in lease.gpus:
            if gpu_id not in ledger:
                continue  # reported by _grant
            if ledger.free_mb(gpu_id) < lease.vram_mb:
                problems.append(
                    f"{lease.id}: {lease.vram_mb} MiB on {gpu_id}, "
                    f"{ledger.free_mb(gpu_id)} MiB free there (I1, I2)"
                )
            if ledger.loading(gpu_id) >= limit:
                problems.append(f"{lease.id}: a load on {gpu_id} with its gate closed (I3)")
        ledger.commit(lease)
    return problems


def _revocations(state: View, plan: Plan) -> list[str]:
    granted = {lease.id for lease in plan.grants}
    by_preemptor: dict[str, set[str]] = defaultdict(set)
    problems = []
    for revoked in plan.revocations:
        held = state.leases.get(revoked.id)
        preemptor = revoked.preempted_for
        if preemptor is None and revoked.revoke_reason in ("ttl_lapsed", "drain_deadline"):
            if held is None or held.state is LeaseState.REVOKING:
                problems.append(f"{revoked.id} is revoked but is not a held lease to revoke")
            continue  # its timer's, checked by the timers' own rules
        if held is None or held.state is LeaseState.REVOKING or revoked.id in granted:
            problems.append(f"{revoked.id} is revoked but is not a held lease to revoke")
        elif preemptor is None or preemptor not in state.queue:
            problems.append(f"{revoked.id} is revoked for {preemptor}, not a pending request")
        elif not eligible(held, state.queue.get(preemptor), state.policy, plan.now):
            problems.append(f"{revoked.id} may not be preempted by {preemptor} (I5)")
        else:
            by_preemptor[preemptor].add(revoked.id)
    for preemptor, victims in by_preemptor.items():
        problems += _frees_enough(state, plan, preemptor, victims)
    return problems


def _frees_enough(state: View, plan: Plan, preemptor: str, victims: set[str]) -> list[str]:
    nomination = None if plan.nominations is None else plan.nominations.get(preemptor)
    if nomination is None or nomination.victims != victims:
        return [f"{preemptor} preempts {sorted(victims)} without a nomination naming them"]
    need = state.queue.get(preemptor).vram_mb
    problems = []
    for gpu_id in nomination.gpus:
        gone = victims | _revoking(state, gpu_id)
        if state.ledger.free_after(gpu_id, gone) < need:
            problems.append(f"{preemptor}: its victims do not free {need} MiB on {gpu_id}")
    return problems


def _revoking(state: View, gpu_id: GpuId) -> set[str]:
    return {
        lid
        for lid in state.ledger.lease_ids(gpu_id)
        if state.leases[lid].state is LeaseState.REVOKING
    }


def _endings(state: View, plan: Plan) -> list[str]:
    granted = {lease.id for lease in plan.grants}
    problems = []
    for request_id in plan.timed_out:
        request = state.queue.get(request_id) if request_id in state.queue else None
        if request is None or request_id in granted:
            problems.append(f"{request_id} is timed out but is not a pending request")
        elif request.max_wait_s is None or request.submitted_at + request.max_wait_s > plan.now:
            problems.append(f"{request_id} is timed out before its max_wait_s")
    for name, old, new in plan.drained:
        worker = state.workers.get(name)
        if (
            worker is None
            or worker.status is not WorkerStatus.DRAINING
            or new is not (WorkerStatus.DRAINED)
        ):
            problems.append(f"{name} is marked {new} but was not draining ({old})")
        elif state.worker_lease_ids(name) - {lease.id for lease in plan.expired + plan.unclaimed}:
            problems.append(f"{name} is marked drained but holds leases")
    return problems
