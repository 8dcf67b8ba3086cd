"""The asyncio ``Arbiter``: leases held by tasks, preemption by cancellation, no polling."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest

from gpu_arbiter import (
    Arbiter,
    ArbiterEvent,
    ArbiterStopped,
    Conflict,
    Gpu,
    GpuId,
    GpuProbe,
    LeaseHandle,
    LeasePreempted,
    LeaseRevoked,
    LeaseState,
    Policy,
    Unschedulable,
    WaitTimeout,
)
from gpu_arbiter.engine import LoopClock

G0 = GpuId("local", 0)
CAPACITY = 24576
GUARD_S = 10.0  # a broken arbiter fails the test instead of hanging it


class Recorder:
    """A hook that keeps every event and lets a test await one."""

    def __init__(self) -> None:
        self.events: list[ArbiterEvent] = []
        self._waiting: list[
            tuple[Callable[[ArbiterEvent], bool], asyncio.Future[ArbiterEvent]]
        ] = []

    def __call__(self, event: ArbiterEvent) -> None:
        self.events.append(event)
        for match, future in list(self._waiting):
            if not future.done() and match(event):
                future.set_result(event)
                self._waiting.remove((match, future))

    async def wait(self, kind: str, lease_id: str | None = None) -> ArbiterEvent:
        def match(event: ArbiterEvent) -> bool:
            return event.kind == kind and (lease_id is None or event.lease_id == lease_id)

        for event in self.events:
            if match(event):
                return event
        future: asyncio.Future[ArbiterEvent] = asyncio.get_running_loop().create_future()
        self._waiting.append((match, future))
        async with asyncio.timeout(GUARD_S):
            return await future

    def kinds(self, lease_id: str) -> list[str]:
        return [e.kind for e in self.events if e.lease_id == lease_id]


class VirtualTimer:
    def __init__(self, at: float, callback: Callable[[], object]) -> None:
        self.at = at
        self.callback = callback
        self.cancelled = False

    def when(self) -> float:
        return self.at

    def cancel(self) -> None:
        self.cancelled = True


class VirtualClock:
    """The arbiter's time, moved by the test alone: ``advance`` runs each callback due on
    the way at its own time, in order, and lets every task run between them."""

    def __init__(self) -> None:
        self.time = 1000.0
        self.armed: list[VirtualTimer] = []  # every call_at, in order
        self._due: list[tuple[float, int, VirtualTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.time

    def call_at(self, when: float, callback: Callable[[], object]) -> VirtualTimer:
        timer = VirtualTimer(when, callback)
        self.armed.append(timer)
        heapq.heappush(self._due, (when, next(self._seq), timer))
        return timer

    def live(self) -> list[VirtualTimer]:
        return [t for t in self.armed if not t.cancelled and t.at > self.time]

    async def advance(self, seconds: float) -> None:
        target = self.time + seconds
        await settle()
        while self._due and self._due[0][0] <= target:
            at, _, timer = heapq.heappop(self._due)
            if not timer.cancelled:
                self.time = max(self.time, at)
                timer.callback()
                await settle()
        self.time = target
        await settle()


def _arbiter(*totals: int, policy: Policy | None = None, **kwargs: Any) -> Arbiter:
    gpus = [Gpu(index=i, total_mb=t) for i, t in enumerate(totals or (CAPACITY,))]
    return Arbiter(gpus=gpus, policy=policy, **kwargs)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def arbiter(recorder: Recorder) -> AsyncIterator[Arbiter]:
    async with _arbiter(hooks=[recorder]) as arb:
        yield arb


async def settle() -> None:
    """Lets every runnable task run up to its next real wait (no time passes)."""
    for _ in range(5):
        await asyncio.sleep(0)


def committed(arbiter: Arbiter, gpu: GpuId = G0) -> int:
    return next(f.committed_mb for f in arbiter.stats().gpus if f.gpu.id == gpu)


def pending_by_holder(arbiter: Arbiter) -> dict[str, Any]:
    return {info.request.holder: info for info in arbiter.pending()}


def held_by(arbiter: Arbiter, holder: str) -> list[Any]:
    return [lease for lease in arbiter.leases() if lease.request.holder == holder]


async def hold_until(
    arbiter: Arbiter, event: asyncio.Event, mb: int, holder: str, **kwargs: Any
) -> LeaseHandle:
    """Holds a lease (loaded) until ``event`` is set."""
    async with arbiter.lease(mb, holder=holder, **kwargs) as lease:
        await lease.ready()
        await event.wait()
        return lease


# ---------------------------------------------------------------- basic use


async def test_lease_block_grants_and_releases(arbiter: Arbiter, recorder: Recorder) -> None:
    async with arbiter.lease("6G", priority="interactive") as lease:
        assert lease.gpus == (G0,)
        assert lease.gpu_indexes == (0,)
        assert lease.vram_mb == 6144
        assert lease.state is LeaseState.LOADING
        assert committed(arbiter) == 6144
        await lease.ready()
        assert lease.state is LeaseState.ACTIVE
    assert lease.state is LeaseState.RELEASED
    assert committed(arbiter) == 0
    assert arbiter.leases() == []
    assert recorder.kinds(lease.id) == ["granted", "released"]


async def test_fifty_concurrent_leases_never_hold_more_than_fit() -> None:
    holding = peak = 0
    over: list[int] = []
    reasons: set[str] = set()

    async with _arbiter() as arbiter:

        async def work(i: int) -> None:
            nonlocal holding, peak
            async with arbiter.lease(6000, holder=f"w{i}") as lease:
                holding += 1
                peak = max(peak, holding)
                reasons.update(info.reason.code for info in arbiter.pending())
                if committed(arbiter) > CAPACITY:
                    over.append(committed(arbiter))
                await asyncio.sleep(0)
                await lease.ready()
                await asyncio.sleep(0.01)  # the work
                holding -= 1

        async with asyncio.timeout(GUARD_S):
            await asyncio.gather(*(work(i) for i in range(50)))
        assert arbiter.stats().counters["granted"] == 50

    assert peak == 4  # 4 x 6000 <= 24576 < 5 x 6000
    assert over == []
    assert "insufficient_vram" in reasons
    assert reasons <= {"load_in_progress", "insufficient_vram", "nominated_for"}


async def test_load_gate_lets_one_load_at_a_time(arbiter: Arbiter) -> None:
    first = await arbiter.acquire(4000)
    second = asyncio.create_task(arbiter.acquire(4000, holder="second"))
    await settle()
    assert not second.done()
    assert pending_by_holder(arbiter)["second"].reason.code == "load_in_progress"
    await first.ready()
    assert held_by(arbiter, "second")  # ready() granted the next one before returning
    await (await second).release()
    await first.release()


async def test_grants_possible_at_once_are_made_in_one_cycle() -> None:
    policy_arbiter = _arbiter(policy=Policy(max_concurrent_loads=8))
    async with policy_arbiter as arb:
        big = await arb.acquire(24000)
        waiters = [asyncio.create_task(arb.acquire(4000, holder=f"s{i}")) for i in range(6)]
        await settle()
        assert len(arb.pending()) == 6
        await big.release()
        assert len(arb.leases()) == 6  # all granted by the release itself
        assert arb.pending() == []
        for task in waiters:
            await (await task).release()


# ---------------------------------------------------------------- preemption


async def test_preempted_holder_keeps_its_memory_until_its_cleanup_ends(
    arbiter: Arbiter, recorder: Recorder
) -> None:
    order: list[str] = []
    cleanup_started = asyncio.Event()
    may_finish = asyncio.Event()

    async def victim() -> None:
        async with arbiter.lease(20000, priority="batch", holder="victim") as lease:
            await lease.ready()
            try:
                await asyncio.Event().wait()
            finally:
                cleanup_started.set()
                await may_finish.wait()  # a slow checkpoint
                order.append("cleanup done")

    victim_task = asyncio.create_task(victim())
    await recorder.wait("granted")
    preemptor = asyncio.create_task(arbiter.acquire(10000, priority="normal", holder="p"))
    async with asyncio.timeout(GUARD_S):
        await cleanup_started.wait()
    for _ in range(3):
        await settle()
        assert not preemptor.done()
        assert committed(arbiter) == 20000
        assert held_by(arbiter, "victim")[0].state is LeaseState.REVOKING
        assert pending_by_holder(arbiter)["p"].reason.code == "preempting"
    may_finish.set()
    with pytest.raises(LeasePreempted) as caught:
        async with asyncio.timeout(GUARD_S):
            await victim_task
    order.append("preemptor granted" if preemptor.done() else "preemptor waiting")
    handle = await preemptor
    assert order == ["cleanup done", "preemptor granted"]
    assert caught.value.reason == "preempted"
    assert isinstance(caught.value.__cause__, asyncio.CancelledError)
    victim_id = caught.value.lease_id
    assert recorder.kinds(victim_id) == ["granted", "revoked", "released"]
    kinds = [(e.kind, e.lease_id) for e in recorder.events]
    assert kinds.index(("released", victim_id)) < kinds.index(("granted", handle.id))
    assert committed(arbiter) == 10000
    await handle.release()


async def test_outside_cancellation_propagates_as_cancellation(arbiter: Arbiter) -> None:
    entered = asyncio.Event()

    async def holder() -> None:
        async with arbiter.lease(8000) as lease:
            await lease.ready()
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(holder())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert arbiter.leases() == []
    assert committed(arbiter) == 0


async def test_outside_cancellation_during_a_revocation_stays_a_cancellation(
    arbiter: Arbiter,
) -> None:
    entered = asyncio.Event()

    async def holder() -> None:
        async with arbiter.lease(8000, holder="h") as lease:
            await lease.ready()
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(holder())
    await entered.wait()
    arbiter.revoke(held_by(arbiter, "h")[0].id, "admin")
    task.cancel()  # a second, outside cancellation
    with pytest.raises(asyncio.CancelledError):
        await task
    assert arbiter.leases() == []


async def test_revoke_raises_lease_revoked_with_the_reason(arbiter: Arbiter) -> None:
    entered = asyncio.Event()

    async def holder() -> None:
        async with arbiter.lease(8000, holder="h"):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(holder())
    await entered.wait()
    arbiter.revoke(held_by(arbiter, "h")[0].id, "maintenance")
    with pytest.raises(LeaseRevoked) as caught:
        await task
    assert not isinstance(caught.value, LeasePreempted)
    assert caught.value.reason == "maintenance"
    assert arbiter.leases() == []


async def test_equal_priority_never_preempts(arbiter: Arbiter) -> None:
    holder = await arbiter.acquire(20000, priority="normal")
    await holder.ready()
    with pytest.raises(WaitTimeout):
        await arbiter.acquire(10000, priority="normal", max_wait_s=0.05)
    assert not holder.revoked
    assert holder.state is LeaseState.ACTIVE
    assert arbiter.stats().counters.get("preemptions", 0) == 0
    await holder.release()


async def test_equal_priority_waits_with_insufficient_vram(arbiter: Arbiter) -> None:
    holder = await arbiter.acquire(20000, priority="normal")
    await holder.ready()
    waiter = asyncio.create_task(arbiter.acquire(10000, priority="normal", holder="w"))
    await settle()
    reason = pending_by_holder(arbiter)["w"].reason
    assert reason.code == "insufficient_vram"
    assert reason.gpus[0].need_mb == 10000
    assert reason.gpus[0].committed_mb == 20000
    await holder.release()
    await (await waiter).release()


async def test_a_victim_revoked_before_it_woke_is_still_told(arbiter: Arbiter) -> None:
    blocker = await arbiter.acquire(20000, priority="critical")
    await blocker.ready()
    outcome: list[str] = []

    async def holder() -> None:
        try:
            async with arbiter.lease(20000, priority="batch", holder="h") as lease:
                await lease.ready()
                await asyncio.Event().wait()
        except LeaseRevoked as error:
            outcome.append(error.reason)

    task = asyncio.create_task(holder())
    await settle()
    await blocker.release()  # grants h; its task has not run yet
    (lease,) = held_by(arbiter, "h")
    arbiter.revoke(lease.id, "admin")  # ... and revokes it before it wakes
    async with asyncio.timeout(GUARD_S):
        await task
    assert outcome == ["admin"]
    assert arbiter.leases() == []


async def test_a_victim_that_ignores_its_interruption_keeps_its_memory_and_blocks_nothing_else(
    recorder: Recorder,
) -> None:
    async with _arbiter(CAPACITY, CAPACITY, hooks=[recorder]) as arbiter:
        interrupted = asyncio.Event()
        let_go = asyncio.Event()

        async def stubborn() -> None:
            async with arbiter.lease(20000, priority="batch", holder="stubborn") as lease:
                await lease.ready()
                while not let_go.is_set():
                    try:
                        await let_go.wait()
                    except asyncio.CancelledError:
                        interrupted.set()  # ... and carries on regardless

        stubborn_task = asyncio.create_task(stubborn())
        try:
            await recorder.wait("granted")
            other = await arbiter.acquire(20000, priority="normal", holder="other")
            await other.ready()
            assert {lease.gpus[0] for lease in arbiter.leases()} == {G0, GpuId("local", 1)}
            stubborn_gpu = held_by(arbiter, "stubborn")[0].gpus[0]

            preemptor = asyncio.create_task(arbiter.acquire(10000, priority="normal", holder="p"))
            await settle()
            async with asyncio.timeout(GUARD_S):
                await interrupted.wait()
            revoked = [lease for lease in arbiter.leases() if lease.state is LeaseState.REVOKING]
            assert [lease.request.holder for lease in revoked] == ["stubborn"]
            assert committed(arbiter, stubborn_gpu) == 20000
            assert not preemptor.done()

            # the rest of the arbiter goes on meanwhile: grants, releases, revocations
            small = await arbiter.acquire(4000, priority="batch")
            await small.ready()
            await small.release()
            arbiter.revoke(other.id, "admin")
            assert other.revoked
            await other.release()
            # the preemptor may now take the other GPU: it no longer needs the stubborn one
            granted = await asyncio.wait_for(preemptor, GUARD_S)
            assert committed(arbiter, stubborn_gpu) == 20000
            let_go.set()
            await stubborn_task
            assert committed(arbiter, stubborn_gpu) == 0
            await granted.release()
        finally:
            let_go.set()  # a stubborn task would outlive the test


async def test_idle_lease_is_reclaimed_by_equal_priority(arbiter: Arbiter) -> None:
    entered = asyncio.Event()
    handles: list[LeaseHandle] = []

    async def warm() -> None:
        async with arbiter.lease(20000, priority="normal", holder="warm") as lease:
            handles.append(lease)
            await lease.ready()
            await lease.idle()
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(warm())
    await entered.wait()
    got = await asyncio.wait_for(arbiter.acquire(10000, priority="normal"), GUARD_S)
    with pytest.raises(LeasePreempted):
        await task
    assert handles[0].revoke_reason == "preempted"
    await got.release()


async def test_busy_again_is_not_reclaimed_by_equal_priority(arbiter: Arbiter) -> None:
    warm = await arbiter.acquire(20000, priority="normal")
    await warm.ready()
    await warm.idle()
    await warm.busy()
    with pytest.raises(WaitTimeout):
        await arbiter.acquire(10000, priority="normal", max_wait_s=0.05)
    assert not warm.revoked
    await warm.release()


async def test_higher_priority_preempts_a_busy_acquired_lease(arbiter: Arbiter) -> None:
    batch = await arbiter.acquire(20000, priority="batch")
    await batch.ready()
    waiter = asyncio.create_task(arbiter.acquire(10000, priority="interactive"))
    assert await asyncio.wait_for(batch.wait_revoked(), GUARD_S) == "preempted"
    assert not waiter.done()  # an acquired lease is not cancelled: it must release
    await batch.release()
    await (await waiter).release()


async def test_an_idle_lease_idle_long_enough_is_reclaimed_by_lower_priority() -> None:
    """Idle memory is a cache: once idle ``idle_reclaim_s``, not a moment before, the
    engine's own timer lets a batch request reclaim an idle interactive lease (no other
    event comes)."""
    clock = VirtualClock()
    policy = Policy(idle_reclaim_s=60.0, starvation_s=float("inf"))
    async with _arbiter(policy=policy, clock=clock) as arbiter:
        warm = await arbiter.acquire(20000, priority="interactive", ttl_s=3600)
        await warm.ready()
        await warm.idle()
        waiter = asyncio.create_task(arbiter.acquire(10000, priority="batch", ttl_s=3600))
        await clock.advance(59.5)
        assert not warm.revoked
        await clock.advance(0.5)
        assert warm.revoke_reason == "preempted"
        await warm.release()
        await (await asyncio.wait_for(waiter, GUARD_S)).release()


async def test_busy_work_is_preempted_only_after_preempt_patience_s() -> None:
    clock = VirtualClock()
    async with _arbiter(policy=Policy(preempt_patience_s=5.0), clock=clock) as arbiter:
        batch = await arbiter.acquire(20000, priority="batch", ttl_s=3600)
        await batch.ready()
        waiter = asyncio.create_task(arbiter.acquire(10000, priority="interactive"))
        await clock.advance(4.5)
        assert not batch.revoked
        await clock.advance(0.5)
        assert batch.revoke_reason == "preempted"
        await batch.release()
        await (await asyncio.wait_for(waiter, GUARD_S)).release()


# ---------------------------------------------------------------- no starvation


async def test_a_large_request_is_granted_while_small_ones_keep_coming(
    arbiter: Arbiter, recorder: Recorder
) -> None:
    done: dict[str, asyncio.Event] = {}
    tasks: list[asyncio.Task[LeaseHandle]] = []

    def small(name: str) -> None:
        done[name] = asyncio.Event()
        tasks.append(asyncio.create_task(hold_until(arbiter, done[name], 2000, name)))

    for i in range(10):  # the GPU is busy with small work: 20000 of 24576 MiB
        small(f"s{i}")
        await settle()
    assert committed(arbiter) == 20000
    large = asyncio.create_task(arbiter.acquire(20000, holder="large"))
    await settle()
    assert pending_by_holder(arbiter)["large"].reason.code == "insufficient_vram"
    # small requests keep coming, one for each small one that ends: each would fit
    arrivals = 0
    for i in range(10):
        done[f"s{i}"].set()
        small(f"new{i}")
        arrivals += 1
        await settle()
        if large.done():
            break
        info = pending_by_holder(arbiter)[f"new{i}"]
        assert info.reason.code == "nominated_for"
        assert info.reason.blocked_by == pending_by_holder(arbiter)["large"].request.id
    handle = await asyncio.wait_for(large, GUARD_S)
    assert arrivals == 8  # granted once 8 small ones had ended: 24576 - 2 x 2000 >= 20000
    assert not any(held_by(arbiter, f"new{i}") for i in range(arrivals))
    await handle.ready()
    await handle.release()
    for event in done.values():
        event.set()
    await asyncio.wait_for(asyncio.gather(*tasks), GUARD_S)
    assert committed(arbiter) == 0


async def test_small_requests_behind_a_large_one_say_why(arbiter: Arbiter) -> None:
    running = await arbiter.acquire(10000, holder="running")
    await running.ready()
    large = asyncio.create_task(arbiter.acquire(20000, holder="large"))
    await settle()
    small = asyncio.create_task(arbiter.acquire(2000, holder="small"))
    await settle()
    pending = pending_by_holder(arbiter)
    assert pending["large"].reason.code == "insufficient_vram"
    assert pending["large"].position == 1
    assert pending["small"].reason.code == "nominated_for"
    assert pending["small"].reason.blocked_by == pending["large"].request.id
    assert pending["small"].position == 2
    assert not small.done()
    await running.release()
    large_handle = await large
    await large_handle.ready()
    await (await small).release()
    await large_handle.release()


# ---------------------------------------------------------------- waiting ends


async def test_max_wait_s_ends_in_wait_timeout_and_leaves_nothing(recorder: Recorder) -> None:
    clock = VirtualClock()
    async with _arbiter(hooks=[recorder], clock=clock) as arbiter:
        holder = await arbiter.acquire(20000, ttl_s=3600)

        async def wait_for_a_lease() -> None:
            async with arbiter.lease(10000, max_wait_s=2.0):
                pytest.fail("never granted")

        waiter = asyncio.create_task(wait_for_a_lease())
        await clock.advance(1.5)
        assert not waiter.done()
        await clock.advance(0.5)
        with pytest.raises(WaitTimeout) as caught:
            await waiter
        assert isinstance(caught.value, TimeoutError)
        assert arbiter.pending() == []
        assert any(e.kind == "timed_out" for e in recorder.events)
        await holder.release()
        assert [lease.id for lease in arbiter.leases()] == []


async def test_impossible_request_is_unschedulable_with_its_reason(arbiter: Arbiter) -> None:
    with pytest.raises(Unschedulable) as too_large:
        await arbiter.acquire("30G")
    assert too_large.value.reason.code == "too_large"
    with pytest.raises(Unschedulable) as no_match:
        async with arbiter.lease(1000, gpu_arch=["sm_90"]):
            pytest.fail("never granted")
    assert no_match.value.reason.code == "no_matching_gpu"
    assert arbiter.pending() == []


async def test_waiting_callers_get_arbiter_stopped() -> None:
    arbiter = _arbiter()
    await arbiter.start()
    holder = await arbiter.acquire(20000)
    waiting_block = asyncio.create_task(hold_until(arbiter, asyncio.Event(), 10000, "block"))
    waiting_acquire = asyncio.create_task(arbiter.acquire(10000))
    await settle()
    assert len(arbiter.pending()) == 2
    await arbiter.stop()
    for task in (waiting_block, waiting_acquire):
        with pytest.raises(ArbiterStopped):
            await asyncio.wait_for(task, GUARD_S)
    assert arbiter.pending() == []
    with pytest.raises(ArbiterStopped):
        await arbiter.acquire(1000)
    await holder.release()  # a holder may still release after the stop
    assert arbiter.leases() == []


async def test_leaving_the_arbiter_block_stops_waiters() -> None:
    waiter: asyncio.Task[LeaseHandle] | None = None
    async with _arbiter() as arbiter:
        await arbiter.acquire(20000)
        waiter = asyncio.create_task(arbiter.acquire(10000))
        await settle()
    with pytest.raises(ArbiterStopped):
        await waiter


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_a_waiter_that_gives_up_is_never_granted_afterwards(
    arbiter: Arbiter, recorder: Recorder, how: str
) -> None:
    holder = await arbiter.acquire(20000)
    if how == "cancel":
        task = asyncio.create_task(arbiter.acquire(10000, holder="quitter"))
        await settle()
        assert "quitter" in pending_by_holder(arbiter)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                await arbiter.acquire(10000, holder="quitter")
    assert arbiter.pending() == []
    await holder.release()
    await settle()
    assert arbiter.leases() == []
    assert committed(arbiter) == 0
    granted = [e.lease_id for e in recorder.events if e.kind == "granted"]
    assert granted == [holder.id]


async def test_a_waiter_cancelled_after_its_grant_but_before_waking_leaves_nothing(
    arbiter: Arbiter,
) -> None:
    holder = await arbiter.acquire(20000)
    task = asyncio.create_task(arbiter.acquire(10000, holder="late"))
    await settle()
    await holder.release()  # grants "late"; its task has not run yet
    assert held_by(arbiter, "late")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert arbiter.leases() == []
    assert committed(arbiter) == 0


async def test_without_gpus_requests_wait_for_workers() -> None:
    async with Arbiter() as arbiter:
        with pytest.raises(WaitTimeout):
            await arbiter.acquire(1000, max_wait_s=0.05, holder="early")
        task = asyncio.create_task(arbiter.acquire(1000, holder="early"))
        await settle()
        assert pending_by_holder(arbiter)["early"].reason.code == "no_workers"
    with pytest.raises(ArbiterStopped):
        await task


# ---------------------------------------------------------------- pause


async def test_while_paused_nothing_is_granted_and_resume_grants_at_once(
    arbiter: Arbiter, recorder: Recorder
) -> None:
    arbiter.pause()
    assert arbiter.stats().paused
    task = asyncio.create_task(arbiter.acquire(1000, holder="fits"))
    await settle()
    assert not task.done()
    (info,) = arbiter.pending()
    assert info.reason.code == "paused"
    assert arbiter.leases() == []
    arbiter.resume()
    assert len(arbiter.leases()) == 1  # granted by resume() itself
    assert [e.kind for e in recorder.events][:3] == ["paused", "resumed", "granted"]
    await (await task).release()


# ---------------------------------------------------------------- no polling


async def test_nothing_runs_while_nothing_changes() -> None:
    clock = VirtualClock()
    async with _arbiter(clock=clock) as arbiter:
        running = await arbiter.acquire(20000, ttl_s=3600)
        await running.ready()
        waiters = [asyncio.create_task(arbiter.acquire(8000, ttl_s=3600)) for _ in range(200)]
        await settle()
        assert len(arbiter.pending()) == 200
        # the one timer armed is the lease's TTL, an hour away
        assert [timer.when() for timer in clock.live()] == [clock.now() + 3600]
        armed_before = len(clock.armed)
        examined = arbiter.stats().counters["examined"]
        await clock.advance(3000)  # nothing changes for 50 minutes
        assert len(clock.armed) == armed_before
        assert arbiter.stats().counters["examined"] == examined  # so no cycle ran
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        await running.release()


async def test_acquires_and_releases_in_one_turn_arm_no_timer() -> None:
    """The timer follows the core's next deadline once per turn of the event loop: a turn
    that acquires and releases leases, each with its TTL, ends with nothing due, and has
    armed and cancelled nothing on the way."""
    clock = VirtualClock()
    async with _arbiter(clock=clock) as arbiter:
        await settle()
        for _ in range(100):
            await (await arbiter.acquire(1000, ttl_s=30)).release()
        await settle()
        assert clock.armed == []
        lease = await arbiter.acquire(1000, ttl_s=30)
        await settle()
        assert [timer.when() for timer in clock.live()] == [clock.now() + 30]
        await lease.release()
        await settle()
        assert clock.live() == []


async def test_a_ttl_lapses_even_when_its_timer_rings_a_moment_early() -> None:
    """The loop may run a timer just before its time: the cycle then finds nothing due, and
    the arbiter must arm a timer for the same deadline again rather than wait for nothing."""

    class Early(VirtualClock):
        def call_at(self, when: float, callback: Callable[[], object]) -> VirtualTimer:
            def early() -> None:
                self.time -= 1e-6  # rung a microsecond before ``when``, once
                callback()

            return super().call_at(when, early if len(self.armed) == 0 else callback)

    clock = Early()
    async with _arbiter(clock=clock) as arbiter:
        await arbiter.acquire(1000, ttl_s=5.0)
        await clock.advance(5.0)
        await clock.advance(1.0)
        assert arbiter.leases() == []  # expired


async def test_the_default_clock_is_the_running_loops() -> None:
    loop = asyncio.get_running_loop()
    async with _arbiter() as arbiter:
        before = loop.time()
        lease = await arbiter.acquire(1000, ttl_s=5.0)
        (held,) = arbiter.leases()
        assert before <= held.granted_at <= loop.time()
        assert held.expires_at == held.granted_at + 5.0
        await lease.release()


async def test_a_clock_derived_from_the_loop_clock_is_the_one_asked() -> None:
    class Ahead(LoopClock):
        def now(self) -> float:
            return super().now() + 1000.0

    loop = asyncio.get_running_loop()
    async with _arbiter(clock=Ahead()) as arbiter:
        lease = await arbiter.acquire(1000, ttl_s=5.0)
        (held,) = arbiter.leases()
        assert held.granted_at >= loop.time() + 999.0
        await lease.release()


async def test_no_timer_at_all_when_nothing_is_due() -> None:
    clock = VirtualClock()
    async with _arbiter(clock=clock) as arbiter:
        release = asyncio.Event()
        holder = asyncio.create_task(hold_until(arbiter, release, 20000, "holder"))
        await settle()
        waiters = [
            asyncio.create_task(hold_until(arbiter, release, 8000, f"w{i}")) for i in range(50)
        ]
        await settle()
        assert len(arbiter.pending()) == 50
        assert clock.live() == []  # block leases have no TTL, loads are done, no max_wait_s
        own_tasks = [
            t for t in asyncio.all_tasks() if "gpu_arbiter" in t.get_coro().cr_code.co_filename
        ]
        assert own_tasks == []  # nor a task of its own that could poll
        release.set()
        await asyncio.wait_for(asyncio.gather(holder, *waiters), GUARD_S)


# ---------------------------------------------------------------- hooks and probes


async def test_a_failing_hook_neither_kills_the_arbiter_nor_loses_a_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[str] = []

    def broken(event: ArbiterEvent) -> None:
        raise RuntimeError(f"hook failed on {event.kind}")

    async with _arbiter(hooks=[broken, lambda e: seen.append(e.kind)]) as arbiter:
        first = await arbiter.acquire(20000)
        waiter = asyncio.create_task(arbiter.acquire(10000))
        await settle()
        await first.release()
        second = await asyncio.wait_for(waiter, GUARD_S)
        await second.release()
    assert seen == ["granted", "released", "granted", "released"]
    assert "hook" in caplog.text


async def test_a_failing_probe_marks_gpus_stale_and_recovers() -> None:
    """The probe runs every ``probe_interval_s`` of the arbiter's clock."""
    calls = 0
    healthy = False

    async def probe() -> Mapping[GpuId, GpuProbe | None]:
        nonlocal calls
        calls += 1
        if not healthy:
            raise OSError("nvml is gone")
        return {G0: GpuProbe(used_mb=0)}

    clock = VirtualClock()
    async with _arbiter(probe=probe, probe_interval_s=2.0, clock=clock) as arbiter:
        waiter = asyncio.create_task(arbiter.acquire(1000, holder="w"))
        await settle()
        assert calls == 1
        assert not waiter.done()
        assert pending_by_holder(arbiter)["w"].reason.gpus[0].code == "probe_stale"
        healthy = True
        await clock.advance(1.5)
        assert (calls, waiter.done()) == (1, False)
        await clock.advance(0.5)
        assert calls == 2
        handle = await asyncio.wait_for(waiter, GUARD_S)
        await handle.release()


