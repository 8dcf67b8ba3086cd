"""I10, work conservation: after a cycle, free memory never sits idle while a request that
fits it waits (unless the pause, a load gate, a nomination ahead of it or its own
constraints hold it back)."""

from __future__ import annotations

from gpu_arbiter.core import Constraints, Policy
from tests.core.support import GiB, gid, gpu, granted_ids, req, revoked_ids, scheduler

NEVER = float("inf")


def test_a_preemptor_is_granted_the_memory_its_own_preemption_freed() -> None:
    """Two batch jobs fill two 24 GiB GPUs; two normal 14 GiB requests each preempt one; an
    interactive request takes the memory the first frees and is still loading when the
    second job stops. The second preemptor is granted its GPU at once: it must not wait
    behind the first (same shape, blocked by the load and by the second's own hold) while
    24 GiB sit free."""
    sched = scheduler(gpu(0), gpu(1), policy=Policy(idle_reclaim_s=NEVER, starvation_s=NEVER))
    sched.submit(req("batch-1", 12 * GiB, priority="batch"), 0.0)
    sched.submit(req("batch-2", 24 * GiB, priority="batch"), 0.0)
    assert granted_ids(sched.decide(0.0)) == ["batch-1", "batch-2"]
    sched.ready("batch-1", 0.0)
    sched.ready("batch-2", 0.0)
    sched.submit(req("normal-1", 14 * GiB, priority="normal"), 4.0)
    assert revoked_ids(sched.decide(4.0)) == ["batch-1"]
    sched.release("batch-1", 6.0)  # it stopped
    sched.submit(req("chat", 10 * GiB, priority="interactive"), 6.0)
    assert granted_ids(sched.decide(6.0)) == ["chat"]  # beyond normal-1's 14 GiB: loading
    assert sched.lease("chat").gpus == (gid("w1:0"),)
    sched.submit(req("normal-2", 14 * GiB, priority="normal"), 8.0)
    assert revoked_ids(sched.decide(8.0)) == ["batch-2"]
    sched.release("batch-2", 10.0)  # it stopped: w1:1 is empty

    assert granted_ids(sched.decide(10.0)) == ["normal-2"]
    assert sched.lease("normal-2").gpus == (gid("w1:1"),)
    sched.ready("chat", 12.0)  # the load gate of w1:0 opens: normal-1 fits beside the chat
    assert granted_ids(sched.decide(12.0)) == ["normal-1"]


def _examined_to_grant_one(pending: int, priority: str) -> int:
    """Requests one cycle examines to grant a fitting request while ``pending`` requests
    pinned to a full GPU wait."""
    sched = scheduler(gpu(0, worker="full"), gpu(0, worker="room"))
    sched.submit(req("filler", 24 * GiB), 0.0)
    assert granted_ids(sched.decide(0.0)) == ["filler"]
    for i in range(pending):
        sched.submit(req(f"pinned-{i}", 8 * GiB, constraints=Constraints.build(worker="full")), 1.0)
    sched.decide(1.0)
    sched.submit(req("fits", 4 * GiB, priority=priority), 2.0)
    before = sched.counters["examined"]
    assert granted_ids(sched.decide(2.0)) == ["fits"]
    return sched.counters["examined"] - before


def test_a_cycle_examines_one_request_per_class_that_failed_whatever_the_queue_length() -> None:
    for priority in ("interactive", "normal"):  # the fitting request at the head, at the tail
        assert _examined_to_grant_one(10, priority) == _examined_to_grant_one(2000, priority) == 2
