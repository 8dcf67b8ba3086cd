"""The cost of one routing decision at a front door, with 10 hosts and 50 models, this
tree against another commit in one run:
``python bench/bench_routing.py [--against REV] [--rounds 4] [--passes 50] [--seed 7]``.

Four figures, each timed one decision at a time (``time.perf_counter_ns`` around each
call, so each includes the timer's own cost, about 0.1 us):

- ``route``: the pure decision (``routing.route(model, hosts)``), on a prepared list of
  10 hosts' figures per model (warm, busy and full, coming, cold; some not routable);
- ``decide``: what a request pays at the front door before it goes anywhere
  (``Cluster.decide(name)``): the hosts' figures from the controller's view
  (``Cluster.apply``: 10 gateways, 50 models each, replicas in every state), then the
  decision; this gateway declares none of the models (every host is a peer);
- ``decide alias``: the same, asked by an alias;
- ``decide+record``: ``decide`` and the decision kept for ``GET /admin/routes``
  (``Cluster.record``: the decision as it is, its JSON and diagnosis built only when
  read), as ``app.py`` does for each request.

Each tree runs in a process of its own (``PYTHONPATH=<tree>/src``), the two alternating
round by round so that the machine's noise falls on both; the other tree is a ``git
worktree`` of ``--against`` (default: the last commit before routing was a profile),
made in a temporary folder and removed after. Prints the median and p99 of each in
microseconds per tree, the ratio this tree / the other (medians), and whether this
tree's p99 meets the goal (at most 100 us a decision). Pure CPU, no I/O: about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

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


def host_lists(rng: random.Random, make: Callable[..., Any]) -> dict[str, list[Any]]:
    """For each model, its 10 hosts (``make``: the tree's type for a host's figures): a
    mix of ready (with free slots or full), coming, cold, and a few not routable; some
    models have no ready host at all."""
    found: dict[str, list[Any]] = {}
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
                make(
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
    return {"signature": "bench", "gateways": gateways}


def timed(decide: Callable[[str], Any], names: Sequence[str], passes: int) -> list[float]:
    """Each decision's microseconds, over ``passes`` passes of every name."""
    took: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(passes):
        for name in names:
            began = clock()
            decide(name)
            took.append((clock() - began) / 1e3)
    return took


def measure(passes: int, seed: int) -> dict[str, list[float]]:
    """One tree's figures (run with its ``src`` first on the path)."""
    from gpu_arbiter.client import ArbiterClient
    from gpu_arbiter.gateway.cluster import routing
    from gpu_arbiter.gateway.cluster.cluster import Cluster

    try:
        from gpu_arbiter.gateway.profile import Candidate as make
    except ImportError:  # before the profile: the hosts' figures were routing.Host
        make = routing.Host  # type: ignore[attr-defined,assignment]
    rng = random.Random(seed)
    lists = host_lists(rng, make)
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
    aliases = [f"alias-{n[6:]}" for n in names]

    def record(name: str) -> None:
        cluster.record(name, cluster.decide(name))

    cases: dict[str, Callable[[str], Any]] = {
        "route": lambda n: routing.route(n, lists[n]),
        "decide": cluster.decide,
        "decide alias": cluster.decide,
        "decide+record": record,
    }
    found: dict[str, list[float]] = {}
    for case, decide in cases.items():
        asked = aliases if case == "decide alias" else names
        timed(decide, asked, 5)  # warm up
        found[case] = timed(decide, asked, passes)
    return found


def run_tree(src: Path, passes: int, seed: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}
    command = [sys.executable, __file__, "--measure", str(passes), "--seed", str(seed)]
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    found: dict[str, list[float]] = json.loads(done.stdout)
    return found


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(  # the last commit whose routing was written as one function
        "--against", default="b5e758c", help="the commit to compare with (default: before)"
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--passes", type=int, default=50, help="over the 50 models, per round")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--measure", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.seed)))
        return
    here = Path(__file__).resolve().parent.parent
    rev = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "--short", args.against],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    results: dict[str, dict[str, list[float]]] = {"this": {}, rev: {}}
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other"
        subprocess.run(
            ["git", "-C", str(here), "worktree", "add", "--detach", str(other), rev],
            check=True,
            capture_output=True,
        )
        try:
            for round_ in range(args.rounds):
                for name, tree in (("this", here), (rev, other)):
                    for key, values in run_tree(tree / "src", args.passes, args.seed).items():
                        results[name].setdefault(key, []).extend(values)
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            subprocess.run(
                ["git", "-C", str(here), "worktree", "remove", "--force", str(other)],
                check=False,
                capture_output=True,
            )
    count = len(results["this"]["route"])
    print(
        f"{HOSTS} hosts, {MODELS} models; {args.rounds} rounds x {args.passes} passes "
        f"({count} decisions per case and tree); us; goal: p99 at most {GOAL_US:.0f} us"
    )
    print(
        f"  {'case':<14} {'this p50':>9} {'p99':>8} {f'{rev} p50':>13} {'p99':>8} "
        f"{'this/' + rev:>13}  goal"
    )
    for key in results["this"]:
        mine, theirs = results["this"][key], results[rev][key]
        ratio = statistics.median(mine) / statistics.median(theirs)
        verdict = "met" if p99(mine) <= GOAL_US else "NOT met"
        print(
            f"  {key:<14} {statistics.median(mine):>9.2f} {p99(mine):>8.2f} "
            f"{statistics.median(theirs):>13.2f} {p99(theirs):>8.2f} {ratio:>12.2f}x  {verdict}"
        )


if __name__ == "__main__":
    main()
