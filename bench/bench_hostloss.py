"""How fast the cluster's front door routes around a lost host, with the default settings:
``python bench/bench_hostloss.py [--runs 3] [--interval-s 0.1]``.

Each run starts a controller (memory store) and three hosts on this machine, each an
agent (default heartbeat) with its own worker name and simulated GPU and a gateway on its
own loopback address (default liveness settings): box-2 (``1x4G``, too small for the
model: gw-2 is only a door), box-3 and box-4 (``1x24G``). Model ``chat``
(tests/integration/model_server.py, 8 GiB) is warmed on box-3 and gw-2's door routes it
there. Then, one case per cluster (each run starts two):

1. **kill**: box-3 killed whole (SIGKILL to its gateway, agent and model server). From
   the kill, one caller at gw-2 asks again and again (each request once the previous
   ended): the time to the first answer served by box-4, and every answer in between
   (each must be a 200 or an error naming the host). Goal: at most 10 s.
2. **freeze**: gw-3's gateway stopped with SIGSTOP (its port still accepts; its agent and
   server run on). From the freeze, a new request is sent at gw-2 every ``--interval-s``
   (each its own connection, none waiting for another): the time to the first request
   *sent* that was served by box-4 (routed elsewhere; goal at most 5 s), to its answer
   (the load on box-4 included), and to the 504s that end the requests relayed to gw-3
   meanwhile (goal: within 10 s of the freeze being seen). SIGCONT at the end.

Prints each run's figures and the medians. Every process is stopped at the end (SIGTERM,
then SIGKILL after 30 s), also on errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frontdoor import (
    ROOT,
    Processes,
    _state,
    model_table,
    sees_each_other,
    start_controller,
    wait_log,
    wait_until,
)

GOAL_KILL_S = 10.0
GOAL_FREEZE_S = 5.0
GOAL_CUT_S = 10.0


class Host:
    def __init__(self, number: int, agent: Any, gateway: Any, address: tuple[str, int]) -> None:
        self.number = number
        self.agent = agent
        self.gateway = gateway
        self.address = address

    @property
    def url(self) -> str:
        return f"http://{self.address[0]}:{self.address[1]}"


def start_cluster(procs: Processes, work: Path) -> tuple[dict[int, Host], Path]:
    py = sys.executable
    url, token, admin = start_controller(procs, work)
    record = work / "record"
    record.mkdir()
    models = model_table("chat", record, "8G", 6000, 0.2)
    hosts: dict[int, Host] = {}
    for number, spec in ((2, "1x4G:sm_86"), (3, "1x24G:sm_86"), (4, "1x24G:sm_86")):
        runtime, worker, address = work / f"host-{number}", f"box-{number}", f"127.0.0.{number}"
        agent = procs.start(
            [py, "-m", "gpu_arbiter", "agent", "--controller", url, "--token", token, "--name",
             worker, "--simulate", spec],
            work / f"agent-{number}.log", runtime,
        )  # fmt: skip
        wait_until(lambda w=worker: _state(admin, w) == "online", f"{worker} online")
        head = f'[gateway]\nhost = "{address}"\nname = "gw-{number}"\n\n'
        (runtime / "models.toml").write_text(head + models)
        log = work / f"gateway-{number}.log"
        gateway = procs.start(
            [py, "-m", "gpu_arbiter", "gateway", "--config", str(runtime / "models.toml"),
             "--port", "0", "--controller", url, "--token", token,
             "--state-dir", str(runtime / "state")],
            log, runtime,
        )  # fmt: skip
        port = wait_log(log, rf"gateway on http://{address.replace('.', '[.]')}:(\d+)", gateway)
        hosts[number] = Host(number, agent, gateway, (address, int(port)))
    admin.close()
    doors = {f"gw-{n}": h.address for n, h in hosts.items()}
    wait_until(lambda: sees_each_other(doors, "chat"), "each gateway to see the others")
    return hosts, record


def warm_on_3(hosts: dict[int, Host]) -> None:
    with httpx.Client(base_url=hosts[2].url, timeout=60) as door:
        answer = door.post("/v1/chat/completions", json=_chat("chat@gw-3"))
        if answer.status_code != 200:
            raise SystemExit(f"chat did not load on box-3: {answer.text}")
        wait_until(
            lambda: (
                _served_by(door.post("/v1/chat/completions", json=_chat("chat"))) == "gw-3/chat"
            ),
            "gw-2's door to route chat to gw-3",
        )


def _chat(model: str, **body: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}


def _served_by(answer: httpx.Response) -> str:
    return answer.headers.get("x-served-by", "")


def _server_pids(record: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in record.glob("chat-*.json")]


def kill_case(hosts: dict[int, Host], record: Path) -> tuple[float, int, list[str]]:
    """(seconds from the kill to box-4's first answer, answers before it, their errors)."""
    warm_on_3(hosts)
    (pid,) = _server_pids(record)
    for proc in (hosts[3].gateway, hosts[3].agent):
        proc.send_signal(signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    errors: list[str] = []
    with httpx.Client(base_url=hosts[2].url, timeout=60) as door:
        while True:
            answer = door.post("/v1/chat/completions", json=_chat("chat"))
            if answer.status_code == 200 and _served_by(answer) == "gw-4/chat":
                return time.monotonic() - killed, len(errors), errors
            if answer.status_code == 200:
                raise SystemExit(f"served by {_served_by(answer)} after the kill")
            if "gw-3" not in answer.text and "box-3" not in answer.text:
                raise SystemExit(f"an error that does not name the host: {answer.text}")
            errors.append(f"{answer.status_code}")
            if time.monotonic() - killed > 120:
                raise SystemExit("no answer from box-4 within 120 s of the kill")


async def freeze_case(
    hosts: dict[int, Host], interval_s: float
) -> tuple[float, float, list[float], int]:
    """(first request sent that box-4 served, its answer, the 504s' ends; s from the
    freeze) and how many requests were sent."""
    warm_on_3(hosts)
    pid = hosts[3].gateway.pid
    outcomes: list[tuple[float, float, int, str]] = []

    async with httpx.AsyncClient(
        base_url=hosts[2].url, timeout=120, limits=httpx.Limits(max_keepalive_connections=0)
    ) as door:

        async def one(sent: float) -> None:
            answer = await door.post("/v1/chat/completions", json=_chat("chat"))
            by = _served_by(answer) if answer.status_code == 200 else answer.text
            outcomes.append((sent, time.monotonic(), answer.status_code, by))

        os.kill(pid, signal.SIGSTOP)
        frozen = time.monotonic()
        tasks = []
        try:
            while time.monotonic() - frozen < 12.0:
                tasks.append(asyncio.ensure_future(one(time.monotonic())))
                await asyncio.sleep(interval_s)
            await asyncio.gather(*tasks)
        finally:
            os.kill(pid, signal.SIGCONT)
    elsewhere = sorted((s, e) for s, e, status, by in outcomes if by == "gw-4/chat")
    if not elsewhere:
        raise SystemExit(f"no request was served by box-4: {outcomes[:5]}")
    cuts = sorted(e - frozen for _, e, status, _ in outcomes if status == 504)
    for _, _, status, by in outcomes:
        if status not in (200, 504) or (status == 504 and "gw-3 (box-3)" not in by):
            raise SystemExit(f"an unexpected answer: {status} {by[:300]}")
    return elsewhere[0][0] - frozen, elsewhere[0][1] - frozen, cuts, len(outcomes)


def run_case(case: str, work: Path, interval_s: float) -> Any:
    work.mkdir(parents=True, exist_ok=True)
    procs = Processes(work, ROOT / "src")
    try:
        hosts, record = start_cluster(procs, work)
        if case == "kill":
            return kill_case(hosts, record)
        return asyncio.run(freeze_case(hosts, interval_s))
    finally:
        for proc in procs.started:  # a frozen process gets no SIGTERM's effect
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        procs.stop()
        for pid in _server_pids(work / "record") if (work / "record").exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3, help="medians over this many runs")
    parser.add_argument("--interval-s", type=float, default=0.1, help="between freeze requests")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-arbiter-bench-hostloss-"))
    kills, routed, served, cut_first, cut_last = [], [], [], [], []
    for n in range(args.runs):
        took, before, errors = run_case("kill", work / f"kill-{n}", args.interval_s)
        kills.append(took)
        print(f"run {n + 1}: kill -> first answer from box-4 {took:.2f} s "
              f"({before} error(s) before it, each naming the host: {errors})")  # fmt: skip
        first, answered, cuts, sent = run_case("freeze", work / f"freeze-{n}", args.interval_s)
        routed.append(first)
        served.append(answered)
        if cuts:
            cut_first.append(cuts[0])
            cut_last.append(cuts[-1])
        print(f"run {n + 1}: freeze -> first request routed elsewhere sent at {first:.2f} s, "
              f"answered at {answered:.2f} s; {len(cuts)} relay(s) cut with a 504 at "
              f"{(cuts or [0])[0]:.2f}-{(cuts or [0])[-1]:.2f} s; {sent} sent")  # fmt: skip
    med = statistics.median
    print(f"\nmedians of {args.runs} runs (default settings):")
    print(
        f"  kill -> first answer from the survivor   {med(kills):6.2f} s   "
        f"(goal {GOAL_KILL_S:g} s: {'met' if med(kills) <= GOAL_KILL_S else 'NOT met'})"
    )
    print(
        f"  freeze -> first request routed elsewhere {med(routed):6.2f} s   "
        f"(goal {GOAL_FREEZE_S:g} s: {'met' if med(routed) <= GOAL_FREEZE_S else 'NOT met'})"
    )
    print(f"  freeze -> its answer (load included)     {med(served):6.2f} s")
    if cut_first:
        cut = f"{med(cut_first):6.2f}-{med(cut_last):.2f} s"
        print(f"  freeze -> relays cut with a 504          {cut}"
              f"   (goal: within {GOAL_CUT_S:g} s of the freeze being seen)")  # fmt: skip
    print(f"(logs in {work})")


if __name__ == "__main__":
    main()
