"""``ours``: the decision core itself (:class:`gpu_arbiter.core.Scheduler`) under simulation.

Nothing of the core's logic is copied here: this adapter submits requests,
reports ``ready``/``set_idle``/``release`` and runs a cycle exactly as the
asyncio engine does (``apply(plan(now))``), then checks the invariants I1, I3, I4,
I5, I6 and I10 on the core's own books after every step (I2 reduces to I1: the
simulated GPUs are declared by hand, without a probe; ``ours-sleep`` checks it
against its probe); I5 as the policy's settings extend it (``idle_reclaim_s``,
``starvation_s``, ``preempt_patience_s``); I6 and I10 exactly, prehold rule
included, on each plan against the state it was made from
(:func:`~..core.verify.check_order`, reading the walk's own holds, never a "why").

Keep-warm: when a run finishes, the holder marks its lease idle instead of
releasing it; a later request for the same model takes the idle lease back
(``set_idle(False)``) without a load. Idle leases are reclaimed by the core's
own preemption (reason ``preempted``) when memory is needed, least recently
used first: by equal or higher priority at once, by any priority once idle
``idle_reclaim_s`` or for a request that has waited ``starvation_s``.

Two variants over the same core, to show what each tier buys:

``ours-stop``
    No keep-warm: a model stops when its run ends (every start is a cold load).
``ours-sleep``
    Keep-warm and a sleep tier (:class:`.base.SleepTier`): an idle model is put to
    sleep with ``Scheduler.shrink``; the world probes every GPU whose memory changed
    (``set_probe`` with what each lease's process holds), so the memory a sleeping
    process still holds is granted only once it is given back (I2, I4). A wake is a
    request for the difference on the same GPUs (``constraints.gpu_ids``) through the
    queue and the load gate. A sleeping lease stays idle until its wake is granted
    (while the wake waits too: else a request nominated to its memory and the wake
    would wait on each other): the core reclaims it, least recently used first, like
    any idle-warm lease, and a request waiting on its wake then starts cold (as it
    does when the wake is not granted within the model's load time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import ClassVar

from ..core import (
    Constraints,
    GpuId,
    GpuProbe,
    Lease,
    PendingReason,
    Policy,
    Request,
    Scheduler,
    Unschedulable,
    WorkerStatus,
    hand_over,
)
from ..core.verify import check_order
from .base import Attempt, SleepTier, Step
from .cluster import Cluster

__all__ = ["Ours", "OursSleep", "OursStop"]


class Ours:
    name: ClassVar[str] = "ours"
    keeps_warm: ClassVar[bool] = True

    def __init__(self, cluster: Cluster, policy: Policy | None = None) -> None:
        self.scheduler = Scheduler(policy)
        for worker, gpus in cluster.workers:
            self.scheduler.put_worker(worker, gpus)
        self._capacity = cluster.capacity_mb()
        self._asked: dict[str, tuple[int, float]] = {}  # request id: (priority, submitted)
        self._order: list[str] = []  # what check_order found in the last plan

    def submit(self, attempt: Attempt, now: float) -> str | None:
        return self._ask(attempt, attempt.item.vram_mb, attempt.item.constraints, now)

    def _ask(
        self, attempt: Attempt, vram_mb: int, constraints: Constraints, now: float
    ) -> str | None:
        item = attempt.item
        request = Request.build(
            attempt.id,
            vram_mb=vram_mb,
            gpus=item.gpus,
            priority=item.priority,
            preemptible=item.preemptible,
            constraints=constraints,
            holder=item.holder,
            metadata={"model": item.model},
            ttl_s=None,  # simulated holders never crash: their leases end by release
            load_timeout_s=max(300.0, 2 * item.load_s + 1),
        )
        try:
            self.scheduler.submit(request, now)
        except Unschedulable as exc:
            return str(exc.reason.message)
        self._asked[attempt.id] = (item.priority, now)
        return None

    def cancel(self, attempt_id: str) -> None:
        self.scheduler.cancel(attempt_id)

    def ready(self, lease_id: str, now: float) -> None:
        self.scheduler.ready(lease_id, now)

    def set_idle(self, lease_id: str, idle: bool, now: float) -> None:
        self.scheduler.set_idle(lease_id, idle, now)

    def release(self, lease_id: str, now: float) -> None:
        self.scheduler.release(lease_id, now)
        self._asked.pop(lease_id, None)

    def decide(self, now: float) -> Step:
        """One cycle, as ``decide`` is (``apply(plan(now))``), the plan's order checked
        against the state it was made from on the way (see :meth:`check`)."""
        steps = _Steps()
        plan = self.scheduler.plan(now)
        self._order = check_order(self.scheduler, plan)
        hand_over(self.scheduler.apply(plan), steps)
        return Step(grants=tuple(steps.grants), revocations=tuple(steps.revocations))

    def next_deadline(self) -> float | None:
        return self.scheduler.next_deadline()

    # ------------------------------------------------------------------ invariants

    def check(self, now: float, step: Step, present: Mapping[str, tuple[GpuId, ...]]) -> list[str]:
        """I1, I3, I4 (:meth:`_check_memory`), I5 (:meth:`_check_preemptions`), and I6 and
        I10 on the step's plan: :func:`~..core.verify.check_order` reads the holds the
        walk made (:meth:`~..core.Plan.held`: preholds, nominations, their GPUs), never a
        "why", and models the prehold rule exactly."""
        return self._check_memory(present) + self._check_preemptions(now, step) + self._order

    def _check_memory(self, present: Mapping[str, tuple[GpuId, ...]]) -> list[str]:
        """I1 (committed <= capacity), I3 (load gate), I4 (memory of every process still
        running is committed; released exactly once: committed equals what is present)."""
        problems = []
        limit = self.scheduler.policy.max_concurrent_loads
        held = dict.fromkeys(self._capacity, 0)
        leases = self.scheduler.leases  # run after every step: kept to plain lookups
        for lease_id, gpus in present.items():
            lease = leases.get(lease_id)
            if lease is None or not lease.state.holds_memory:
                problems.append(f"I4: lease {lease_id} still runs but its memory was freed")
                continue
            vram_mb = lease.vram_mb
            for gpu_id in gpus:
                held[gpu_id] += vram_mb
        ledger = self.scheduler.ledger
        for gpu_id, capacity in self._capacity.items():
            committed = ledger.committed_mb(gpu_id)
            if committed > capacity:
                problems.append(f"I1: {gpu_id} committed {committed} > {capacity}")
            loading = ledger.loading(gpu_id)
            if loading > limit:
                problems.append(f"I3: {gpu_id} has {loading} loads at once")
            if committed != held[gpu_id]:
                problems.append(
                    f"I4: {gpu_id} committed {committed} MiB but processes hold {held[gpu_id]} MiB"
                )
        return problems

    def _check_preemptions(self, now: float, step: Step) -> list[str]:
        """I5: busy victims are preemptible, of strictly lower base priority, and taken
        for a request that has waited ``preempt_patience_s``; idle victims (their holder
        consented to reclaim) of lower or equal base priority, or idle ``idle_reclaim_s``,
        or taken for a request that has waited ``starvation_s``."""
        policy = self.scheduler.policy
        problems = []
        for lease_id, reason in step.revocations:
            if reason != "preempted":
                continue
            victim = self.scheduler.leases[lease_id]
            asked = self._asked.get(victim.preempted_for or "")
            if asked is None:
                problems.append(f"I5: {lease_id} preempted for an unknown request")
                continue
            preemptor, submitted = asked
            if victim.idle:  # deadlines written as the core does, to compare equal floats
                allowed = (
                    victim.base_priority <= preemptor
                    or victim.last_used_at + policy.idle_reclaim_s <= now
                    or submitted + policy.starvation_s <= now
                )
            else:
                allowed = (
                    victim.request.preemptible
                    and victim.base_priority < preemptor
                    and submitted + policy.preempt_patience_s <= now
                )
            if not allowed:
                problems.append(
                    f"I5: {lease_id} (priority {victim.base_priority}, idle={victim.idle}, "
                    f"preemptible={victim.request.preemptible}) preempted for priority "
                    f"{preemptor} after {now - submitted:g} s"
                )
        return problems


class OursStop(Ours):
    """Ours without keep-warm: the model stops when its run ends."""

    name: ClassVar[str] = "ours-stop"
    keeps_warm: ClassVar[bool] = False


class OursSleep(Ours):
    """Ours with keep-warm and a sleep tier (see the module docstring)."""

    name: ClassVar[str] = "ours-sleep"

    def __init__(
        self, cluster: Cluster, policy: Policy | None = None, tier: SleepTier | None = None
    ) -> None:
        super().__init__(cluster, policy)
        self.tier = tier or SleepTier()
        self._used: dict[GpuId, int] = {}

    def sleep(self, lease_ids: tuple[str, ...], vram_mb: int, now: float) -> None:
        own, *wakes = lease_ids
        for lease_id in wakes:  # a wake's grant is given back whole
            self.release(lease_id, now)
        self.scheduler.shrink(own, vram_mb, now)

    def wake(
        self, attempt: Attempt, asleep: str, gpus: tuple[GpuId, ...], vram_mb: int, now: float
    ) -> str | None:
        constraints = dataclasses.replace(
            attempt.item.constraints, gpu_ids=gpus, never_preempt=(asleep,)
        )
        return self._ask(attempt, vram_mb, constraints, now)

    def observe(self, gpu_id: GpuId, used_mb: Mapping[str, int]) -> None:
        used = sum(used_mb.values())
        self._used[gpu_id] = used
        self.scheduler.set_probe(gpu_id, GpuProbe(used_mb=used, lease_used_mb=dict(used_mb)))

    def check(self, now: float, step: Step, present: Mapping[str, tuple[GpuId, ...]]) -> list[str]:
        """The checks of ours, and I2: memory a process holds (the latest probe) is never
        counted free."""
        problems = super().check(now, step, present)
        for gpu_id, capacity in self._capacity.items():
            free = self.scheduler.figures(gpu_id).free_mb
            used = self._used.get(gpu_id, 0)
            if free > capacity - used:
                problems.append(f"I2: {gpu_id} shows {free} MiB free but processes hold {used}")
        return problems


class _Steps:
    """The simulator's :class:`~..core.Outcomes`: it follows grants and revocations (its
    leases have no TTL and its requests no max_wait_s, its workers never drain)."""

    __slots__ = ("grants", "revocations")

    def __init__(self) -> None:
        self.grants: list[tuple[str, tuple[GpuId, ...]]] = []
        self.revocations: list[tuple[str, str]] = []

    def granted(self, lease: Lease) -> None:
        self.grants.append((lease.id, lease.gpus))

    def revoked(self, leases: Sequence[Lease]) -> None:
        self.revocations += ((lease.id, lease.revoke_reason or "revoked") for lease in leases)

    def expired(self, lease: Lease) -> None:
        pass

    def timed_out(self, request: Request) -> None:
        pass

    def abandoned(self, request: Request) -> None:  # never: its askers are always there
        pass

    def unclaimed(self, lease: Lease) -> None:  # never: its grants are taken up as made
        pass

    def rejected(self, request: Request, reason: PendingReason) -> None:
        pass

    def loaded(self, lease: Lease) -> None:
        pass

    def drained(self, worker: str, previous: WorkerStatus, status: WorkerStatus) -> None:
        pass
