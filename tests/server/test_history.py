"""The history kept in the controller's memory: bounded rings, what a sample holds, the
sampler's life in the app's lifespan."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpu_arbiter.controller import Controller, GpuProbeReport
from gpu_arbiter.core import Gpu
from gpu_arbiter.server.history import (
    MAX_GPUS,
    PRIORITY_CLASSES,
    SAMPLES,
    GpuSample,
    History,
    priority_class,
)
from gpu_arbiter.store import MemoryStore

from ..controller.support import Clock, request


def gpu(gpu_id: str, committed: int, used: int | None = None, busy: int = 0) -> GpuSample:
    return GpuSample(gpu_id, 24576, committed, used, busy)


def test_the_rings_keep_the_last_samples_only_and_read_oldest_first() -> None:
    clock = Clock(1000.0)
    history = History(sample_s=10, samples=4, clock=clock)
    for n in range(6):
        clock.now = 1000.0 + 10 * n
        history.record([gpu("a:0", committed=n)], {"normal": n})
    kept = history.read()
    assert kept["times"] == [1020.0, 1030.0, 1040.0, 1050.0]
    assert kept["gpus"][0]["committed_mb"] == [2, 3, 4, 5]
    assert kept["queue"]["normal"] == [2, 3, 4, 5]
    assert kept["queue"]["critical"] == [0, 0, 0, 0]
    assert (kept["samples"], kept["sample_s"]) == (4, 10.0)

    newer = history.read(since=1030.0)
    assert newer["times"] == [1040.0, 1050.0]
    assert newer["gpus"][0]["committed_mb"] == [4, 5]
    assert history.read(since=1050.0)["times"] == []


def test_a_gpu_missing_from_a_sample_reads_null_and_is_forgotten_after_a_window() -> None:
    clock = Clock(0.0)
    history = History(samples=3, clock=clock)

    def record(*gpus: GpuSample) -> None:
        clock.now += 10
        history.record(gpus, {})

    record(gpu("a:0", 1, used=5, busy=1))
    record(gpu("a:0", 2), gpu("b:0", 7))  # b appears; a's probe saw nothing
    record(gpu("b:0", 8))  # a is gone
    series = {g["id"]: g for g in history.read()["gpus"]}
    assert series["a:0"]["committed_mb"] == [1, 2, None]
    assert series["a:0"]["used_mb"] == [5, None, None]
    assert series["a:0"]["busy_mb"] == [1, 0, None]
    assert series["b:0"]["committed_mb"] == [None, 7, 8]
    record(gpu("b:0", 9))
    assert [g["id"] for g in history.read()["gpus"]] == ["a:0", "b:0"]
    record(gpu("b:0", 9))  # none of the three samples kept has a: it is forgotten
    assert [g["id"] for g in history.read()["gpus"]] == ["b:0"]


def test_gpus_beyond_the_cap_are_counted_not_kept() -> None:
    history = History(samples=2, max_gpus=2, clock=Clock())
    history.record([gpu("a:0", 1), gpu("a:1", 1), gpu("a:2", 1), gpu("a:3", 1)], {})
    kept = history.read()
    assert [g["id"] for g in kept["gpus"]] == ["a:0", "a:1"]
    assert kept["gpus_left_out"] == 2
    assert kept["max_gpus"] == 2


def test_the_memory_is_fixed_by_the_cap_whatever_runs() -> None:
    history = History(clock=Clock())
    many = [gpu(f"w{n // 8}:{n % 8}", n) for n in range(MAX_GPUS + 100)]
    for _ in range(SAMPLES + 10):
        history.record(many, {"batch": 3})
    kept = history.read()
    assert len(kept["gpus"]) == MAX_GPUS
    assert kept["gpus_left_out"] == 100
    assert {len(g["committed_mb"]) for g in kept["gpus"]} == {SAMPLES}
    assert len(kept["times"]) == SAMPLES


@pytest.mark.parametrize(
    ("priority", "name"),
    [
        (0, "batch"),
        (100, "batch"),
        (299, "batch"),
        (300, "background"),
        (650, "normal"),
        (799, "normal"),
        (800, "interactive"),
        (999, "interactive"),
        (1000, "critical"),
    ],
)
def test_a_priority_falls_in_the_highest_class_at_or_below_it(priority: int, name: str) -> None:
    assert priority_class(priority) == name
    assert name in PRIORITY_CLASSES


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="sample_s"):
        History(sample_s=0)
    with pytest.raises(ValueError, match="samples"):
        History(samples=0)


def controller_with_leases(clock: Clock) -> tuple[Controller, dict[str, str]]:
    gpus = [Gpu(index=i, total_mb=24576, worker="w", arch="sm_86") for i in range(2)]
    controller = Controller(MemoryStore(), clock=clock)
    controller.start()
    controller.workers.register("w", gpus)
    controller.workers.heartbeat("w", [GpuProbeReport(0, 9000), GpuProbeReport(1, 0)])

    def ask(vram_mb: int, **fields: Any) -> str:
        return controller.leases.submit("c", request(vram_mb, ttl_s=600, **fields)).record.id

    ids = {"busy": ask(8192, preemptible=False), "idle": ask(4096, preemptible=False)}
    for lease_id in ids.values():
        controller.leases.ready(lease_id)
    controller.leases.set_idle(ids["idle"], True)
    # Both GPUs whole: never granted while the busy lease holds one of them.
    ids["waiting"] = ask(24576, gpus=2, priority=650)
    ids["urgent"] = ask(24576, gpus=2, priority="critical")
    return controller, ids


async def test_a_sample_holds_committed_used_and_busy_memory_and_the_queue_by_class() -> None:
    clock = Clock(5000.0)
    controller, ids = controller_with_leases(clock)
    try:
        assert controller.leases.get(ids["urgent"]).state == "pending"
        where = {i: controller.leases.get(i).lease for i in (ids["busy"], ids["idle"])}
        history = History(clock=clock)
        history.sample(controller)

        kept = history.read()
        assert kept["times"] == [5000.0]
        series = {g["id"]: g for g in kept["gpus"]}
        committed: dict[str, int] = {"w:0": 0, "w:1": 0}
        busy: dict[str, int] = {"w:0": 0, "w:1": 0}
        for lease_id, lease in where.items():
            assert lease is not None
            for gpu_id in lease.gpus:
                committed[str(gpu_id)] += lease.vram_mb
                if lease_id == ids["busy"]:
                    busy[str(gpu_id)] += lease.vram_mb
        for gpu_id, figures in series.items():
            assert figures["committed_mb"] == [committed[gpu_id]]
            assert figures["busy_mb"] == [busy[gpu_id]]
            assert figures["total_mb"] == 24576
        assert series["w:0"]["used_mb"] == [9000]
        assert kept["queue"]["critical"] == [1]
        assert kept["queue"]["normal"] == [1]  # 650
        assert kept["queue"]["batch"] == [0]
    finally:
        controller.close()


async def test_the_sampler_runs_until_it_is_told_to_stop() -> None:
    controller, _ = controller_with_leases(Clock())
    history = History(sample_s=0.01)
    stop = asyncio.Event()
    try:
        sampler = asyncio.create_task(history.run(controller, stop))
        while len(history.read()["times"]) < 3:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(sampler, 5)
        stopped_at = len(history.read()["times"])
        await asyncio.sleep(0.05)
        assert len(history.read()["times"]) == stopped_at
    finally:
        controller.close()


async def test_a_failed_sample_is_logged_and_the_next_one_still_taken(
    caplog: pytest.LogCaptureFixture,
) -> None:
    controller, _ = controller_with_leases(Clock())
    history = History(sample_s=0.01)
    failures = 0
    sample = history.sample

    def fails_twice(ctl: Controller) -> None:
        nonlocal failures
        if failures < 2:
            failures += 1
            raise RuntimeError("a bug")
        sample(ctl)

    history.sample = fails_twice  # type: ignore[method-assign]
    stop = asyncio.Event()
    try:
        sampler = asyncio.create_task(history.run(controller, stop))
        while not history.read()["times"]:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(sampler, 5)
    finally:
        controller.close()
    assert failures == 2
    assert "the history sample failed" in caplog.text
