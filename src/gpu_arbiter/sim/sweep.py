"""The sweep: ``ours`` over a fixed set of generated traces, judged by the simulator's checks.

Every generator kind and mixes of them, on clusters from one 24 GiB GPU to 2 workers of
8 x 80 GiB, with and without the sleep tier, over several seeds; and longer traces of
fine-tunes (multi-GPU where workers have several GPUs, rare and long) alone and beside
chat. A change to the core must leave every case at 0
violations, 0 over-commits, 0 concurrent loads and nothing unfinished: the test suite runs
it (``tests/sim/test_sweep.py``), and ``python -m gpu_arbiter.sim.sweep`` prints the
totals. Each case names the command that replays it alone (:attr:`Case.command`).

The hours of each cluster are set so that a short case asks for about a hundred to three
hundred requests: enough for queues, preemption, reclaim and sleep to happen, short
enough for the whole sweep to run in about a minute on two cores.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from .cluster import parse_cluster
from .metrics import Recording
from .ours import Ours, OursSleep
from .workloads import generate
from .world import Simulation

__all__ = ["CLUSTERS", "KINDS", "LONG", "POLICIES", "SEEDS", "Case", "cases", "failures", "main"]

KINDS = (
    "mixed",
    "chat",
    "agents",
    "imagegen",
    "batch",
    "chat+batch",
    "agents+imagegen+batch",
    "chat+imagegen",
)
CLUSTERS = {  # cluster: hours of arrivals
    "1x24G": 2.0,
    "2x24G": 1.0,
    "medium": 0.5,
    "4x80G": 0.5,
    "2w:8x80G": 0.25,
}
POLICIES = {"ours": Ours, "ours-sleep": OursSleep}
SEEDS = (1, 2, 3, 4)
# Fine-tunes are rare and long: these ask for multi-GPU ones (2 GPUs on 24 GiB workers,
# 4 on 80 GiB ones) on the clusters whose workers have several GPUs, beside chat.
LONG = (("batch", 8.0), ("batch+chat", 2.0))
LONG_CLUSTERS = ("2x24G", "medium", "4x80G", "2w:8x80G")
LONG_SEEDS = (1, 2)


@dataclass(frozen=True, slots=True)
class Case:
    kind: str
    cluster: str
    seed: int
    policy: str
    hours: float

    @property
    def command(self) -> str:
        """The command that replays this case alone."""
        return (
            f"gpu-arbiter simulate --generate {self.kind} --seed {self.seed} "
            f"--cluster {self.cluster} --hours {self.hours:g} --policy {self.policy}"
        )

    def run(self) -> Recording:
        cluster = parse_cluster(self.cluster)
        trace = generate(self.kind, self.seed, cluster, hours=self.hours)
        return Simulation(trace, cluster, POLICIES[self.policy](cluster)).run()


def cases() -> Iterator[Case]:
    for (cluster, hours), kind, seed, policy in itertools.product(
        CLUSTERS.items(), KINDS, SEEDS, POLICIES
    ):
        yield Case(kind, cluster, seed, policy, hours)
    for (kind, hours), cluster, seed, policy in itertools.product(
        LONG, LONG_CLUSTERS, LONG_SEEDS, POLICIES
    ):
        yield Case(kind, cluster, seed, policy, hours)


def failures(rec: Recording) -> list[str]:
    """What the simulator's checks found wrong in one case (empty: none)."""
    found = list(rec.violations)
    if rec.overcommits:
        found.append(f"{rec.overcommits} over-commits")
    if rec.concurrent_loads:
        found.append(f"{rec.concurrent_loads} concurrent loads")
    if rec.unfinished:
        found.append(f"{rec.unfinished} requests unfinished")
    return found


def main() -> int:
    """Runs every case; prints each failing one with its command, then the totals."""
    started = time.perf_counter()
    count = failed = steps = completed = preemptions = reclaims = sleeps = 0
    for case in cases():
        rec = case.run()
        count += 1
        steps += rec.steps
        completed += rec.completed
        preemptions += rec.preemptions
        reclaims += rec.evictions
        sleeps += rec.sleeps
        found = failures(rec)
        if found:
            failed += 1
            print(f"{case.command}: {'; '.join(found[:3])}")
    seconds = time.perf_counter() - started
    print(
        f"{count} traces in {seconds:.1f} s: {steps} steps, {completed} runs completed, "
        f"{preemptions} preemptions, {reclaims} warm models reclaimed, {sleeps} sleeps; "
        f"{failed} with a violation, an over-commit, a concurrent load or unfinished work"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
