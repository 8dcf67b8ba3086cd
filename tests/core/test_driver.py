"""Every driver receives a cycle's decisions the same way: one method per kind, causes
before their effects."""

from __future__ import annotations

from collections.abc import Sequence

from gpu_arbiter.core import (
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
