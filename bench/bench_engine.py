"""Benchmarks of the in-process Arbiter (engine + decision core).

1. Uncontended acquire+release cycles per second (one GPU, nothing else held), side by
   side with the same cycle in vramd 0.3.9: rounds alternate between the two, and the
   medians, their ratio and each one's Python calls per cycle (every call cProfile saw
   over a profiled run of the cycles) are printed.
2. Release-to-grant latency: every GPU is full, N requests wait; one lease is
   released and the time until the next waiting request's task runs with its
   grant is measured. Median and p99 for each queue length and GPU count, and
   the ratio of the largest queue's cost to the smallest's.

Run: python bench/bench_engine.py                 (full: up to 100,000 pending)
     python bench/bench_engine.py --quick         (smaller, for a smoke run)
     python bench/bench_engine.py --uncontended   (1. only)

vramd is not a dependency of gpu-arbiter: for the comparison install it into the
virtual environment (``.venv/bin/pip install vramd==0.3.9``); without it the bench
says so and skips it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import importlib.metadata
import statistics
import time
from collections.abc import Callable
from typing import Any

from gpu_arbiter import Arbiter, Gpu, LeaseHandle

GPU_MB = 24576
LEASE_MB = 6144  # four per GPU
CYCLE_MB = 1000
WARM_UP = 200
VRAMD_VERSION = "0.3.9"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


async def uncontended(cycles: int, profile: cProfile.Profile | None = None) -> float:
    """Our cycles per second: ``acquire`` a lease of one GPU, ``release`` it."""
    async with Arbiter(gpus=[Gpu(index=0, total_mb=GPU_MB)]) as arbiter:
        for _ in range(WARM_UP):
            await (await arbiter.acquire(CYCLE_MB)).release()
        if profile is not None:
            profile.enable()
        start = time.perf_counter()
        for _ in range(cycles):
            lease = await arbiter.acquire(CYCLE_MB)
            await lease.release()
        elapsed = time.perf_counter() - start
        if profile is not None:
            profile.disable()
        return cycles / elapsed


def vramd_version() -> str | None:
    try:
        return importlib.metadata.version("vramd")
    except importlib.metadata.PackageNotFoundError:
        return None


def vramd_uncontended(cycles: int, profile: cProfile.Profile | None = None) -> float:
    """vramd's cycles per second for the same uncontended admission, in process.

    vramd admits work as jobs: ``JobQueue.enqueue`` queues one, its ``WorkerPool``
    claims it (``AffinityScheduler.pick_next``, the VRAM check, ``JobQueue.take``) and
    runs it (``mark_started``, the backend's ``generate``, ``JobQueue.finish``, which
    frees the slot). One cycle is that, for a model already loaded that answers at once:
    the body of ``WorkerPool._loop`` in the caller's thread, without its wait for work
    (a thread's wake-up would measure threading, not admission)."""
    from vramd import protocol
    from vramd.dispatcher import WorkerPool
    from vramd.job_queue import JobQueue

    class LoadedModel:
        """vramd's BackendManager as the pool sees it, for one loaded model."""

        def loaded_names(self) -> list[str]:
            return ["model"]

        def shape_matches_loaded(self, backend: str, request: dict[str, Any]) -> bool:
            return True

        def generate(self, backend: str, request: dict[str, Any]) -> dict[str, Any]:
            return {"status": protocol.STATUS_OK}

    queue = JobQueue()
    pool = WorkerPool(queue, LoadedModel(), query_free_mib=lambda: GPU_MB)  # type: ignore[arg-type]

    def cycle() -> None:
        queue.enqueue("model", {"vram_mb": CYCLE_MB})
        job = pool._claim_next()
        assert job is not None, "vramd admitted nothing"
        pool._run_job(job)

    for _ in range(WARM_UP):
        cycle()
    if profile is not None:
        profile.enable()
    start = time.perf_counter()
    for _ in range(cycles):
        cycle()
    elapsed = time.perf_counter() - start
    if profile is not None:
        profile.disable()
    return cycles / elapsed


def calls_per_cycle(run: Callable[[int, cProfile.Profile], object], cycles: int) -> float:
    """Every call the profiler saw, per cycle. Counted from its own entries, one per
    function: ``pstats`` merges functions that share a file, line and name (the
    ``__init__`` of every dataclass is ``<string>:2``), and would count fewer."""
    profile = cProfile.Profile()
    run(cycles, profile)
    return sum(entry.callcount for entry in profile.getstats()) / cycles


def side_by_side(cycles: int, rounds: int) -> None:
    """Ours and vramd's uncontended cycle, alternating round by round (a shared machine's
    load then weighs on both alike), with the median of each and their ratio."""
    version = vramd_version()

    def ours(n: int, profile: cProfile.Profile | None = None) -> float:
        return asyncio.run(uncontended(n, profile))

    rates: dict[str, list[float]] = {"gpu-arbiter": [], f"vramd {version}": []}
    for _ in range(rounds):
        rates["gpu-arbiter"].append(ours(cycles))
        if version is not None:
            rates[f"vramd {version}"].append(vramd_uncontended(cycles))
    calls = {"gpu-arbiter": calls_per_cycle(ours, cycles)}
    if version is not None:
        calls[f"vramd {version}"] = calls_per_cycle(vramd_uncontended, cycles)
    print(f"uncontended acquire+release (one GPU), {rounds} rounds of {cycles:,} cycles")
    print(f"  {'':<12} {'median/s':>10} {'min/s':>10} {'max/s':>10} {'calls/cycle':>12}")
    for name, values in rates.items():
        if values:
            print(
                f"  {name:<12} {statistics.median(values):>10,.0f} {min(values):>10,.0f} "
                f"{max(values):>10,.0f} {calls[name]:>12.0f}"
            )
    if version is None:
        print(
            f"  vramd is not installed: no comparison (it is not a dependency; "
            f"`.venv/bin/pip install vramd=={VRAMD_VERSION}` to compare)"
        )
        return
    if version != VRAMD_VERSION:
        print(f"  (vramd {version} is installed; the comparison was written for {VRAMD_VERSION})")
    ours_median = statistics.median(rates["gpu-arbiter"])
    theirs = rates[f"vramd {version}"]
    per_round = [a / b for a, b in zip(rates["gpu-arbiter"], theirs, strict=True)]
    print(
        f"  ratio gpu-arbiter/vramd: {ours_median / statistics.median(theirs):.2f}x "
        f"(per round {min(per_round):.2f}x..{max(per_round):.2f}x)"
    )


async def handoff(gpus: int, pending: int, samples: int) -> list[float]:
    """Latencies in microseconds from release() to the granted waiter running."""
    gpu_list = [Gpu(index=i, total_mb=GPU_MB) for i in range(gpus)]
    async with Arbiter(gpus=gpu_list) as arbiter:
        held: list[LeaseHandle] = []
        for _ in range(gpus * (GPU_MB // LEASE_MB)):
            lease = await arbiter.acquire(LEASE_MB, ttl_s=3600)
            await lease.ready()
            held.append(lease)
        granted: asyncio.Queue[tuple[float, LeaseHandle]] = asyncio.Queue()

        async def waiter() -> None:
            lease = await arbiter.acquire(LEASE_MB, ttl_s=3600)
            granted.put_nowait((time.perf_counter(), lease))

        tasks = [asyncio.create_task(waiter()) for _ in range(pending + samples)]
        while len(arbiter._scheduler.queue) < pending + samples:
            await asyncio.sleep(0)
        gc.collect()
        gc.disable()
        latencies = []
        for i in range(samples):
            victim = held[i % len(held)]
            start = time.perf_counter()
            await victim.release()
            woke, lease = await granted.get()
            latencies.append((woke - start) * 1e6)
            await lease.ready()
            held[i % len(held)] = lease
        gc.enable()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument(
        "--uncontended", action="store_true", help="only the side-by-side of 1. (no latencies)"
    )
    args = parser.parse_args()
    cycles = 5000 if args.quick else 20000
    queue_sizes = [10, 1000] if args.quick else [10, 1000, 10000, 100000]
    gpu_counts = [8, 100] if args.quick else [8, 1000]
    samples = 200 if args.quick else 1000

    side_by_side(cycles, rounds=5)
    if args.uncontended:
        return
    print()
    print("release-to-grant latency, every GPU full, N requests pending")
    print(f"  {'GPUs':>5} {'pending':>8} {'median us':>10} {'p99 us':>8} {'max us':>8}")
    for gpus in gpu_counts:
        medians = {}
        for pending in queue_sizes:
            lat = asyncio.run(handoff(gpus, pending, samples))
            medians[pending] = statistics.median(lat)
            print(
                f"  {gpus:>5} {pending:>8} {statistics.median(lat):>10.1f} "
                f"{percentile(lat, 99):>8.1f} {max(lat):>8.1f}"
            )
        ratio = medians[queue_sizes[-1]] / medians[queue_sizes[0]]
        print(
            f"  {gpus:>5} ratio median({queue_sizes[-1]:,} pending)/median({queue_sizes[0]}) "
            f"= {ratio:.2f}"
        )


if __name__ == "__main__":
    main()
