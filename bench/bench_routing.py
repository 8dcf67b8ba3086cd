"""The cost of one routing decision at a front door, with 10 hosts and 50 models:
``python bench/bench_routing.py [--rounds 200] [--seed 7]``.

Two figures, each timed one decision at a time (``time.perf_counter_ns`` around each
call, so each includes the timer's own cost, about 0.1 us):

- ``routing.route(model, hosts)``: the pure decision, on a prepared list of 10 ``Host``
  values per model (warm, busy and full, coming, cold; some not routable);
- ``Cluster.decide(name)``: what a request pays at the front door, which first builds
  that list from the controller's view (``Cluster.apply``: 10 gateways, 50 models each,
  replicas in every state) and then decides; this gateway declares none of the models
  (every host is a peer).

Prints the median and p99 of each in microseconds against the goal (at most 100 us a
decision), and how often each kind of route was taken. Pure CPU, no I/O: a few seconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpu_arbiter.client import ArbiterClient
from gpu_arbiter.gateway.cluster.cluster import Cluster
from gpu_arbiter.gateway.cluster.routing import Host, Route, route

HOSTS = 10
MODELS = 50
GOAL_US = 100.0
STATES = ("warm", "busy", "queued", "loading", "waking", "asleep", "stopping")


class FixedClock:
    """A clock that never moves (the decision reads it once, for peers left out)."""

    def now(self) -> float:
        return 1000.0

    async def sleep(self, seconds: float) -> None:
        raise NotImplementedError


def host_lists(rng: random.Random) -> dict[str, list[Host]]:
    """For each model, its 10 hosts: a mix of ready (with free slots or full), coming,
    cold, and a few not routable; some models have no ready host at all."""
    found: dict[str, list[Host]] = {}
    for m in range(MODELS):
        hosts = []
        for h in range(HOSTS):
            shape = rng.choice(("warm", "busy", "full", "coming", "cold", "cold"))
            if m % 5 == 0 and shape in ("warm", "busy", "full"):
                shape = "cold"  # every fifth model has no ready copy: coming or a load
            ready = 0 if shape in ("coming", "cold") else rng.randint(1, 2)
            slots = ready * 4
            in_flight = {"warm": 0, "busy": rng.randint(1, max(1, slots - 1)), "full": slots}
            routable = rng.random() > 0.1
            hosts.append(
                Host(
                    f"gw-{h}",
                    local=h == 0,
                    routable=routable,
                    ready=ready,
                    slots=slots,
                    in_flight=in_flight.get(shape, 0),
                    coming=shape == "coming",
                    why_not="" if routable else f"worker box-{h} is draining",
                )
            )
        found[f"model-{m}"] = hosts
    return found


def view(rng: random.Random) -> dict[str, Any]:
    """A view of the cluster as ``GET /v1/gateways/{name}/cluster`` answers it: 10
    gateways (gw-1..gw-10; the deciding one is gw-0), each with the 50 models."""
    gateways = []
    for h in range(1, HOSTS + 1):
        models = []
        for m in range(MODELS):
            count = rng.choice((0, 0, 1, 1, 2))
            in_flight = [rng.randint(0, 4) for _ in range(count)]
            replicas = [
                {"state": rng.choice(STATES), "in_flight": n, "lease": None} for n in in_flight
            ]
            models.append(
                {
                    "id": f"model-{m}",
                    "aliases": [f"alias-{m}"],
                    "state": "ready",
                    "in_flight": sum(in_flight),
                    "queued": 0,
                    "max_parallel": 4,
                    "vram_mb": 4096,
                    "replicas": replicas,
                }
            )
        routable = rng.random() > 0.1
        gateways.append(
            {
                "name": f"gw-{h}",
                "url": f"http://127.0.0.{h + 1}:8000",
                "worker": f"box-{h}",
                "worker_state": "online" if routable else "draining",
                "routable": routable,
                "models": models,
            }
        )
    return {"signature": "bench", "peer_key": "bench-key", "gateways": gateways}


def timed(
    decide: Callable[[str], Route], names: Sequence[str], rounds: int
) -> tuple[list[float], Counter[str]]:
    """Each decision's microseconds, over ``rounds`` passes of every name."""
    took: list[float] = []
    kinds: Counter[str] = Counter()
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for name in names:
            began = clock()
            decision = decide(name)
            took.append((clock() - began) / 1e3)
            kinds[str(decision.kind)] += 1
    return took, kinds


def show(what: str, took: list[float], kinds: Counter[str]) -> None:
    took.sort()
    p50 = statistics.median(took)
    p99 = took[min(len(took) - 1, int(len(took) * 0.99))]
    verdict = "met" if p99 <= GOAL_US else "NOT met"
    routes = ", ".join(f"{k} {n * 100 / len(took):.0f}%" for k, n in sorted(kinds.items()))
    print(f"{what:<22} {len(took):>8} {p50:8.2f} {p99:8.2f}   {verdict}   ({routes})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200, help="passes over the 50 models")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lists = host_lists(rng)
    names = sorted(lists)
    cluster = Cluster(
        cast(ArbiterClient, None),
        name="gw-0",
        worker="box-0",
        models={},
        routes={},
        clock=FixedClock(),
    )
    cluster.apply(view(rng))
    assert all(len(cluster.hosts(name)) == HOSTS for name in names)
    timed(lambda n: route(n, lists[n]), names, 5)  # warm up
    timed(cluster.decide, names, 5)
    print(f"{HOSTS} hosts, {MODELS} models, {args.rounds} rounds; goal: at most {GOAL_US:.0f} us")
    print(f"{'decision':<22} {'count':>8} {'p50 us':>8} {'p99 us':>8}")
    show("routing.route", *timed(lambda n: route(n, lists[n]), names, args.rounds))
    show("Cluster.decide", *timed(cluster.decide, names, args.rounds))
    show("Cluster.decide alias", *timed(cluster.decide, [f"alias-{n[6:]}" for n in names], 50))


if __name__ == "__main__":
    main()
