"""Every reason and every lease the API shows is strict JSON, whatever state the core is in.

Random event sequences, each followed by a cycle as the controller runs one, drive the
decision core through every kind of state a pending request can wait in (leases loading,
revoking, idle, busy; TTLs that lapse and leases with none; drains, offline workers and
stale probes; preemptions in progress; multi-GPU requests; the pause; aging; policy
settings at infinity), and after every step each pending request's reason and each
lease, as the API renders them (``server.schemas.lease_out``), go through
``json.dumps(..., allow_nan=False)``: a figure that is not finite (a lease without a
TTL expires at ``inf`` in the core) never reaches JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpu_arbiter.controller import PendingView
from gpu_arbiter.core import (
    Conflict,
    Constraints,
    Gpu,
    GpuProbe,
    LeaseState,
    Policy,
    Request,
    Scheduler,
    Unschedulable,
    Worker,
    WorkerStatus,
)
from gpu_arbiter.server.schemas import lease_out
from gpu_arbiter.store import LeaseRecord

GPUS = (
    Gpu(index=0, total_mb=24576, worker="w1"),
    Gpu(index=1, total_mb=16384, worker="w1"),
    Gpu(index=0, total_mb=24576, worker="w2", headroom_mb=256),
)
WORKERS = ("w1", "w2")
NEVER = math.inf


def strict(value: object) -> str:
    """``value`` as strict JSON (raises ValueError on a non-finite number)."""
    return json.dumps(value, allow_nan=False)


class ReasonsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.sched = Scheduler()
        self.counter = 0
        self.ended: list[LeaseRecord] = []  # the API shows ended leases too

    @initialize(
        loads=st.sampled_from([1, 2]),
        exempt=st.sampled_from([0.0, 5.0, NEVER]),
        grace=st.sampled_from([0.0, 10.0, NEVER]),
        idle_reclaim=st.sampled_from([NEVER, 0.0, 10.0, 60.0]),
        starvation=st.sampled_from([NEVER, 0.0, 20.0]),
        patience=st.sampled_from([0.0, 3.0, NEVER]),
    )
    def setup(
        self,
        loads: int,
        exempt: float,
        grace: float,
        idle_reclaim: float,
        starvation: float,
        patience: float,
    ) -> None:
        policy = Policy(
            max_concurrent_loads=loads,
            preempt_exempt_s=exempt,
            grace_s=grace,
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

    def _held(self) -> list[str]:
        return sorted(self.sched.leases)

    def _pick(self, data: st.DataObject, ids: list[str]) -> str:
        return data.draw(st.sampled_from(ids))

    # ------------------------------------------------------------ events, each then a cycle

    def cycle(self) -> None:
        """A cycle, as the controller runs one after every event and at every deadline."""
        decisions = self.sched.decide(self.now)
        for lease in (*decisions.expired, *decisions.unclaimed):
            self.ended.append(LeaseRecord(lease.request, lease.state, None, lease, self.now))
        self.ended = self.ended[-20:]

    @rule(
        size=st.sampled_from([1000, 4000, 8000, 12000, 16000, 20000, 24000]),
        gpus=st.sampled_from([1, 1, 2]),
        priority=st.sampled_from([100, 300, 500, 800, 1000]),
        preemptible=st.sampled_from([None, True, False]),
        worker=st.sampled_from([None, None, "w1", "w2"]),
        ttl_s=st.sampled_from([None, 5.0, 20.0]),
        max_wait_s=st.sampled_from([None, None, 5.0]),
        load_timeout_s=st.sampled_from([5.0, 300.0]),
    )
    def submit(self, worker: str | None, **fields: Any) -> None:
        self._submit(Constraints.build(worker=worker), **fields)

    @rule(
        size=st.sampled_from([12000, 16000, 20000]),
        gpus=st.sampled_from([1, 2]),
        priority=st.sampled_from([500, 800, 1000]),
        ttl_s=st.sampled_from([None, 20.0]),
    )
    def submit_urgent(self, **fields: Any) -> None:  # one that will often preempt
        self._submit(Constraints(), **fields)

    def _submit(self, constraints: Constraints, **fields: Any) -> None:
        self.counter += 1
        size = fields.pop("size")
        request = Request.build(f"r{self.counter}", vram_mb=size, constraints=constraints, **fields)
        try:
            self.sched.submit(request, self.now)
        except Unschedulable as refused:
            strict(refused.reason.as_dict())  # a 422's details
        self.cycle()

    @precondition(lambda self: any(lease.loading for lease in self.sched.leases.values()))
    @rule(data=st.data())
    def ready(self, data: st.DataObject) -> None:
        loading = [lid for lid in self._held() if self.sched.leases[lid].loading]
        self.sched.ready(self._pick(data, loading), self.now)
        self.cycle()

    @precondition(lambda self: self.sched.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:  # a busy holder, or a victim that stopped
        lease = self.sched.release(self._pick(data, self._held()), self.now)
        self.ended.append(LeaseRecord(lease.request, lease.state, None, lease, self.now))
        self.cycle()

    @precondition(lambda self: self.sched.leases)
    @rule(data=st.data(), idle=st.booleans())
    def set_idle(self, data: st.DataObject, idle: bool) -> None:
        self.sched.set_idle(self._pick(data, self._held()), idle, self.now)
        self.cycle()

    @precondition(lambda self: self.sched.leases)
    @rule(data=st.data(), supervised=st.booleans())
    def set_supervised(self, data: st.DataObject, supervised: bool) -> None:
        self.sched.set_supervised(self._pick(data, self._held()), supervised, self.now)
        self.cycle()

    @precondition(lambda self: self.sched.leases)
    @rule(data=st.data(), ttl_s=st.sampled_from([None, 1.0, 60.0]))
    def renew(self, data: st.DataObject, ttl_s: float | None) -> None:
        try:
            self.sched.renew(self._pick(data, self._held()), self.now, ttl_s)
        except Conflict:
            return  # revoked, past its grace
        self.cycle()

    @precondition(lambda self: self.sched.leases)
    @rule(data=st.data())
    def revoke(self, data: st.DataObject) -> None:
        self.sched.revoke(self._pick(data, self._held()), "admin", self.now)
        self.cycle()

    @precondition(lambda self: self.sched.leases)
    @rule(data=st.data(), fraction=st.sampled_from([0.25, 0.5]))
    def shrink(self, data: st.DataObject, fraction: float) -> None:
        lease = self.sched.leases[self._pick(data, self._held())]
        self.sched.shrink(lease.id, max(1, int(lease.vram_mb * fraction)), self.now)
        self.cycle()

    @precondition(lambda self: len(self.sched.queue) > 0)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        pending = [r.id for _, r, _ in self.sched.pending(self.now)]
        self.sched.cancel(self._pick(data, pending))
        self.cycle()

    @rule(
        index=st.integers(0, len(GPUS) - 1),
        strangers_mb=st.sampled_from([0, 0, 3000, 8000]),
        per_lease=st.booleans(),
        fails=st.sampled_from([False, False, False, True]),
    )
    def probe(self, index: int, strangers_mb: int, per_lease: bool, fails: bool) -> None:
        """A reading of one GPU (its leases using what they hold once loaded, and memory of
        processes the arbiter does not know of), or a failed one: stale until the next."""
        gpu = GPUS[index]
        reading = None
        if not fails:
            used = {
                lease.id: lease.vram_mb
                for lease in self.sched.leases.values()
                if gpu.id in lease.gpus and not lease.loading
            }
            total = min(sum(used.values()) + strangers_mb, gpu.total_mb)
            reading = GpuProbe(used_mb=total, lease_used_mb=used if per_lease else None)
        self.sched.set_probe(gpu.id, reading)
        self.cycle()

    @rule()
    def pause_or_resume(self) -> None:
        if self.sched.paused:
            self.sched.resume()
        else:
            self.sched.pause()
        self.cycle()

    @rule(seconds=st.sampled_from([0.5, 3.0, 10.0, 30.0, 120.0]))
    def time_passes(self, seconds: float) -> None:  # TTLs lapse, aging, countdowns
        self.now += seconds
        self.cycle()

    @rule(
        worker=st.sampled_from(WORKERS),
        change=st.sampled_from(["drain", "cancel_drain", "offline", "back"]),
        force=st.booleans(),
        deadline=st.booleans(),
    )
    def worker_changes(self, worker: str, change: str, force: bool, deadline: bool) -> None:
        sched = self.sched
        try:
            if change == "drain":
                sched.drain(worker, self.now, force=force, deadline_s=10.0 if deadline else None)
            elif change == "cancel_drain":
                sched.cancel_drain(worker)
            elif change == "offline":
                sched.set_offline(worker, self.now)
            elif sched.workers[worker].status is WorkerStatus.OFFLINE:
                sched.set_worker_status(worker, WorkerStatus.ONLINE)
        except Conflict:
            return  # not a change this worker's state allows
        self.cycle()

    # ------------------------------------------------------------ after every step

    @invariant()
    def every_reason_and_lease_is_strict_json(self) -> None:
        sched, now = self.sched, self.now
        for position, request, effective in sched.pending(now):
            reason = sched.explain(request.id, now)
            assert reason.blocked_by != request.id, f"{request.id} waits for itself"
            view = PendingView(position, effective, reason)
            strict(lease_out(LeaseRecord(request, LeaseState.PENDING), view))
        for lease in sched.leases.values():
            strict(lease_out(LeaseRecord(lease.request, lease.state, None, lease)))
        for record in self.ended:
            strict(lease_out(record))


ReasonsMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestReasonsAsJson = ReasonsMachine.TestCase