async def test_probed_memory_used_by_strangers_is_not_granted() -> None:
    async def probe() -> Mapping[GpuId, GpuProbe | None]:
        return {G0: GpuProbe(used_mb=20000)}

    clock = VirtualClock()
    async with _arbiter(probe=probe, probe_interval_s=3600, clock=clock) as arbiter:
        await settle()
        waiter = asyncio.create_task(arbiter.acquire(8000, max_wait_s=1.0))
        await clock.advance(1.0)
        with pytest.raises(WaitTimeout):
            await waiter
        small = await arbiter.acquire(4000)
        await small.release()
        arbiter.set_probe(G0, GpuProbe(used_mb=0))
        big = await asyncio.wait_for(arbiter.acquire(8000), GUARD_S)
        await big.release()


# ---------------------------------------------------------------- acquire, renew, TTL


async def test_an_acquired_lease_lapses_without_renewal(recorder: Recorder) -> None:
    clock = VirtualClock()
    async with _arbiter(hooks=[recorder], clock=clock) as arbiter:
        lease = await arbiter.acquire(20000, ttl_s=5.0)
        waiter = asyncio.create_task(arbiter.acquire(10000))
        await clock.advance(4.5)
        assert not lease.revoked
        await clock.advance(0.5)
        assert lease.revoke_reason == "expired"
        handle = await asyncio.wait_for(waiter, GUARD_S)
        assert lease.state is LeaseState.RELEASED  # gone from the arbiter
        assert recorder.kinds(lease.id) == ["granted", "expired"]
        await lease.release()  # releasing an ended lease does nothing
        assert [x.id for x in arbiter.leases()] == [handle.id]
        await handle.release()


