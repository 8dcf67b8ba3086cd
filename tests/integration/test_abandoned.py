"""I8's dual through the real HTTP API: a client that asks for a lease, long-polls it and
is killed (SIGKILL) has its request ended ``abandoned`` one ``ttl_s`` after its poll
closed; a grant made after its asker died is given back ``unclaimed`` (before its TTL
could lapse), and the next request is granted."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from .agents import env_for
from .conftest import Server, events, wait_for

ASKER = """
import sys, time, httpx
url, token, ttl, poll = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "poll"
with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=90) as c:
    lease = c.post("/v1/leases", json={"vram_mb": "20G", "holder": "asker", "ttl_s": ttl}).json()
    print(lease["id"], lease["state"], flush=True)
    while True:
        if poll:
            c.get(f"/v1/leases/{lease['id']}", params={"wait": 60, "state": "pending"})
        else:
            time.sleep(60)
"""


def asker(server: Server, ttl_s: float, poll: bool) -> tuple[subprocess.Popen[str], str]:
    """A client process (a token of its own) that asks for 20 GiB and, with ``poll``,
    long-polls its request (60 s each) until it is killed."""
    mode = "poll" if poll else "sleep"
    proc = subprocess.Popen(
        [sys.executable, "-c", ASKER, server.url, server.token("client"), str(ttl_s), mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lease_id, state = proc.stdout.readline().split()
    assert state == "pending"
    return proc, lease_id


def kill9(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(timeout=30)
    assert proc.stdout is not None
    proc.stdout.close()


def lease(client: httpx.Client, lease_id: str) -> dict[str, Any]:
    answer = client.get(f"/v1/leases/{lease_id}")
    assert answer.status_code == 200
    found: dict[str, Any] = answer.json()
    return found


def hold_everything(admin: httpx.Client) -> str:
    answer = admin.post(
        "/v1/leases", json={"vram_mb": "20G", "gpus": 2, "holder": "big", "ttl_s": 3600}
    )
    assert answer.status_code == 201, answer.text
    held: str = answer.json()["id"]
    return held


def test_a_killed_askers_pending_request_ends_abandoned(
    server: Server, admin: httpx.Client
) -> None:
    hold_everything(admin)
    proc, lease_id = asker(server, ttl_s=2.0, poll=True)
    time.sleep(0.5)  # its first long-poll starts (were it not open yet, it was seen anyway)
    kill9(proc)
    killed_at = time.time()
    assert lease(admin, lease_id)["state"] == "pending"  # a read by others is no presence
    ended = wait_for(
        lambda: (found := lease(admin, lease_id))["state"] != "pending" and found,
        90,
        "the request to end",
    )
    assert (ended["state"], ended["end_reason"]) == ("cancelled", "abandoned")
    assert ended["ended_at"] >= killed_at + 2.0 - 0.5  # never before its ttl_s (clock skew)
    # its open long-poll (60 s) ended with its connection, not at the end of its wait
    assert ended["ended_at"] < killed_at + 60.0
    kinds = [
        (e["kind"], e["data"].get("reason")) for e in events(admin) if e.get("lease_id") == lease_id
    ]
    assert ("lease.cancelled", "abandoned") in kinds


def test_a_grant_made_after_its_asker_died_is_given_back_and_the_next_is_granted(
    server: Server, admin: httpx.Client
) -> None:
    big = hold_everything(admin)
    proc, orphan = asker(server, ttl_s=60.0, poll=False)
    kill9(proc)
    assert admin.delete(f"/v1/leases/{big}").status_code == 200
    granted = lease(admin, orphan)  # an admin's read is not its holder's
    assert granted["state"] == "loading"
    nxt = admin.post(
        "/v1/leases", json={"vram_mb": "20G", "gpus": 2, "holder": "next", "ttl_s": 60}
    )
    assert nxt.status_code == 202
    next_id = nxt.json()["id"]
    answer = admin.get(f"/v1/leases/{next_id}", params={"wait": 60, "state": "pending"})
    ended = lease(admin, orphan)
    assert (ended["state"], ended["end_reason"]) == ("released", "unclaimed")  # not expired
    assert answer.json()["state"] == "loading"
    assert ended["ended_at"] < granted["granted_at"] + 60.0


def test_run_keeps_its_request_alive_while_it_waits_longer_than_its_ttl(
    server: Server, admin: httpx.Client, tmp_path: Path
) -> None:
    """``gpu-arbiter run`` waits with a long-poll that is open all along: a wait of
    several TTLs does not end its request; once memory frees it runs its command."""
    big = hold_everything(admin)
    command = [sys.executable, "-m", "gpu_arbiter", "run", "--controller", server.url]
    command += ["--token", server.token("client"), "--vram", "20G", "--ttl", "2"]
    command += ["--holder", "patient", "--", "true"]
    proc = subprocess.Popen(command, env=env_for(tmp_path), stderr=subprocess.PIPE)
    try:
        [asked] = wait_for(
            lambda: [x for x in admin.get("/v1/leases").json() if x["holder"] == "patient"] or None,
            60,
            "run's request",
        )
        time.sleep(6.0)  # three of its TTLs (its long-poll waits 30 s)
        assert lease(admin, asked["id"])["state"] == "pending"
        assert admin.delete(f"/v1/leases/{big}").status_code == 200
        assert proc.wait(timeout=90) == 0
    finally:  # a run that does not end fails the test, never hangs the suite
        if proc.poll() is None:
            proc.kill()
        _, stderr = proc.communicate(timeout=30)
        print(stderr.decode(errors="replace"))
    done = lease(admin, asked["id"])
    assert (done["state"], done["end_reason"]) == ("released", "released")
