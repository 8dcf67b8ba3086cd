"""Over HTTP, a 202 names the lease in its way: an idle interactive lease, its holder, and
when it becomes reclaimable by this request and by which rule (I5: ``idle_reclaim_s``).
Every answer is strict JSON, whatever the leases in the way."""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import httpx

from gpu_arbiter.client import pending_text

from .conftest import Server

GIB = 1024


def test_a_202_names_the_idle_lease_in_its_way_and_its_countdown(admin: httpx.Client) -> None:
    chats = []
    for n in range(2):  # one on each of the two 24 GiB GPUs
        answer = admin.post(
            "/v1/leases",
            json={"vram_mb": "14G", "priority": "interactive", "holder": f"chat-{n}"},
        )
        assert answer.status_code == 201, answer.text
        chats.append(answer.json()["id"])
        assert admin.post(f"/v1/leases/{chats[-1]}/ready").status_code == 200
        assert admin.post(f"/v1/leases/{chats[-1]}/idle").json()["idle"] is True
    waiting = admin.post(
        "/v1/leases", json={"vram_mb": "14G", "priority": "batch", "holder": "indexer"}
    )
    assert waiting.status_code == 202, waiting.text
    reason = waiting.json()["reason"]
    assert reason["code"] == "insufficient_vram"
    blocker = reason["blocker"]
    assert blocker["id"] == chats[0] == reason["blocked_by"]  # the first idle gives way first
    assert blocker["holder"] == "chat-0"
    assert (blocker["state"], blocker["priority_name"]) == ("idle", "interactive")
    assert blocker["rule"] == "idle_reclaim_s"
    assert blocker["until"] - blocker["since"] == 60.0  # the controller's idle_reclaim_s
    message = reason["message"]
    assert f"idle lease {chats[0]} (holder 'chat-0', interactive) on local:" in message
    left = re.search(r"reclaimable by batch in (\d+)s \(idle_reclaim_s\)", message)
    assert left is not None and 0 < int(left.group(1)) <= 60, message
    # the client's words, the queue's and a fresh look say the same
    assert "(idle_reclaim_s)" in pending_text(waiting.json())
    queued = admin.get("/v1/queue").json()
    assert queued[0]["reason"]["blocked_by"] == chats[0]


def _strict_json(answer: httpx.Response) -> Any:
    """The body, read as strict JSON: NaN and Infinity are refused, as any JSON parser
    outside Python refuses them."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in {answer.request.url.path}'s answer")

    return json.loads(answer.text, parse_constant=refuse)


def test_a_202_beside_an_idle_lease_it_may_reclaim_at_once_is_strict_json(
    admin: httpx.Client,
) -> None:
    """On local:0 a warm batch lease, which a normal request may reclaim at once, and a
    busy interactive one it may not preempt: the normal request waits for both. The idle
    lease gave way when the request came (a time past), not at -Infinity: the 202, the
    long-poll, the lease list and the queue are strict JSON (this answered 500)."""
    on_gpu0 = {"gpu_ids": ["local:0"]}
    leases = {}
    for name, size, priority in (("warm", "8G", "batch"), ("big", "12G", "interactive")):
        body = {"vram_mb": size, "priority": priority, "holder": name, "constraints": on_gpu0}
        answer = admin.post("/v1/leases", json=body)
        assert answer.status_code == 201, answer.text
        leases[name] = answer.json()["id"]
        assert admin.post(f"/v1/leases/{leases[name]}/ready").status_code == 200
    assert admin.post(f"/v1/leases/{leases['warm']}/idle").status_code == 200
    body = {"vram_mb": "14G", "holder": "job", "constraints": on_gpu0}
    waiting = admin.post("/v1/leases", json=body)
    assert waiting.status_code == 202, waiting.text
    lease = _strict_json(waiting)
    reason = lease["reason"]
    assert reason["code"] == "insufficient_vram"
    assert reason["blocked_by"] == leases["big"]  # it never gives way: waited for last
    rules = {b["id"]: (b["rule"], b["until"]) for b in reason["blockers"]}
    assert rules[leases["big"]] == ("not_preemptible", None)
    rule, until = rules[leases["warm"]]
    assert rule == "at_once" and until == lease["submitted_at"]
    assert "reclaimable by normal now" in reason["message"]
    polled = admin.get(f"/v1/leases/{lease['id']}", params={"wait": 0.2, "state": "pending"})
    assert polled.status_code == 200
    assert _strict_json(polled)["reason"]["blockers"] == reason["blockers"]
    for path in ("/v1/queue", "/v1/leases"):
        listed = admin.get(path)
        assert listed.status_code == 200
        _strict_json(listed)


async def _churn(client: httpx.AsyncClient, seed: int, rounds: int) -> list[str]:
    """One client's load: lease, wait a little, load, keep warm or not, release; the
    statuses it got that were not a lease's (a 5xx, or a body that is not strict JSON)."""
    rng = random.Random(seed)
    wrong = []
    for _ in range(rounds):
        body = {
            "vram_mb": rng.choice([2048, 6144, 12288, 20480]),
            "gpus": rng.choice([1, 1, 2]),
            "priority": rng.choice([100, 300, 500, 800, 1000]),
            "holder": f"c{seed}",
        }
        answers = [await client.post("/v1/leases", json=body)]
        lease = answers[0].json() if answers[0].status_code in (201, 202) else None
        if lease is not None and lease["state"] == "pending":
            path = f"/v1/leases/{lease['id']}"
            answers.append(await client.get(path, params={"wait": 0.3, "state": "pending"}))
            lease = answers[-1].json() if answers[-1].status_code == 200 else None
        if lease is not None and lease["state"] == "loading":
            answers.append(await client.post(f"/v1/leases/{lease['id']}/ready"))
            if rng.random() < 0.5:
                answers.append(await client.post(f"/v1/leases/{lease['id']}/idle"))
            await asyncio.sleep(rng.random() * 0.1)
        if lease is not None:
            answers.append(await client.delete(f"/v1/leases/{lease['id']}"))
        for answer in answers:
            try:
                _strict_json(answer)
            except (AssertionError, ValueError) as error:
                wrong.append(f"{answer.request.url.path}: {error}")
            if answer.status_code >= 500:
                wrong.append(f"{answer.request.url.path}: {answer.status_code} {answer.text}")
    return wrong


async def test_a_concurrent_create_release_load_answers_strict_json_only(server: Server) -> None:
    """Clients of every priority and size create, wait, keep warm and release at once: no
    answer is a 5xx and every body is strict JSON."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with server.async_client(limits=limits) as client, asyncio.TaskGroup() as group:
        loops = [group.create_task(_churn(client, seed, 6)) for seed in range(32)]
    assert [w for loop in loops for w in loop.result()] == []
    assert "JSON cannot carry" not in server.log.read_text()
