"""A multi-GPU request is "queued" only when one worker has enough GPUs with room."""

from __future__ import annotations

from gpu_arbiter.core import Gpu, Request, Scheduler, Worker


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
