"""Over HTTP, a 202 names the lease in its way: an idle interactive lease, its holder, and
when it becomes reclaimable by this request and by which rule (I5: ``idle_reclaim_s``)."""

from __future__ import annotations

import re

import httpx

from gpu_arbiter.client import pending_text

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
