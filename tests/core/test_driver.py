"""Every driver receives a cycle's decisions the same way: one method per kind, causes
before their effects."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from gpu_arbiter.core import (
    Alarm,
    Constraints,
    Lease,
    PendingReason,
    Policy,
    Request,
    WorkerStatus,
    hand_over,
)

from .support import GiB, gpu, req, scheduler

W1, W2 = Constraints(worker="w1"), Constraints(worker="w2")


class Seen:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def expired(self, lease: Lease) -> None:
        self.calls.append(("expired", lease.id))

    def timed_out(self, request: Request) -> None:
        self.calls.append(("timed_out", request.id))

    def rejected(self, request: Request, reason: PendingReason) -> None:
        self.calls.append(("rejected", f"{request.id}:{reason.code}"))

    def loaded(self, lease: Lease) -> None:
        self.calls.append(("loaded", lease.id))

    def drained(self, worker: str, previous: WorkerStatus, status: WorkerStatus) -> None:
        self.calls.append(("drained", f"{worker}:{previous}->{status}"))

    def revoked(self, leases: Sequence[Lease]) -> None:
        self.calls.append(("revoked", ",".join(lease.id for lease in leases)))

    def granted(self, lease: Lease) -> None:
        self.calls.append(("granted", lease.id))


def test_one_cycle_hands_over_ends_then_drains_then_revocations_then_grants() -> None:
    sched = scheduler(gpu(worker="w1"), gpu(worker="w2"), policy=Policy(max_concurrent_loads=2))
    sched.submit(req("short", 20 * GiB, ttl_s=5.0, constraints=W1), 0.0)
    sched.submit(req("slow", 2 * GiB, constraints=W2, load_timeout_s=5.0), 0.0)
    sched.submit(req("batch", 20 * GiB, priority="batch", constraints=W2), 0.0)
    sched.decide(0.0)
    sched.submit(req("impatient", 22 * GiB, max_wait_s=5.0), 0.0)  # no room in time
    sched.submit(req("chat", 20 * GiB, priority="interactive", constraints=W2), 0.0)
    sched.submit(req("next", 20 * GiB, constraints=W1), 0.0)
    sched.drain("w1", 0.0)  # graceful: "short" finishes, then w1 is drained
    seen = Seen()
    hand_over(sched.decide(5.0), seen)
    kinds = [kind for kind, _ in seen.calls]
    assert kinds == ["expired", "timed_out", "loaded", "drained", "revoked"], seen.calls
    assert seen.calls[0] == ("expired", "short")
    assert ("drained", "w1:draining->drained") in seen.calls
    assert ("revoked", "batch") in seen.calls
    sched.release("batch", 6.0)
    sched.ready("slow", 6.0)
    seen = Seen()
    hand_over(sched.decide(6.0), seen)
    assert seen.calls == [("granted", "chat")]


class Armed:
    """A timer of :class:`Clock`: its time, and whether it was cancelled."""

    def __init__(self, at: float, callback: Callable[[], object]) -> None:
        self.at = at
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Clock:
    """Time moved by the test: ``advance`` rings each live timer due on the way."""

    def __init__(self) -> None:
        self.time = 0.0
        self.armed: list[Armed] = []

    def now(self) -> float:
        return self.time

    def call_at(self, when: float, callback: Callable[[], object]) -> Armed:
        self.armed.append(timer := Armed(when, callback))
        return timer

    def live(self) -> list[float]:
        return [t.at for t in self.armed if not t.cancelled]

    def advance(self, to: float) -> None:
        self.time = to
        for timer in [t for t in self.armed if not t.cancelled and t.at <= to]:
            self.armed.remove(timer)
            timer.callback()


def test_an_alarm_rings_once_at_its_deadline_and_is_disarmed_by_ringing() -> None:
    clock, rang = Clock(), []
    alarm = Alarm(clock, lambda: rang.append(clock.now()))
    alarm.set(5.0)
    assert (alarm.at, clock.live()) == (5.0, [5.0])
    clock.advance(4.9)
    assert rang == []
    clock.advance(5.0)
    assert (rang, alarm.at, clock.live()) == ([5.0], None, [])
    clock.advance(100.0)
    assert rang == [5.0]


def test_setting_the_deadline_it_is_armed_for_arms_nothing_more() -> None:
    clock = Clock()
    alarm = Alarm(clock, lambda: None)
    for _ in range(3):
        alarm.set(5.0)
    assert len(clock.armed) == 1


def test_a_moved_deadline_cancels_the_earlier_timer() -> None:
    clock, rang = Clock(), []
    alarm = Alarm(clock, lambda: rang.append(clock.now()))
    alarm.set(5.0)
    alarm.set(7.0)
    alarm.set(3.0)
    assert (alarm.at, clock.live()) == (3.0, [3.0])
    clock.advance(10.0)
    assert rang == [10.0]  # the one live timer, once


def test_no_deadline_or_an_infinite_one_disarms_it() -> None:
    clock = Clock()
    alarm = Alarm(clock, lambda: None)
    for never in (None, math.inf):
        alarm.set(5.0)
        alarm.set(never)
        assert (alarm.at, clock.live()) == (None, [])
    alarm.cancel()  # disarmed already: nothing to do
    assert clock.live() == []


def test_a_timer_that_rang_early_is_armed_again_for_the_same_deadline() -> None:
    """A loop may run a timer a moment before its time (asyncio runs those within its
    clock's resolution): the driver's cycle then finds nothing due and sets the same
    deadline again, which must arm a new timer, not be taken for the one that rang."""
    clock, rang = Clock(), []
    alarm = Alarm(clock, lambda: rang.append(clock.now()))
    alarm.set(5.0)
    clock.armed.pop().callback()  # early: time is still 0
    alarm.set(5.0)
    assert clock.live() == [5.0]
    clock.advance(5.0)
    assert rang == [0.0, 5.0]
