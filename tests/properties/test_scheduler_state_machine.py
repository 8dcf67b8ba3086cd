"""Random event sequences against the decision core, checking I1-I7 and I10 after every step.

The checks recompute what must hold from the leases, probes and requests the
machine itself fed in, not from the scheduler's own accounting. Leases shrink at
random (a model server put to sleep); a probe may show a shrunk lease's process
still holding what it was granted, and no grant may land on that memory (I2, I4).
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpu_arbiter.core import (
    Conflict,
    Constraints,
    Decisions,
    Gpu,
    GpuId,
    GpuProbe,
    Lease,
    LeaseState,
    Policy,
    Request,
    Scheduler,
    Unschedulable,
    Worker,
    WorkerStatus,
)
from gpu_arbiter.core.verify import check_plan

GPUS = (
    Gpu(index=0, total_mb=24576, worker="w1"),
    Gpu(index=1, total_mb=16384, worker="w1"),
    Gpu(index=0, total_mb=24576, worker="w2", headroom_mb=256),
)
WORKERS = ("w1", "w2")
SIZES = (1000, 2000, 4000, 6000, 8000, 12000, 16000, 20000, 24000, 30000)
PRIORITIES = (100, 300, 500, 800, 1000)
REQUEST_FIELDS = {
    "size": st.sampled_from(SIZES),
    "gpus": st.sampled_from([1, 1, 1, 2]),
    "priority": st.sampled_from(PRIORITIES),
    "preemptible": st.sampled_from([None, True, False]),
    "worker": st.sampled_from([None, None, "w1", "w2"]),
    "max_wait_s": st.sampled_from([None, None, 5.0]),
    "ttl_s": st.sampled_from([None, None, 20.0]),
}


def fingerprint(sched: Scheduler) -> tuple[object, ...]:
    """Everything a plan could change, as values: leases, queue, nominations, memory,
    tokens, workers, counters."""
    ledger = sched.ledger
    return (
        dict(sched.leases),
        [r.id for r in sched.queue.ordered(sched.policy, 0.0)],
        {rid: (n.gpus, set(n.victims), dict(n.probe_seqs)) for rid, n in sched.nominations.items()},
        [ledger.figures(g) for g in sched.gpu_ids()],
        list(ledger.by_free),
        sched.next_token,
        dict(sched.workers),
        dict(sched.counters),
        sorted(sched._timers._heap),
        dict(sched._drain_deadlines),
        sorted(sched.drain_check),
        sched.reshaped,
        sched.presence.watches(),
    )


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.sched = Scheduler()
        self.gpus = {g.id: g for g in GPUS}
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Lease] = {}  # as granted (then as shrunk): id, size, GPUs
        self.shrunk: set[str] = set()  # held leases that gave memory back
        self.ended: set[str] = set()
        self.revoking: set[str] = set()
        self.revoked_at: dict[str, float] = {}
        self.probes: dict[GpuId, GpuProbe] = {}
        self.idle_since: dict[str, float] = {}  # idle leases: when their holder said so
        self.stale: set[GpuId] = set()
        self.last_token = 0
        self.counter = 0

    @initialize(
        loads=st.sampled_from([1, 2]),
        placement=st.sampled_from(["binpack", "spread"]),
        exempt=st.sampled_from([0.0, 5.0]),
        idle_reclaim=st.sampled_from([math.inf, 0.0, 10.0, 40.0]),
        starvation=st.sampled_from([math.inf, 0.0, 20.0]),
        patience=st.sampled_from([0.0, 0.0, 3.0]),
    )
    def setup(
        self,
        loads: int,
        placement: str,
        exempt: float,
        idle_reclaim: float,
        starvation: float,
        patience: float,
    ) -> None:
        policy = Policy(
            max_concurrent_loads=loads,
            placement=placement,  # type: ignore[arg-type]
            preempt_exempt_s=exempt,
            aging_interval_s=10.0,
            aging_step=50,
            idle_reclaim_s=idle_reclaim,
            starvation_s=starvation,
            preempt_patience_s=patience,
        )
        self.sched = Scheduler(policy)
        for name in WORKERS:
            self.sched.put_worker(Worker(name), [g for g in GPUS if g.worker == name])

    # ------------------------------------------------------------ helpers

    @property
    def policy(self) -> Policy:
        return self.sched.policy

    def _on(self, gpu_id: GpuId, ids: set[str] | dict[str, Lease]) -> list[str]:
        return [lid for lid in ids if gpu_id in self.held[lid].gpus]

    def _occupied(self, gpu_id: GpuId, live: set[str]) -> int:
        """I2's occupied memory of a GPU given the leases ``live``, from the last probe."""
        ids = [lid for lid in live if gpu_id in self.held[lid].gpus]
        committed = sum(self.held[lid].vram_mb for lid in ids)
        probe = self.probes.get(gpu_id)
        if probe is None:
            return committed
        if probe.lease_used_mb is None:
            return max(committed, probe.used_mb)
        per_lease = probe.lease_used_mb
        attributed = sum(per_lease.get(lid, 0) for lid in ids)
        exact = sum(max(self.held[lid].vram_mb, per_lease.get(lid, 0)) for lid in ids)
        return exact + max(0, probe.used_mb - attributed)

    def _matches(self, request: Request, gpu_id: GpuId) -> bool:
        worker = request.constraints.worker
        return (worker is None or worker == gpu_id.worker) and (
            self.gpus[gpu_id].capacity_mb >= request.vram_mb
        )

    def _end(self, lease_id: str) -> None:
        assert lease_id in self.held, f"{lease_id} released twice or never granted"
        assert lease_id not in self.ended
        del self.held[lease_id]
        self.shrunk.discard(lease_id)
        self.idle_since.pop(lease_id, None)
        self.ended.add(lease_id)
        self.revoking.discard(lease_id)

    def _track_revoked(self, leases: list[Lease] | tuple[Lease, ...]) -> None:
        for lease in leases:
            assert lease.state is LeaseState.REVOKING
            assert lease.id in self.held
            assert lease.id not in self.revoking, "a revocation reported twice"
            self.revoking.add(lease.id)
            self.revoked_at[lease.id] = self.now

    def _pick(self, data: st.DataObject, ids: set[str] | list[str]) -> str:
        return data.draw(st.sampled_from(sorted(ids)))

    # ------------------------------------------------------------ events

    @rule(**REQUEST_FIELDS)
    def submit(self, **fields: Any) -> None:
        self._submit(**fields)

    @rule(**REQUEST_FIELDS)
    def submit_another(self, **fields: Any) -> None:  # requests are the most common event
        self._submit(**fields)

    @rule(size=st.sampled_from([12000, 16000, 20000]), priority=st.sampled_from([500, 800, 1000]))
    def submit_urgent(self, size: int, priority: int) -> None:  # one that will often preempt
        self._submit(
            size=size,
            gpus=1,
            priority=priority,
            preemptible=None,
            worker=None,
            max_wait_s=None,
            ttl_s=None,
        )

    def _submit(
        self,
        size: int,
        gpus: int,
        priority: int,
        preemptible: bool | None,
        worker: str | None,
        max_wait_s: float | None,
        ttl_s: float | None,
    ) -> None:
        self.counter += 1
        request = Request.build(
            f"r{self.counter}",
            vram_mb=size,
            gpus=gpus,
            priority=priority,
            preemptible=preemptible,
            constraints=Constraints.build(worker=worker),
            max_wait_s=max_wait_s,
            ttl_s=ttl_s,
        )
        per_worker = Counter(g.worker for g in self.gpus if self._matches(request, g))
        possible = any(n >= gpus for n in per_worker.values())
        try:
            queued: Request | None = self.sched.submit(request, self.now)
        except Unschedulable:
            queued = None
        assert (queued is not None) is possible, "rejected a possible request, or the reverse"
        if queued is not None:
            self.requests[request.id] = queued

    @rule()
    def decide_again(self) -> None:  # cycles are as common as events
        self.decide(planned=False)

    def _cycle(self, now: float, planned: bool) -> Decisions:
        """One cycle: ``decide``, or its two steps with the plan checked against a fresh
        copy of the state it was made from (plan verification), and that state left as it
        was by making the plan."""
        if not planned:
            return self.sched.decide(now)
        fresh = copy.deepcopy(self.sched)
        before = fingerprint(self.sched)
        plan = self.sched.plan(now)
        assert fingerprint(self.sched) == before, "making a plan changed the state"
        assert check_plan(fresh, plan) == []
        return self.sched.apply(plan)

    @rule()
    def decide(self, planned: bool = True) -> None:
        now = self.now
        statuses = {name: w.status for name, w in self.sched.workers.items()}
        before = {lid: self.sched.lease(lid) for lid in self.held}
        order = {r.id: pos for pos, r, _ in self.sched.pending(now)}
        paused = self.sched.paused

        decisions = self._cycle(now, planned)

        for lease in decisions.expired:
            assert before[lease.id].expires_at <= now
            assert lease.state is LeaseState.EXPIRED
            self._end(lease.id)
        loaded = {lease.id for lease in decisions.loaded}
        for lease_id in loaded:
            assert before[lease_id].loading
            assert before[lease_id].load_deadline <= now
        live = set(self.held)  # what the placement walk started from
        loading = {g: 0 for g in self.gpus}
        for lid in live:
            if before[lid].loading and lid not in loaded:
                for g in before[lid].gpus:
                    loading[g] += 1
        if paused:
            assert decisions.grants == ()
        self._check_grants(decisions, order, statuses, live, loading)
        self._check_revocations(decisions, before, now)
        self._check_order(decisions, order, statuses, live, loading)
        self._check_preemptions_free_enough(decisions, order)
        self._check_shrunk_memory_not_granted(decisions, live)
        self._check_revoked_holders_bounded(now)
        if not decisions.timed_out:  # a timed-out request's hold is gone only after the walk
            self._check_work_conserved(now)
        for request in decisions.timed_out:
            assert request.max_wait_s is not None
            assert request.submitted_at + request.max_wait_s <= now
        for name, old, new in decisions.workers:
            assert (old, new) == (WorkerStatus.DRAINING, WorkerStatus.DRAINED)
            assert not any(lease.worker == name for lease in self.held.values())

    def _check_work_conserved(self, now: float) -> None:
        """I10: after the cycle, no pending request could be granted on any GPU unless held
        back by the pause, a load gate, a nomination ahead of it (or memory on its way back
        to a preemptor), or its own constraints: free memory never sits idle while work that
        fits waits."""
        if self.sched.paused:
            return
        live = set(self.held)
        loading = Counter(
            g for lid in live if self.sched.lease(lid).loading for g in self.held[lid].gpus
        )
        reasons = {r.id: self.sched.explain(r.id, now) for _, r, _ in self.sched.pending(now)}
        for request_id, reason in reasons.items():  # a request never waits on itself
            assert reason.blocked_by != request_id, f"{request_id} is blocked by itself"
            assert reason.gpus == () or sum(v.count for v in reason.gpus) == len(self.gpus)
        preheld = self.sched.held_for_preemptors()
        made = self._made_holds()
        ahead: Counter[GpuId] = Counter()
        for _, request, _ in self.sched.pending(now):
            holds = ahead.copy()
            for other, gpus in preheld.items():
                if other != request.id and self.requests[other].priority >= request.priority:
                    for g in gpus:
                        holds[g] += self.requests[other].vram_mb
            fitting = Counter(
                g.worker
                for g in self.gpus
                if self._matches(request, g)
                and self.sched.workers[g.worker].status is WorkerStatus.ONLINE
                and g not in self.stale
                and self.gpus[g].capacity_mb - self._occupied(g, live) - holds[g] >= request.vram_mb
                and loading[g] < self.policy.max_concurrent_loads
            )
            assert not any(n >= request.gpus for n in fitting.values()), (
                f"I10: {request.id} could be granted but waits ({reasons[request.id].code})"
            )
            if request.id not in preheld:
                for g in made.get(request.id, ()):
                    ahead[g] += request.vram_mb

    def _made_holds(self) -> dict[str, tuple[GpuId, ...]]:
        """The GPUs each request held at its turn in the last plan (the core's own record of
        the walk, :meth:`~gpu_arbiter.core.Plan.held`: never a "why")."""
        plan = self.sched.last_plan
        if plan is None:
            return {}
        return {h.request_id: h.gpus for h in plan.held() if not h.preheld}

    def _check_shrunk_memory_not_granted(self, decisions: Decisions, live: set[str]) -> None:
        """I4 for a shrink: memory a lease gave back is granted to another request only once
        the latest probe shows it free. On every GPU holding a shrunk lease, this cycle's
        grants fit beside what the probe still sees in use (a shrunk process above its new
        size counts at what the probe shows) and beside every lease's reservation."""
        granted: Counter[GpuId] = Counter()
        for lease in decisions.grants:
            for g in lease.gpus:
                granted[g] += lease.vram_mb
        for g, new_mb in granted.items():
            ids = [lid for lid in live if g in self.held[lid].gpus]
            probe = self.probes.get(g)
            if probe is None or not self.shrunk.intersection(ids):
                continue
            reserved = {lid: self.held[lid].vram_mb for lid in ids}
            if probe.lease_used_mb is None:
                in_use = max(sum(reserved.values()), probe.used_mb)
            else:
                used = probe.lease_used_mb
                strangers = probe.used_mb - sum(used.get(lid, 0) for lid in ids)
                in_use = sum(max(mb, used.get(lid, 0)) for lid, mb in reserved.items())
                in_use += max(0, strangers)
            assert in_use + new_mb <= self.gpus[g].capacity_mb, (
                f"I4: a grant on {g} landed on memory a shrunk lease's process still holds"
            )

    def _check_revoked_holders_bounded(self, now: float) -> None:
        """I4: a revoked holder, however often it renews, holds its memory at most grace + TTL
        after its revocation (then its preemptor can have it)."""
        for lease_id in self.revoking:
            ttl = self.held[lease_id].request.ttl_s
            if ttl is not None:
                limit = self.revoked_at[lease_id] + self.policy.grace_s + ttl
                assert now < limit, f"revoked {lease_id} still held at {now} (bound {limit})"

    def _holds_ahead(self, order: dict[str, int], position: int) -> Counter[GpuId]:
        """Memory held at the turn of ``position``, from the holds the last plan's walk
        made: at the turns of requests ahead of it, and the preholds of preemptors behind it
        of equal or higher base priority (memory their preemption freed, held for them until
        their own turn)."""
        priority = next(
            self.requests[rid].priority for rid, pos in order.items() if pos == position
        )
        holds: Counter[GpuId] = Counter()
        plan = self.sched.last_plan
        for hold in () if plan is None else plan.held():
            pos = order[hold.request_id]
            if (not hold.preheld and pos < position) or (
                hold.preheld
                and pos > position
                and self.requests[hold.request_id].priority >= priority
            ):
                for g in hold.gpus:
                    holds[g] += hold.vram_mb
        return holds

    def _check_grants(
        self,
        decisions: Decisions,
        order: dict[str, int],
        statuses: dict[str, WorkerStatus],
        live: set[str],
        loading: dict[GpuId, int],
    ) -> None:
        live = set(live)  # grows with each grant: the I2 rule counts them as committed
        granted_loads: Counter[GpuId] = Counter()
        positions = [order[lease.id] for lease in decisions.grants]
        assert positions == sorted(positions), "grants out of queue order"
        for lease in decisions.grants:
            request = self.requests[lease.id]
            assert lease.token > self.last_token, "fencing token did not increase"
            self.last_token = lease.token
            assert lease.state is LeaseState.LOADING
            assert lease.loading
            assert len(lease.gpus) == request.gpus == len(set(lease.gpus))
            assert len({g.worker for g in lease.gpus}) == 1
            holds = self._holds_ahead(order, order[lease.id])
            for g in lease.gpus:
                assert self._matches(request, g)
                assert statuses[g.worker] is WorkerStatus.ONLINE, "I7: grant on a non-online worker"
                assert g not in self.stale, "I2: grant on a GPU whose probe is stale"
                room = self.gpus[g].capacity_mb - self._occupied(g, live) - holds[g]
                assert request.vram_mb <= room, f"I2: {lease.id} does not fit on {g}"
                assert loading[g] + granted_loads[g] < self.policy.max_concurrent_loads, "I3"
                granted_loads[g] += 1
            self.held[lease.id] = lease
            live.add(lease.id)

    def _check_revocations(
        self, decisions: Decisions, before: dict[str, Lease], now: float
    ) -> None:
        granted = {lease.id: lease for lease in decisions.grants}
        for lease in decisions.revocations:
            old = before[lease.id] if lease.id in before else granted[lease.id]
            assert old.state is not LeaseState.REVOKING, "revoked twice"
            if lease.revoke_reason == "preempted":
                assert lease.preempted_for is not None
                assert lease.id not in granted, "revoked in the cycle that granted it"
                if old.idle:
                    self._check_reclaim(lease.id, self.requests[lease.preempted_for], now)
                else:
                    self._check_preemption(old, self.requests[lease.preempted_for], now)
            else:
                assert lease.revoke_reason == "drain_deadline"
        expired = {lease.id for lease in decisions.expired}
        # a drain deadline that fell before a TTL: revoked, then expired, in one cycle
        self._track_revoked([lease for lease in decisions.revocations if lease.id not in expired])

    def _check_reclaim(self, lease_id: str, preemptor: Request, now: float) -> None:
        """I5 for an idle lease (a cache, not a claim): equal or higher priority at once; any
        priority once it has been idle ``idle_reclaim_s`` or the preemptor has waited
        ``starvation_s``."""
        assert lease_id in self.idle_since, "I5: a busy lease was taken as an idle one"
        idle_for = now - self.idle_since[lease_id]
        waited = now - preemptor.submitted_at
        assert (
            self.held[lease_id].base_priority <= preemptor.priority
            or idle_for >= self.policy.idle_reclaim_s
            or waited >= self.policy.starvation_s
        ), f"I5: idle {lease_id} (idle {idle_for} s) reclaimed by lower priority {preemptor.id}"

    def _check_preemption(self, old: Lease, preemptor: Request, now: float) -> None:
        """I5 for busy work: strictly downward, never by aging, idle time or starvation."""
        assert old.id not in self.idle_since, "I5: a busy lease seen as idle"
        assert old.request.preemptible, "I5: a non-preemptible lease was preempted"
        assert old.base_priority < preemptor.priority, "I5: busy lease by equal/lower priority"
        assert now - old.granted_at >= self.policy.preempt_exempt_s
        assert now - preemptor.submitted_at >= self.policy.preempt_patience_s, "patience"

    def _occupied_without(self, gpu_id: GpuId, gone: set[str]) -> int:
        """Occupied memory once the leases ``gone`` have stopped and the probe shows it."""
        ids = set(self._on(gpu_id, self.held))
        gone = gone & ids
        gone_mb = sum(self.held[lid].vram_mb for lid in gone)
        committed = sum(self.held[lid].vram_mb for lid in ids) - gone_mb
        probe = self.probes.get(gpu_id)
        if probe is None:
            return committed
        if probe.lease_used_mb is None:
            return max(committed, probe.used_mb - gone_mb)
        used = probe.lease_used_mb
        exact = sum(max(self.held[lid].vram_mb, used.get(lid, 0)) for lid in gone)
        return self._occupied(gpu_id, ids) - exact

    def _check_preemptions_free_enough(self, decisions: Decisions, order: dict[str, int]) -> None:
        """No revocation starts that cannot free enough for the request it is for."""
        preemptors = {
            lease.preempted_for
            for lease in decisions.revocations
            if lease.revoke_reason == "preempted"
        }
        for request_id in preemptors:
            assert request_id is not None
            if request_id not in self.sched.queue:
                continue  # timed out at the end of this very cycle
            request = self.requests[request_id]
            nominated = self._made_holds()[request_id]
            assert nominated == self.sched.nominations[request_id].gpus
            assert len(nominated) == request.gpus
            holds = self._holds_ahead(order, order[request_id])
            for g in nominated:
                free = self.gpus[g].capacity_mb - self._occupied_without(g, self.revoking)
                assert free - holds[g] >= request.vram_mb, f"preempting for {request_id} on {g}"

    def _check_order(
        self,
        decisions: Decisions,
        order: dict[str, int],
        statuses: dict[str, WorkerStatus],
        live: set[str],
        loading: dict[GpuId, int],
    ) -> None:
        """I6: a request left pending ahead of a grant could not have fitted at its turn."""
        if not decisions.grants:
            return
        last = max(order[lease.id] for lease in decisions.grants)
        for request_id, position in order.items():
            if position > last or request_id not in self.sched.queue:
                continue
            request = self.requests[request_id]
            holds = self._holds_ahead(order, position)
            ahead = {lease.id for lease in decisions.grants if order[lease.id] < position}
            loads: Counter[GpuId] = Counter(g for lid in ahead for g in self.held[lid].gpus)
            fitting = Counter(
                g.worker
                for g in self.gpus
                if self._matches(request, g)
                and statuses[g.worker] is WorkerStatus.ONLINE
                and g not in self.stale
                and self.gpus[g].capacity_mb - self._occupied(g, live | ahead) - holds[g]
                >= request.vram_mb
                and loading[g] + loads[g] < self.policy.max_concurrent_loads
            )
            assert not any(n >= request.gpus for n in fitting.values()), (
                f"I6: {request_id} could fit at its turn but was passed over"
            )

    @precondition(lambda self: any(self.sched.lease(lid).loading for lid in self.held))
    @rule(data=st.data())
    def ready(self, data: st.DataObject) -> None:
        lease_id = self._pick(data, [lid for lid in self.held if self.sched.lease(lid).loading])
        assert not self.sched.ready(lease_id, self.now).loading

    @precondition(lambda self: set(self.held) - self.revoking)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease_id = self._pick(data, set(self.held) - self.revoking)
        assert self.sched.release(lease_id, self.now).state is LeaseState.RELEASED
        self._end(lease_id)

    @precondition(lambda self: self.revoking)
    @rule(data=st.data())
    def holder_stopped(self, data: st.DataObject) -> None:
        lease_id = self._pick(data, self.revoking)
        self.sched.release(lease_id, self.now)
        self._end(lease_id)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), fraction=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0, 1.5]))
    def shrink(self, data: st.DataObject, fraction: float) -> None:
        """A holder gives memory back (any held state); growing is refused, changing nothing."""
        lease_id = self._pick(data, set(self.held))
        old = self.sched.lease(lease_id)
        assert old.vram_mb == self.held[lease_id].vram_mb
        size = max(1, int(old.vram_mb * fraction))
        committed = {g: self.sched.figures(g).committed_mb for g in old.gpus}
        if size > old.vram_mb:
            with pytest.raises(Conflict, match="grows only through a new grant"):
                self.sched.shrink(lease_id, size, self.now)
            assert self.sched.lease(lease_id).vram_mb == old.vram_mb
            assert {g: self.sched.figures(g).committed_mb for g in old.gpus} == committed
            return
        shrunk = self.sched.shrink(lease_id, size, self.now)
        assert shrunk.vram_mb == size
        assert shrunk.granted_mb == old.granted_mb
        assert (shrunk.state, shrunk.token, shrunk.gpus) == (old.state, old.token, old.gpus)
        for g in old.gpus:  # committed drops at once (I1)
            assert self.sched.figures(g).committed_mb == committed[g] - (old.vram_mb - size)
        self.held[lease_id] = shrunk
        if size < old.granted_mb:
            self.shrunk.add(lease_id)

    @precondition(lambda self: set(self.held) - self.revoking)
    @rule(data=st.data())
    def revoke(self, data: st.DataObject) -> None:
        lease_id = self._pick(data, set(self.held) - self.revoking)
        self._track_revoked([self.sched.revoke(lease_id, "admin", self.now)])

    @precondition(lambda self: self.held)
    @rule(data=st.data(), idle=st.booleans())
    def set_idle(self, data: st.DataObject, idle: bool) -> None:
        lease_id = self._pick(data, set(self.held))
        assert self.sched.set_idle(lease_id, idle, self.now).idle is idle
        if not idle:
            self.idle_since.pop(lease_id, None)
        elif lease_id not in self.idle_since:
            self.idle_since[lease_id] = self.now

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        self._renew(self._pick(data, set(self.held)))

    @precondition(lambda self: self.revoking)
    @rule(data=st.data())
    def revoked_holder_renews(self, data: st.DataObject) -> None:  # it ignores its revocation
        self._renew(self._pick(data, self.revoking))

    def _renew(self, lease_id: str) -> None:
        if lease_id in self.revoking and self.now > self.revoked_at[lease_id] + self.policy.grace_s:
            with pytest.raises(Conflict, match="grace"):
                self.sched.renew(lease_id, self.now)
            return
        renewed = self.sched.renew(lease_id, self.now)
        ttl = renewed.request.ttl_s
        if lease_id in self.revoking and ttl is not None:
            assert renewed.expires_at <= self.revoked_at[lease_id] + self.policy.grace_s + ttl

    @precondition(lambda self: len(self.sched.queue) > 0)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        request_id = self._pick(data, [r.id for _, r, _ in self.sched.pending(self.now)])
        self.sched.cancel(request_id)

    @rule(
        index=st.integers(0, len(GPUS) - 1),
        strangers_mb=st.sampled_from([0, 0, 500, 3000, 8000]),
        grown=st.sampled_from([0.0, 0.5, 1.0, 1.2]),
        per_lease=st.booleans(),
        fails=st.sampled_from([False, False, False, True]),
        still_holding=st.booleans(),
    )
    def probe(
        self,
        index: int,
        strangers_mb: int,
        grown: float,
        per_lease: bool,
        fails: bool,
        still_holding: bool,
    ) -> None:
        """A probe reading: leases have grown to ``grown`` of their reservation (of what they
        were granted, for shrunk ones ``still_holding`` their memory); or it failed."""
        gpu_id = GPUS[index].id
        if fails:
            self.sched.set_probe(gpu_id, None)
            self.stale.add(gpu_id)
            return
        held = self.held
        used = {
            lid: int((held[lid].granted_mb if still_holding else held[lid].vram_mb) * grown)
            for lid in self._on(gpu_id, held)
        }
        total = min(sum(used.values()) + strangers_mb, self.gpus[gpu_id].total_mb)
        probe = GpuProbe(used_mb=total, lease_used_mb=used if per_lease else None)
        self.sched.set_probe(gpu_id, probe)
        self.probes[gpu_id] = probe
        self.stale.discard(gpu_id)

    @rule()
    def pause_or_resume(self) -> None:
        if self.sched.paused:
            self.sched.resume()
        else:
            self.sched.pause()

    @rule(seconds=st.sampled_from([0.5, 1.0, 3.0, 10.0, 30.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @rule(
        worker=st.sampled_from(WORKERS),
        change=st.sampled_from(["drain", "cancel_drain", "heartbeat_lost", "heartbeat_back"]),
        force=st.booleans(),
        deadline=st.booleans(),
    )
    def worker_changes(self, worker: str, change: str, force: bool, deadline: bool) -> None:
        if change == "drain":
            self._drain(worker, force, deadline)
        elif change == "cancel_drain":
            self._cancel_drain(worker)
        elif change == "heartbeat_lost":
            revoked = self.sched.set_offline(worker, self.now)
            assert all(lease.revoke_reason == "drain" for lease in revoked)
            self._track_revoked(revoked)
            assert self.sched.workers[worker].status is WorkerStatus.OFFLINE
        elif self.sched.workers[worker].status is WorkerStatus.OFFLINE:
            self.sched.set_worker_status(worker, WorkerStatus.ONLINE)

    def _drain(self, worker: str, force: bool, deadline: bool) -> None:
        try:
            revoked = self.sched.drain(
                worker, self.now, force=force, deadline_s=10.0 if deadline else None
            )
        except Conflict:
            assert self.sched.workers[worker].status is WorkerStatus.OFFLINE
            return
        assert self.sched.workers[worker].status in (WorkerStatus.DRAINING, WorkerStatus.DRAINED)
        assert all(lease.revoke_reason == "drain" for lease in revoked)
        self._track_revoked(revoked)

    def _cancel_drain(self, worker: str) -> None:
        status = self.sched.workers[worker].status
        try:
            self.sched.cancel_drain(worker)
        except Conflict:
            assert status in (WorkerStatus.ONLINE, WorkerStatus.OFFLINE)
            return
        assert self.sched.workers[worker].status is WorkerStatus.ONLINE

    # ------------------------------------------------------------ after every step

    @invariant()
    def leases_are_the_ones_granted(self) -> None:
        assert set(self.sched.leases) == set(self.held)
        for lease_id in self.revoking:
            assert self.sched.lease(lease_id).state is LeaseState.REVOKING  # I4

    @invariant()
    def no_over_commit(self) -> None:
        for gpu_id, gpu in self.gpus.items():
            on_gpu = [lease for lease in self.sched.leases.values() if gpu_id in lease.gpus]
            committed = sum(lease.vram_mb for lease in on_gpu)
            assert committed <= gpu.capacity_mb, f"I1: {gpu_id} over-committed"
            assert all(lease.state.holds_memory for lease in on_gpu)
            figures = self.sched.figures(gpu_id)
            assert figures.committed_mb == committed  # revoking leases still count (I4)
            loading = sum(lease.loading for lease in on_gpu)
            assert loading == figures.loading
            assert loading <= self.policy.max_concurrent_loads, "I3"


SchedulerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerMachine = SchedulerMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(
    ttl_s=st.sampled_from([1.0, 5.0, 20.0, 60.0]),
    grace_s=st.sampled_from([0.0, 3.0, 10.0]),
    renew_every_s=st.floats(0.05, 10.0),
    renewed_ahead_s=st.sampled_from([None, 600.0]),
)
def test_a_renewing_revoked_holder_never_keeps_a_preemptor_waiting_past_grace_plus_ttl(
    ttl_s: float, grace_s: float, renew_every_s: float, renewed_ahead_s: float | None
) -> None:
    """I4/I8: a holder that ignores its revocation and keeps renewing (even one that renewed
    far ahead before) is cut off: its preemptor is granted at grace + TTL after the
    revocation at the latest, by the core's own timer."""
    sched = Scheduler(Policy(grace_s=grace_s))
    sched.put_worker(Worker("w1"), [Gpu(index=0, total_mb=24576, worker="w1")])
    sched.submit(Request.build("victim", vram_mb=20000, priority="batch", ttl_s=ttl_s), 0.0)
    assert [lease.id for lease in sched.decide(0.0).grants] == ["victim"]
    sched.renew("victim", 0.9, renewed_ahead_s)  # renewed_ahead_s: far beyond its TTL
    sched.submit(Request.build("preemptor", vram_mb=16000, priority="interactive"), 1.0)
    assert [lease.id for lease in sched.decide(1.0).revocations] == ["victim"]
    bound = 1.0 + grace_s + ttl_s
    now, next_renewal, granted_at = 1.0, 1.0, None
    while granted_at is None and now <= bound + 2 * renew_every_s:
        if now >= next_renewal and "victim" in sched.leases:
            next_renewal = now + renew_every_s
            try:
                renewed = sched.renew("victim", now)
            except Conflict:
                assert now > 1.0 + grace_s, "renewal refused within the grace"
            else:
                assert renewed.expires_at <= bound
        if "preemptor" in {lease.id for lease in sched.decide(now).grants}:
            granted_at = now
        deadline = sched.next_deadline()
        now = min(next_renewal, deadline if deadline is not None else next_renewal)
    assert granted_at is not None, "the preemptor waited past grace + TTL"
    assert granted_at <= bound
