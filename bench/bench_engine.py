"""Benchmarks of the in-process Arbiter (engine + decision core).

1. Uncontended acquire+release cycles per second (one GPU, nothing else held).
2. Release-to-grant latency: every GPU is full, N requests wait; one lease is
   released and the time until the next waiting request's task runs with its
   grant is measured. Median and p99 for each queue length and GPU count, and
   the ratio of the largest queue's cost to the smallest's.

Run: python bench/bench_engine.py            (full: up to 100,000 pending)
     python bench/bench_engine.py --quick    (smaller, for a smoke run)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time

from gpu_arbiter import Arbiter, Gpu, LeaseHandle

GPU_MB = 24576
LEASE_MB = 6144  # four per GPU


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


async def uncontended(cycles: int) -> float:
    async with Arbiter(gpus=[Gpu(index=0, total_mb=GPU_MB)]) as arbiter:
        for _ in range(200):  # warm up
            await (await arbiter.acquire(1000)).release()
        start = time.perf_counter()
        for _ in range(cycles):
            lease = await arbiter.acquire(1000)
            await lease.release()
        return cycles / (time.perf_counter() - start)


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
    args = parser.parse_args()
    cycles = 5000 if args.quick else 20000
    queue_sizes = [10, 1000] if args.quick else [10, 1000, 10000, 100000]
    gpu_counts = [8, 100] if args.quick else [8, 1000]
    samples = 200 if args.quick else 1000

    rates = [asyncio.run(uncontended(cycles)) for _ in range(5)]
    print("uncontended acquire+release (one GPU)")
    print(
        f"  median {statistics.median(rates):,.0f} cycles/s  "
        f"(min {min(rates):,.0f}, max {max(rates):,.0f}, 5 runs of {cycles})"
    )
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