async def test_renewal_keeps_an_acquired_lease() -> None:
    clock = VirtualClock()
    async with _arbiter(clock=clock) as arbiter:
        lease = await arbiter.acquire(20000, ttl_s=5.0)
        await lease.ready()
        for _ in range(8):  # held 36 s in all, longer than its TTL
            await clock.advance(4.5)
            await lease.renew()
        assert not lease.revoked
        assert lease.state is LeaseState.ACTIVE
        await lease.renew(ttl_s=2.0)
        await clock.advance(1.5)
        assert not lease.revoked
        await clock.advance(0.5)
        assert lease.revoke_reason == "expired"
        assert arbiter.leases() == []


async def test_release_is_idempotent_and_stats_do_not_disturb(arbiter: Arbiter) -> None:
    lease = await arbiter.acquire(4000, priority="batch")
    blocked = asyncio.create_task(arbiter.acquire(24000, priority="batch", holder="big"))
    await settle()
    before = [(i.position, i.request.id) for i in arbiter.pending()]
    stats = arbiter.stats()
    assert stats.pending == 1
    assert stats.pending_by_priority == {100: 1}
    assert stats.leases_by_state == {"loading": 1}
    assert [(i.position, i.request.id) for i in arbiter.pending()] == before
    await lease.release()
    await lease.release()
    await arbiter.release("no-such-lease")
    await (await blocked).release()


