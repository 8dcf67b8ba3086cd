"""How soon every front door serves a model the catalogue adds, and refuses one it removes:
``python bench/bench_catalogue.py [--applies 10] [--poll-s 0.02]``.

A controller (memory store) and three hosts on this machine, each an agent with its own
worker name and simulated GPU (``1x24G:sm_86``) and a gateway on its own loopback
address (127.0.0.2-4) whose file is a ``[gateway]`` table only: every model it serves
comes from the cluster's catalogue, which it follows (a long-poll). Each model is
tests/integration/model_server.py (no load time), so that what is measured is the
catalogue's way to the doors, not a model's load.

Each of ``--applies`` rounds applies one catalogue revision (``PUT /v1/catalogue``, as
``gpu-arbiter catalogue apply`` does) that adds a new model (``m-N``) and removes the
previous round's; from the moment the revision is sent, each door is asked again and
again (``POST /v1/completions``, each request once the previous one ended, ``--poll-s``
apart): the time until every door answered the new model with a 200 (its server
started once for the cluster, by the first door that asked), until every door knew it
(the request that got the 200 was sent: the rest is the server's start), and until every
door answered the removed one with a 404. Prints each round's figures, then the median, p90
and max of both, and the goal: at most 5 s for the new model at every door.

Every process is stopped at the end (SIGTERM, then SIGKILL after 30 s), also on errors.
Everything shares this machine's cores: the figures include the polling's own load.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frontdoor import (
    Processes,
    _state,
    model_table,
    start_controller,
    wait_log,
    wait_until,
)

GOAL_S = 5.0
HOSTS = (2, 3, 4)


def start_cluster(procs: Processes, work: Path) -> tuple[httpx.Client, list[str], Path]:
    """The controller and the three hosts: an admin client, each door's URL, and the
    folder the model servers record their starts in."""
    py = sys.executable
    url, token, admin = start_controller(procs, work)
    record = work / "record"
    record.mkdir()
    doors = []
    for number in HOSTS:
        runtime, worker, address = work / f"host-{number}", f"box-{number}", f"127.0.0.{number}"
        procs.start(
            [py, "-m", "gpu_arbiter", "agent", "--controller", url, "--token", token, "--name",
             worker, "--simulate", "1x24G:sm_86", "--heartbeat-s", "0.5"],
            work / f"agent-{number}.log", runtime,
        )  # fmt: skip
        wait_until(lambda w=worker: _state(admin, w) == "online", f"{worker} online")
        config = runtime / "models.toml"
        config.write_text(f'[gateway]\nhost = "{address}"\nname = "gw-{number}"\n')
        log = work / f"gateway-{number}.log"
        gateway = procs.start(
            [py, "-m", "gpu_arbiter", "gateway", "--config", str(config), "--port", "0",
             "--controller", url, "--token", token, "--worker", worker,
             "--state-dir", str(runtime / "state")],
            log, runtime,
        )  # fmt: skip
        port = wait_log(log, rf"gateway on http://127\.0\.0\.{number}:(\d+)", gateway)
        doors.append(f"http://{address}:{port}")
    return admin, doors, record


async def until(client: httpx.AsyncClient, door: str, model: str, status: int, poll_s: float,
                began: float) -> tuple[float, float]:  # fmt: skip
    """Seconds from ``began`` until ``door`` answers a request for ``model`` with
    ``status``, and until the request so answered was sent (for a 200: the door knew the
    model by then; what follows is the server's start)."""
    body = {"model": model, "prompt": "hi", "max_tokens": 1}
    while True:
        sent = time.perf_counter()
        answer = await client.post(door + "/v1/completions", json=body)
        if answer.status_code == status:
            return time.perf_counter() - began, sent - began
        if answer.status_code not in (200, 404):
            raise SystemExit(f"{door}: {model}: {answer.status_code}: {answer.text[:300]}")
        await asyncio.sleep(poll_s)


async def one_apply(
    admin: httpx.Client, doors: list[str], text: str, new: str, old: str | None, poll_s: float
) -> tuple[float, float, float | None]:
    """One revision applied: the seconds until every door served ``new``, until every
    door knew it (its first request not refused sent), and until every door refused
    ``old``."""
    async with httpx.AsyncClient(timeout=60) as client:
        began = time.perf_counter()
        applied = await asyncio.to_thread(
            admin.put, "/v1/catalogue", json={"text": text, "file": "catalogue.toml"}
        )
        if applied.status_code != 201:
            raise SystemExit(f"the apply failed: {applied.status_code} {applied.text}")
        served = [until(client, door, new, 200, poll_s, began) for door in doors]
        refused = [until(client, door, old, 404, poll_s, began) for door in doors if old]
        found = await asyncio.gather(*served, *refused)
    served_s = max(done for done, _ in found[: len(doors)])
    known_s = max(sent for _, sent in found[: len(doors)])
    return served_s, known_s, max((done for done, _ in found[len(doors) :]), default=None)


def summary(label: str, seconds: list[float]) -> str:
    ordered = sorted(seconds)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return (
        f"{label}: median {statistics.median(ordered):.2f} s, p90 {p90:.2f} s, "
        f"max {ordered[-1]:.2f} s over {len(ordered)} applies"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--applies", type=int, default=10, help="catalogue revisions applied")
    parser.add_argument("--poll-s", type=float, default=0.02, help="between a door's asks")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-arbiter-bench-catalogue-"))
    procs = Processes(work, Path(__file__).resolve().parents[1] / "src")
    try:
        admin, doors, record = start_cluster(procs, work)
        added: list[float] = []
        known: list[float] = []
        removed: list[float] = []
        old = None
        for number in range(args.applies):
            new = f"m-{number}"
            text = model_table(new, record, "1G", 500, 0.0)
            served_s, known_s, gone_s = asyncio.run(
                one_apply(admin, doors, text, new, old, args.poll_s)
            )
            added.append(served_s)
            known.append(known_s)
            gone = "" if gone_s is None else f"; {old} refused at every door in {gone_s:.2f} s"
            print(
                f"revision {number + 1}: {new} known at every door in {known_s:.2f} s, served "
                f"in {served_s:.2f} s{gone}"
            )
            if gone_s is not None:
                removed.append(gone_s)
            old = new
        admin.close()
        print(summary("added, known at every door", known))
        print(summary("added, served (200) at every door", added))
        if removed:
            print(summary("removed, refused (404) at every door", removed))
        met = "met" if max(added) <= GOAL_S else "NOT met"
        print(f"goal: every door serves an added model within {GOAL_S:.0f} s: {met}")
    finally:
        procs.stop()
    print(f"(logs in {work})")


if __name__ == "__main__":
    main()
