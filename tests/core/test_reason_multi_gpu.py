"""A multi-GPU request is "queued" only when one worker has enough GPUs with room; a
preemptor's reason names what stands in its way, on the right GPU, when a request of
higher base priority takes or holds memory its preemption frees (I6); the request ahead
named holding a GPU is one whose hold stands at the turn."""

from __future__ import annotations

from gpu_arbiter.core import Constraints, Gpu, Request, Scheduler, Worker

from .support import GiB, gid, gpu, grant_now, granted_ids, req, revoked_ids, scheduler


def test_one_free_gpu_is_not_enough_for_a_two_gpu_request() -> None:
    scheduler = Scheduler()
    scheduler.put_worker(Worker("w1"), [Gpu(index=i, total_mb=24576, worker="w1") for i in (0, 1)])
    scheduler.submit(Request.build("small", vram_mb="8G"), 0.0)
    scheduler.decide(0.0)
    scheduler.ready("small", 1.0)
    scheduler.submit(Request.build("pair", vram_mb="20G", gpus=2), 1.0)
    assert not scheduler.decide(1.0).grants  # w1:0 has 16 GiB left, w1:1 24 GiB
    reason = scheduler.explain("pair", 1.0)
    assert reason.code == "insufficient_vram"
    assert "need 20.0 GiB" in reason.message
    scheduler.release("small", 2.0)
    assert [lease.id for lease in scheduler.decide(2.0).grants] == ["pair"]


# A 2-GPU preemptor of normal priority preempts two batch leases on w1; while they stop,
# an interactive request arrives and takes (or holds) part of the memory the preemption
# frees, as I6 allows a request of higher base priority: the preemptor's reason names what
# stands in its way then, the interactive request or its lease, on the GPU it holds.


def _preempting_pair(batch_mb: int, side_mb: int = 0) -> Scheduler:
    """w1 of two 24 GiB GPUs, a batch lease of ``batch_mb`` on each (busy since 0) and, with
    ``side_mb``, a busy normal lease of that size on w1:1; 'pair' (normal, 2 x 20 GiB)
    preempted both batch leases at 1."""
    sched = scheduler(gpu(0), gpu(1))
    for i in (0, 1):
        on = Constraints.build(gpu_ids=[f"w1:{i}"])
        grant_now(sched, req(f"batch{i}", batch_mb, priority="batch", constraints=on), 0.0)
    if side_mb:
        on = Constraints.build(gpu_ids=["w1:1"])
        grant_now(sched, req("side", side_mb, priority="normal", constraints=on), 0.0)
    sched.submit(req("pair", 20 * GiB, gpus=2, priority="normal", holder="pair"), 1.0)
    assert sorted(revoked_ids(sched.decide(1.0))) == ["batch0", "batch1"]
    reason = sched.explain("pair", 1.0)
    assert reason.code == "preempting"  # its own victims stand in its way, and only they
    assert reason.blocker is not None and reason.blocker.id in ("batch0", "batch1")
    return sched


def test_a_preemptor_names_the_lease_that_took_memory_its_preemption_frees() -> None:
    """The interactive request fits beside a victim at once (12 GiB free there) and is
    granted: once the victims stop, that GPU has 14 GiB for 'pair', not 20. Its reason
    names the interactive lease on that GPU, never only its victims."""
    sched = _preempting_pair(12 * GiB)
    sched.submit(req("chat", 10 * GiB, priority="interactive", holder="chat"), 2.0)
    assert granted_ids(sched.decide(2.0)) == ["chat"]
    sched.ready("chat", 2.0)
    (chat_gpu,) = sched.leases["chat"].gpus
    reason = sched.explain("pair", 2.0)
    assert reason.code == "insufficient_vram"
    assert reason.blocked_by == "chat"
    assert reason.blocker is not None
    assert (reason.blocker.id, reason.blocker.gpus) == ("chat", (chat_gpu,))
    assert (reason.blocker.state, reason.blocker.rule) == ("busy", "not_preemptible")
    assert f"busy lease chat (holder 'chat', interactive) on {chat_gpu}" in reason.message
    assert "not preemptible by normal (I5)" in reason.message
    assert reason.nominated == (gid("w1:0"), gid("w1:1"))  # its victims' memory, still


