"""Admission cost against queue length, on the decision core itself.

Two GPUs on two workers: ``full`` (one 24 GiB GPU, filled by one lease) and
``room`` (one empty 24 GiB GPU). N requests are pending that cannot fit: they
are pinned to ``full``. Then, per sample, one request that fits on ``room`` is
submitted and one cycle (``Scheduler.decide``) is timed; the request is then
released so that the next sample starts from the same state.

- head: the fitting request is ``interactive``: it is first in the queue.
- tail: it is ``normal``, submitted after the N: it is last in the queue.

For each N the median and p99 of one cycle are printed, with the requests the
cycle examined, then the ratio of the largest N's median to the smallest's.
Then where the last of N pending requests stands, as a 202 answers it: by bisection
in each priority's bucket (``Scheduler.position``) against walking the queue up to it
(``Scheduler.pending``), in the same run, and what its reason costs
(``Scheduler.explain``). Last, queueing: N requests submitted one by
one, each followed by a cycle (as the engine and the controller do), total time and time
per request.

Run: python bench/bench_admission.py                  (10 ... 100,000 pending)
     python bench/bench_admission.py --sizes 10,1000  (a smoke run)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from gpu_arbiter.core import Constraints, Gpu, Request, Scheduler, Worker

GiB = 1024
PINNED = Constraints.build(worker="full")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def cluster() -> Scheduler:
    sched = Scheduler()
    sched.put_worker(Worker("full"), [Gpu(index=0, total_mb=24 * GiB, worker="full")])
    sched.put_worker(Worker("room"), [Gpu(index=0, total_mb=24 * GiB, worker="room")])
    sched.submit(Request.build("filler", vram_mb=24 * GiB, ttl_s=None), 0.0)
    sched.decide(0.0)
    sched.ready("filler", 0.0)
    return sched


def pinned(i: int) -> Request:
    return Request.build(f"pinned-{i}", vram_mb=8 * GiB, constraints=PINNED, ttl_s=None)


def cycle_cost(pending: int, samples: int, where: str) -> tuple[list[float], float]:
    """Microseconds of the cycle that grants the fitting request; requests examined."""
    sched = cluster()
    for i in range(pending):
        sched.submit(pinned(i), 1.0)
    sched.decide(1.0)
    priority = "interactive" if where == "head" else "normal"
    latencies = []
    examined = 0
    gc.collect()
    gc.disable()
    for n in range(samples):
        now = 2.0 + n
        sched.submit(Request.build(f"fit-{n}", vram_mb=4 * GiB, priority=priority), now)
        examined -= sched.counters["examined"]
        start = time.perf_counter()
        decisions = sched.decide(now)
        latencies.append((time.perf_counter() - start) * 1e6)
        examined += sched.counters["examined"]
        assert [lease.id for lease in decisions.grants] == [f"fit-{n}"]
        sched.ready(f"fit-{n}", now)
        sched.release(f"fit-{n}", now)
        sched.decide(now)
    gc.enable()
    return latencies, examined / samples


def queueing(pending: int) -> float:
    """Seconds to queue ``pending`` requests, a cycle after each."""
    sched = cluster()
    gc.collect()
    start = time.perf_counter()
    for i in range(pending):
        sched.submit(pinned(i), 1.0)
        sched.decide(1.0)
    return time.perf_counter() - start


def answer_cost(pending: int, samples: int) -> tuple[float, float, float]:
    """Median microseconds to find where the last of ``pending`` queued requests stands
    (what a 202 answers with its reason): by bisection (``Scheduler.position``), and by
    walking the queue up to it (``Scheduler.pending``, as it was found before); and of its
    reason (``Scheduler.explain``: it names the lease in the way, ``filler``)."""
    sched = cluster()
    for i in range(pending):
        sched.submit(pinned(i), 1.0)
    sched.decide(1.0)
    last = f"pinned-{pending - 1}"
    found, walked, reasons = [], [], []
    gc.collect()
    gc.disable()
    for n in range(samples):
        now = 2.0 + n
        start = time.perf_counter()
        position, _ = sched.position(last, now)
        found.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        walk = next(p for p, request, _ in sched.pending(now) if request.id == last)
        walked.append((time.perf_counter() - start) * 1e6)
        assert position == walk == pending
        start = time.perf_counter()
        reason = sched.explain(last, now)
        reasons.append((time.perf_counter() - start) * 1e6)
        assert reason.blocked_by == "filler", reason
    gc.enable()
    return statistics.median(found), statistics.median(walked), statistics.median(reasons)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1000,10000,100000", help="pending counts")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--queueing-max", type=int, default=100000, help="largest N queued")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    for where in ("head", "tail"):
        print(f"one cycle granting the fitting request at the {where}, N pinned requests pending")
        print(f"  {'pending':>8} {'median us':>10} {'p99 us':>8} {'examined':>9}")
        medians = {}
        for pending in sizes:
            lat, examined = cycle_cost(pending, args.samples, where)
            medians[pending] = statistics.median(lat)
            print(
                f"  {pending:>8} {medians[pending]:>10.1f} {percentile(lat, 99):>8.1f} "
                f"{examined:>9.1f}"
            )
        ratio = medians[sizes[-1]] / medians[sizes[0]]
        print(f"  ratio median({sizes[-1]:,})/median({sizes[0]:,}) = {ratio:.2f}")
        print()
    print("where the last of N pending requests stands (a 202's position), and its reason")
    print(
        f"  {'pending':>8} {'bisect us':>10} {'walk us':>9} {'walk/bisect':>12} {'reason us':>10}"
    )
    for pending in sizes:
        samples = max(10, min(args.samples, 200_000 // pending))
        found, walked, reason = answer_cost(pending, samples)
        print(
            f"  {pending:>8} {found:>10.1f} {walked:>9.1f} {walked / found:>11.1f}x {reason:>10.1f}"
        )
    print()
    print("queueing N requests, one cycle after each")
    print(f"  {'N':>8} {'total s':>9} {'us per request':>15}")
    for pending in [n for n in sizes if n <= args.queueing_max]:
        total = queueing(pending)
        print(f"  {pending:>8} {total:>9.3f} {total / pending * 1e6:>15.1f}")


if __name__ == "__main__":
    main()
