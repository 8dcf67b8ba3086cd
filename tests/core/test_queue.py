from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_arbiter.core import NotFound, Policy, Request
from gpu_arbiter.core.queue import PendingQueue


def _request(request_id: str, priority: int, seq: int, at: float = 0.0, mb: int = 100) -> Request:
    return replace(
        Request.build(request_id, vram_mb=mb, priority=priority), seq=seq, submitted_at=at
    )


def _ids(queue: PendingQueue, policy: Policy, now: float) -> list[str]:
    return [r.id for r in queue.ordered(policy, now)]


def test_order_is_priority_desc_then_submission() -> None:
    queue = PendingQueue()
    for request in [
        _request("b1", 100, 1),
        _request("n1", 500, 2),
        _request("i1", 800, 3),
        _request("n2", 500, 4),
        _request("b2", 100, 5),
        _request("c1", 1000, 6),
    ]:
        queue.add(request)
    assert _ids(queue, Policy(), 0.0) == ["c1", "i1", "n1", "n2", "b1", "b2"]
    assert queue.priorities() == [1000, 800, 500, 100]
    assert queue.count_by_priority() == {100: 2, 500: 2, 800: 1, 1000: 1}
    assert len(queue) == 6


def test_out_of_order_seq_is_sorted() -> None:
    queue = PendingQueue()
    queue.add(_request("late", 500, 9))
    queue.add(_request("early", 500, 2))
    assert _ids(queue, Policy(), 0.0) == ["early", "late"]


def test_requests_restored_out_of_order_keep_submission_order_in_bucket_and_class() -> None:
    queue = PendingQueue()
    for request_id, seq in (("c", 3), ("a", 1), ("d", 4), ("b", 2), ("b2", 2)):
        queue.add(_request(request_id, 500, seq))
    assert _ids(queue, Policy(), 0.0) == ["a", "b", "b2", "c", "d"]
    assert [r.id for r in queue.bucket(500)] == ["a", "b", "b2", "c", "d"]
    assert [r.id for r in queue.walk(Policy(), 0.0)] == ["a", "b", "b2", "c", "d"]


def test_removing_the_last_of_a_class_or_bucket_forgets_it() -> None:
    queue = PendingQueue()
    queue.add(_request("a", 500, 1, mb=100))
    queue.add(_request("b", 500, 2, mb=200))
    assert queue.only() is None
    assert queue.class_count() == 2
    queue.remove("a")
    assert queue.class_count() == 1
    assert queue.only() == queue.get("b")
    queue.remove("b")
    assert (queue.class_count(), queue.priorities(), len(queue), queue.only()) == (0, [], 0, None)
    queue.add(_request("a", 500, 3, mb=100))  # the same id and class again, afresh
    assert [r.id for r in queue.walk(Policy(), 0.0)] == ["a"]
    assert queue.class_count() == 1


def test_aging_raises_effective_priority_over_time() -> None:
    policy = Policy(aging_interval_s=10, aging_step=50, aging_cap=799)
    queue = PendingQueue()
    queue.add(_request("old_batch", 100, 1, at=0.0))
    queue.add(_request("new_normal", 500, 2, at=95.0))
    assert policy.effective_priority(queue.get("old_batch"), 96.0) == 550
    assert policy.effective_priority(queue.get("new_normal"), 96.0) == 500
    assert _ids(queue, policy, 96.0) == ["old_batch", "new_normal"]
    assert [r.id for r in queue.ordered(Policy(aging_step=0), 96.0)] == ["new_normal", "old_batch"]


def test_aging_is_capped() -> None:
    policy = Policy(aging_interval_s=1, aging_step=50, aging_cap=799)
    queue = PendingQueue()
    queue.add(_request("old_batch", 100, 1, at=0.0))
    queue.add(_request("interactive", 800, 2, at=999.0))
    assert policy.effective_priority(queue.get("old_batch"), 10_000.0) == 799
    assert _ids(queue, policy, 10_000.0) == ["interactive", "old_batch"]


def test_the_cap_never_lowers_a_priority_above_it() -> None:
    policy = Policy(aging_interval_s=1, aging_step=50, aging_cap=600)
    high = _request("high", 700, 1, at=0.0)
    assert policy.effective_priority(high, 1000.0) == 700
    at_cap = _request("cap", 600, 2, at=0.0)
    assert policy.effective_priority(at_cap, 1000.0) == 600
    below = _request("below", 590, 3, at=0.0)
    assert policy.effective_priority(below, 1000.0) == 600