def test_a_preemptor_names_the_higher_priority_request_holding_memory_it_frees() -> None:
    """The interactive request fits nowhere until a victim stops (8 and 4 GiB free): it
    holds the memory being freed on one GPU (I6: a request of higher base priority may),
    ahead of 'pair' in the queue. The preemptor's reason names that request and GPU."""
    sched = _preempting_pair(16 * GiB, side_mb=4 * GiB)
    sched.submit(req("chat", 16 * GiB, priority="interactive", holder="chat"), 2.0)
    assert not granted_ids(sched.decide(2.0))
    (held,) = sched.explain("chat", 2.0).nominated  # waits there for a victim to stop
    reason = sched.explain("pair", 2.0)
    assert reason.code == "nominated_for"
    assert reason.blocked_by == "chat"
    assert reason.blocker is not None
    assert (reason.blocker.kind, reason.blocker.id) == ("request", "chat")
    assert reason.blocker.gpus == (held,)
    assert f"of {held} is held for request chat (holder 'chat'), ahead in the queue" in (
        reason.message
    )


def test_once_the_victims_stopped_the_preemptor_names_the_lease_in_its_way() -> None:
    """The victims stop and the interactive request is granted on the memory it held:
    'pair' no longer fits on w1 and cannot preempt an interactive lease. Its reason names
    that lease on its GPU (the worker's other GPU has room), not its own hold of the last
    cycle as if it were a request ahead of it."""
    sched = _preempting_pair(16 * GiB, side_mb=4 * GiB)
    sched.submit(req("chat", 16 * GiB, priority="interactive", holder="chat"), 2.0)
    sched.decide(2.0)
    for i in (0, 1):
        sched.release(f"batch{i}", 3.0)
    assert granted_ids(sched.decide(3.0)) == ["chat"]
    sched.ready("chat", 3.0)
    (chat_gpu,) = sched.leases["chat"].gpus
    assert not granted_ids(sched.decide(4.0))
    reason = sched.explain("pair", 4.0)
    assert reason.code == "insufficient_vram"
    assert [b.id for b in reason.blockers] == ["chat"]
    assert reason.blocker is not None and reason.blocker.gpus == (chat_gpu,)
    assert "not preemptible by normal (I5)" in reason.message


def test_the_request_named_holding_a_gpu_holds_it_at_the_turn() -> None:
    """'p' (normal) preempts the batch lease of w1:0; 'x' (critical) fits nowhere and holds
    w1:0; 'r' (interactive) finds w1:0 held. The walk's holds on w1:0 are p's prehold then
    x's hold: r names x (p's prehold is lifted for r's turn, I6). p, whose memory x holds,
    names x too, with x's 20 GiB, not its own prehold counted against itself."""
    sched = scheduler(gpu(0), gpu(1))
    on = {i: Constraints.build(gpu_ids=[f"w1:{i}"]) for i in (0, 1)}
    grant_now(sched, req("victim", 10 * GiB, priority="batch", constraints=on[0]), 0.0)
    pinned = req("pinned", 22 * GiB, priority="batch", preemptible=False, constraints=on[1])
    grant_now(sched, pinned, 0.0)
    sched.submit(req("p", 16 * GiB, priority="normal", constraints=on[0]), 1.0)
    assert revoked_ids(sched.decide(1.0)) == ["victim"]
    sched.submit(req("x", 20 * GiB, priority="critical", holder="x"), 2.0)
    sched.submit(req("r", 4 * GiB, priority="interactive"), 2.0)
    assert not granted_ids(sched.decide(2.0))
    r = sched.explain("r", 2.0)
    assert (r.code, r.blocked_by) == ("nominated_for", "x")
    assert "up to 20.0 GiB of w1:0 is held for request x (holder 'x')" in r.message
    p = sched.explain("p", 2.0)
    assert (p.code, p.blocked_by) == ("nominated_for", "x")
    assert "up to 20.0 GiB of w1:0 is held for request x (holder 'x')" in p.message