# ---------------------------------------------------------------- holders that ignore revocation


async def test_a_victim_that_swallows_its_cancellation_is_made_visible(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """It cannot be killed, so its preemptor waits; once the grace is over, the preemptor's
    reason names it and how long it has ignored its revocation, a warning is logged, an
    event is emitted and the stats show it."""
    clock = VirtualClock()
    async with _arbiter(policy=Policy(grace_s=10.0), hooks=[recorder], clock=clock) as arbiter:
        let_go = asyncio.Event()

        async def stubborn() -> None:
            async with arbiter.lease(20000, priority="batch", holder="stubborn") as lease:
                await lease.ready()
                while not let_go.is_set():
                    with contextlib.suppress(asyncio.CancelledError):  # swallowed
                        await let_go.wait()

        stubborn_task = asyncio.create_task(stubborn())
        try:
            await recorder.wait("granted")
            (victim,) = held_by(arbiter, "stubborn")
            preemptor = asyncio.create_task(arbiter.acquire(16000, priority="interactive"))
            await recorder.wait("revoked", victim.id)
            await clock.advance(9.5)
            assert arbiter.stats().overdue_revocations == {}
            assert not any(e.kind == "revocation_ignored" for e in recorder.events)
            with caplog.at_level(logging.WARNING, logger="gpu_arbiter.engine"):
                await clock.advance(0.5)
            event = await recorder.wait("revocation_ignored", victim.id)
            assert event.detail is not None and event.detail["ignored_s"] == 10.0
            assert f"lease {victim.id} (holder 'stubborn') was revoked (preempted)" in caplog.text
            await clock.advance(1.0)
            (info,) = arbiter.pending()
            assert info.reason.code == "preempting"
            assert info.reason.blocked_by == victim.id
            assert (
                f"lease {victim.id} (holder 'stubborn') has ignored its revocation for"
                in info.reason.message
            )
            stats = arbiter.stats()
            assert stats.overdue_revocations == {victim.id: 11.0}
            assert stats.counters["revocations_ignored"] == 1
            assert not preemptor.done()
            let_go.set()
            await stubborn_task
            granted = await asyncio.wait_for(preemptor, GUARD_S)
            assert arbiter.stats().overdue_revocations == {}
            await granted.release()
        finally:
            let_go.set()


async def test_a_revoked_acquired_lease_that_keeps_renewing_lapses_after_grace_plus_ttl(
    recorder: Recorder,
) -> None:
    clock = VirtualClock()
    async with _arbiter(policy=Policy(grace_s=3.0), hooks=[recorder], clock=clock) as arbiter:
        victim = await arbiter.acquire(20000, priority="batch", ttl_s=5.0)
        preemptor = asyncio.create_task(arbiter.acquire(16000, priority="interactive"))
        await recorder.wait("revoked", victim.id)
        renewals = []
        for _ in range(7):  # renewed each second: within its grace, then refused
            await clock.advance(1.0)
            try:
                await victim.renew()
                renewals.append("renewed")
            except Conflict:
                renewals.append("refused")
        assert renewals == ["renewed"] * 3 + ["refused"] * 4
        assert recorder.kinds(victim.id) == ["granted", "revoked", "revocation_ignored"]
        assert not preemptor.done()
        await clock.advance(1.0)  # grace + TTL after its revocation
        assert recorder.kinds(victim.id)[-1] == "expired"
        await (await asyncio.wait_for(preemptor, GUARD_S)).release()


async def test_a_shrunk_lease_gives_its_memory_back_once_the_probe_shows_it_free(
    arbiter: Arbiter,
) -> None:
    arbiter.set_probe(G0, GpuProbe(used_mb=0))
    sleeper = await arbiter.acquire(20000, holder="sleeper")
    await sleeper.ready()
    arbiter.set_probe(G0, GpuProbe(used_mb=20000))
    await sleeper.shrink("1G")
    assert (sleeper.vram_mb, committed(arbiter)) == (1024, 1024)
    waiter = asyncio.create_task(arbiter.acquire(16000, holder="w"))
    await settle()
    assert pending_by_holder(arbiter)["w"].reason.code == "insufficient_vram"
    arbiter.set_probe(G0, GpuProbe(used_mb=1024))  # the sleeping server freed its memory
    woken = await asyncio.wait_for(waiter, GUARD_S)
    assert woken.gpus == (G0,)
    with pytest.raises(Conflict, match="grows only through a new grant"):
        await sleeper.shrink(2048)
    await woken.release()
    await sleeper.release()