def test_no_aging_when_step_is_zero() -> None:
    policy = Policy(aging_step=0)
    assert policy.effective_priority(_request("r", 100, 1, at=0.0), 1e6) == 100


def test_listing_does_not_disturb_the_queue() -> None:
    queue = PendingQueue()
    for i, priority in enumerate([100, 500, 500, 800]):
        queue.add(_request(f"r{i}", priority, i + 1))
    first = _ids(queue, Policy(), 0.0)
    iterator = queue.ordered(Policy(), 0.0)
    next(iterator)  # a partial listing
    assert _ids(queue, Policy(), 0.0) == first
    assert list(r.id for r in queue.bucket(500)) == ["r1", "r2"]
    assert len(queue) == 4


def test_remove_by_id() -> None:
    queue = PendingQueue()
    queue.add(_request("a", 500, 1, mb=100))
    queue.add(_request("b", 500, 2, mb=50))
    queue.add(_request("c", 100, 3, mb=50))
    assert queue.smallest_vram_mb() == 50
    assert queue.remove("b").id == "b"
    assert "b" not in queue
    assert _ids(queue, Policy(), 0.0) == ["a", "c"]
    assert queue.remove("c").id == "c"
    assert queue.smallest_vram_mb() == 100
    assert queue.priorities() == [500]
    with pytest.raises(NotFound):
        queue.remove("c")
    with pytest.raises(NotFound):
        queue.get("nope")
    queue.remove("a")
    assert queue.smallest_vram_mb() is None
    assert _ids(queue, Policy(), 0.0) == []


def test_adding_a_duplicate_id_is_refused() -> None:
    queue = PendingQueue()
    queue.add(_request("a", 500, 1))
    with pytest.raises(ValueError, match="already queued"):
        queue.add(_request("a", 100, 2))


def test_the_walk_is_the_queue_order_merged_from_classes() -> None:
    queue = PendingQueue()
    policy = Policy(aging_interval_s=10, aging_step=100)
    requests = [
        _request("b-small-1", 100, 1, at=0.0, mb=100),
        _request("n-big-1", 500, 2, at=50.0, mb=900),
        _request("b-big-1", 100, 3, at=0.0, mb=900),
        _request("n-small-1", 500, 4, at=60.0, mb=100),
        _request("b-small-2", 100, 5, at=70.0, mb=100),
        _request("n-big-2", 500, 6, at=80.0, mb=900),
    ]
    for request in requests:
        queue.add(request)
    assert queue.class_count() == 4
    for now in (80.0, 90.0, 200.0):  # aging interleaves the classes differently
        assert [r.id for r in queue.walk(policy, now)] == _ids(queue, policy, now)


def test_a_dropped_class_is_skipped_but_requests_walked_alone_are_not() -> None:
    queue = PendingQueue()
    for seq in range(1, 6):
        queue.add(_request(f"n{seq}", 500, seq))
    queue.add(_request("other", 500, 6, mb=200))
    walk = queue.walk(Policy(), 0.0, alone=["n4"])
    seen = []
    for request in walk:
        seen.append(request.id)
        if request.id == "n1":
            walk.drop()
    assert seen == ["n1", "n4", "other"]
    assert walk.examined == 3


@given(
    st.lists(
        st.tuples(st.sampled_from([0, 100, 500, 800, 1000]), st.floats(0, 50), st.booleans()),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from([0, 50, 100]),
    st.sampled_from([10.0, 30.0]),
    st.floats(0, 3000),
)
def test_a_position_is_where_the_queue_order_has_the_request(
    drawn: list[tuple[int, float, bool]], step: int, interval: float, now: float
) -> None:
    """Found by bisection in each bucket, the position of every pending request is the
    one its walk in queue order gives, with aging interleaving the priorities, and after
    removals (the requests drawn ``True`` are removed)."""
    queue = PendingQueue()
    policy = Policy(aging_step=step, aging_interval_s=interval)
    at = 0.0
    for seq, (priority, gap, _) in enumerate(drawn, start=1):
        at += gap  # submitted in order: a later seq was submitted no earlier
        queue.add(_request(f"r{seq}", priority, seq, at=at))
    for seq, (_, _, removed) in enumerate(drawn, start=1):
        if removed and len(queue) > 1:
            queue.remove(f"r{seq}")
    ordered = _ids(queue, policy, at + now)
    assert [queue.position(rid, policy, at + now) for rid in ordered] == list(
        range(1, len(ordered) + 1)
    )
