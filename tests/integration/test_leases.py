"""The lease lifecycle over HTTP: grant, pending, long-poll, renew, lapse, idempotency,
shrink, exact GPUs."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_arbiter.agent.probes import report_usage

from .conftest import Server, events, gpu_figures, wait_for

GIB = 1024


def create(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post("/v1/leases", json={"holder": "test", **body})


def test_lifecycle_grant_ready_renew_idle_release(admin: httpx.Client) -> None:
    answer = create(admin, vram_mb="8G", ttl_s=30)
    assert answer.status_code == 201
    lease = answer.json()
    assert lease["state"] == "loading"
    assert lease["gpus"] in (["local:0"], ["local:1"])
    assert lease["vram_mb"] == 8 * GIB
    assert gpu_figures(admin)[lease["gpus"][0]]["committed_mb"] == 8 * GIB

    ready = admin.post(f"/v1/leases/{lease['id']}/ready").json()
    assert ready["state"] == "active"
    assert not ready["loading"]
    renewed = admin.post(f"/v1/leases/{lease['id']}/renew", json={"ttl_s": 120}).json()
    assert renewed["expires_at"] > lease["expires_at"]
    assert admin.post(f"/v1/leases/{lease['id']}/idle").json()["idle"] is True
    assert admin.post(f"/v1/leases/{lease['id']}/busy").json()["idle"] is False

    released = admin.delete(f"/v1/leases/{lease['id']}")
    assert released.status_code == 200
    assert released.json()["state"] == "released"
    again = admin.delete(f"/v1/leases/{lease['id']}")
    assert again.status_code == 200
    assert again.json()["state"] == "released"
    assert gpu_figures(admin)[lease["gpus"][0]]["committed_mb"] == 0
    kinds = [e["kind"] for e in events(admin) if e["lease_id"] == lease["id"]]
    assert kinds == [
        "lease.requested",
        "lease.granted",
        "lease.ready",
        "lease.idle",
        "lease.busy",
        "lease.released",
    ]


def test_pending_request_is_granted_on_release_and_long_poll_wakes(admin: httpx.Client) -> None:
    first = [create(admin, vram_mb="20G").json() for _ in range(2)]
    assert {lease["state"] for lease in first} == {"loading"}
    waiting = create(admin, vram_mb="20G")
    assert waiting.status_code == 202
    pending = waiting.json()
    assert pending["state"] == "pending"
    assert pending["position"] == 1
    assert pending["reason"]["code"] == "insufficient_vram"
    assert "0/2 GPUs fit" in pending["reason"]["message"]
    queue = admin.get("/v1/queue").json()
    assert [item["id"] for item in queue] == [pending["id"]]

    answers: list[httpx.Response] = []
    poll = threading.Thread(
        target=lambda: answers.append(
            admin.get(f"/v1/leases/{pending['id']}", params={"wait": 30, "state": "pending"})
        )
    )
    poll.start()
    admin.delete(f"/v1/leases/{first[0]['id']}")
    poll.join(timeout=60)
    assert answers
    assert answers[0].json()["state"] == "loading"
    assert answers[0].json()["gpus"] == first[0]["gpus"]


def test_long_poll_answers_unchanged_when_the_wait_ends(admin: httpx.Client) -> None:
    lease = create(admin, vram_mb="1G").json()
    answer = admin.get(f"/v1/leases/{lease['id']}", params={"wait": 0.2})
    assert answer.status_code == 200
    assert answer.json()["state"] == "loading"


def test_unrenewed_lease_lapses_and_renewing_it_then_conflicts(admin: httpx.Client) -> None:
    lease = create(admin, vram_mb="4G", ttl_s=0.3).json()
    lapsed = admin.get(f"/v1/leases/{lease['id']}", params={"wait": 30, "state": "loading"})
    lapsed = lapsed.json()
    assert lapsed["state"] == "expired"
    assert gpu_figures(admin)[lease["gpus"][0]]["committed_mb"] == 0
    answer = admin.post(f"/v1/leases/{lease['id']}/renew")
    assert answer.status_code == 409
    assert answer.json()["error"]["details"]["state"] == "expired"


def test_renewing_keeps_a_lease_past_its_first_ttl(admin: httpx.Client) -> None:
    lease = create(admin, vram_mb="4G", ttl_s=3.0).json()
    for _ in range(4):  # 4 waits of a third of the TTL each: longer than the TTL in all
        renewed = admin.post(f"/v1/leases/{lease['id']}/renew")
        assert renewed.status_code == 200
        polled = admin.get(f"/v1/leases/{lease['id']}", params={"wait": 1.0})
        assert polled.json()["state"] == "loading"


def test_idempotent_create_returns_the_same_lease(admin: httpx.Client) -> None:
    first = create(admin, vram_mb="6G", idempotency_key="job-42")
    second = create(admin, vram_mb="6G", idempotency_key="job-42")
    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert second.status_code == 201  # still held: granted
    assert second.headers["idempotent-replayed"] == "true"
    assert second.json()["id"] == first.json()["id"]
    assert second.json()["token"] == first.json()["token"]
    assert sum(g["committed_mb"] for g in gpu_figures(admin).values()) == 6 * GIB
    different = create(admin, vram_mb="7G", idempotency_key="job-42")
    assert different.status_code == 409
    assert different.json()["error"]["code"] == "conflict"
    admin.delete(f"/v1/leases/{first.json()['id']}")
    after_release = create(admin, vram_mb="6G", idempotency_key="job-42")
    assert after_release.status_code == 409
    assert after_release.headers["idempotent-replayed"] == "true"
    error = after_release.json()["error"]
    assert error["code"] == "lease_ended"
    assert error["details"] == {
        "lease_id": first.json()["id"],
        "state": "released",
        "reason": "released",
    }


def _not_granted(answer: httpx.Response, lease_id: str | None = None) -> dict[str, Any]:
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert error["code"] == "not_granted"
    assert error["message"].endswith("before it was granted")
    if lease_id is not None:
        assert error["details"]["lease_id"] == lease_id
    details: dict[str, Any] = error["details"]
    return details


def test_201_means_granted_and_nothing_else(admin: httpx.Client) -> None:
    held = [create(admin, vram_mb="20G", idempotency_key=f"held-{i}") for i in range(2)]
    assert [a.status_code for a in held] == [201, 201]
    at_once = create(admin, vram_mb="20G", max_wait_s=0)  # busy: it cannot wait at all
    details = _not_granted(at_once)
    assert (details["state"], details["reason"]) == ("timed_out", "max_wait")
    assert "timed_out (max_wait)" in at_once.json()["error"]["message"]
    assert admin.get(f"/v1/leases/{details['lease_id']}").json()["state"] == "timed_out"

    waiting = create(admin, vram_mb="20G", idempotency_key="wait")
    assert waiting.status_code == 202
    again = create(admin, vram_mb="20G", idempotency_key="wait")
    assert (again.status_code, again.headers["idempotent-replayed"]) == (202, "true")
    assert again.json()["state"] == "pending"
    admin.delete(f"/v1/leases/{waiting.json()['id']}")  # cancelled: never granted
    cancelled = create(admin, vram_mb="20G", idempotency_key="wait")
    assert cancelled.headers["idempotent-replayed"] == "true"
    assert _not_granted(cancelled, waiting.json()["id"])["state"] == "cancelled"

    revoked = held[0].json()
    admin.post(f"/v1/leases/{revoked['id']}/revoke")
    replay = create(admin, vram_mb="20G", idempotency_key="held-0")
    assert (replay.status_code, replay.json()["state"]) == (201, "revoking")  # still held
    assert replay.headers["idempotent-replayed"] == "true"


def test_cancel_pending_is_idempotent(admin: httpx.Client) -> None:
    create(admin, vram_mb="24G")
    create(admin, vram_mb="24G")
    pending = create(admin, vram_mb="24G").json()
    assert pending["state"] == "pending"
    for _ in range(2):
        answer = admin.delete(f"/v1/leases/{pending['id']}")
        assert answer.status_code == 200
        assert answer.json()["state"] == "cancelled"
    assert admin.get("/v1/queue").json() == []


def test_request_no_gpu_could_ever_satisfy_is_rejected(admin: httpx.Client) -> None:
    answer = create(admin, vram_mb="80G")
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["code"] == "unschedulable"
    assert error["details"]["reason"]["code"] == "too_large"
    arch = create(admin, vram_mb="1G", constraints={"gpu_arch": ["sm_90"]})
    assert arch.json()["error"]["details"]["reason"]["code"] == "no_matching_gpu"
    assert admin.get("/v1/leases").json() == []


def test_fencing_tokens_strictly_increase(admin: httpx.Client) -> None:
    tokens = []
    for _ in range(5):
        lease = create(admin, vram_mb="1G").json()
        tokens.append(lease["token"])
        admin.delete(f"/v1/leases/{lease['id']}")
    assert tokens == sorted(set(tokens))


def test_max_wait_times_out(admin: httpx.Client) -> None:
    create(admin, vram_mb="24G")
    create(admin, vram_mb="24G")
    pending = create(admin, vram_mb="24G", max_wait_s=0.2).json()
    ended = admin.get(f"/v1/leases/{pending['id']}", params={"wait": 30, "state": "pending"})
    ended = ended.json()
    assert ended["state"] == "timed_out"


def test_pause_holds_grants_until_resume(admin: httpx.Client) -> None:
    assert admin.post("/v1/pause").json() == {"paused": True}
    pending = create(admin, vram_mb="1G")
    assert pending.status_code == 202
    assert pending.json()["reason"]["code"] == "paused"
    assert admin.get("/v1/status").json()["paused"] is True
    admin.post("/v1/resume")
    assert admin.get(f"/v1/leases/{pending.json()['id']}").json()["state"] == "loading"


def test_listing_filters_by_state_worker_and_holder(admin: httpx.Client) -> None:
    a = create(admin, vram_mb="1G", holder="alice").json()
    create(admin, vram_mb="1G", holder="bob")
    admin.delete(f"/v1/leases/{a['id']}")
    assert [x["holder"] for x in admin.get("/v1/leases", params={"holder": "bob"}).json()] == [
        "bob"
    ]
    released = admin.get("/v1/leases", params={"state": "released"}).json()
    assert [x["id"] for x in released] == [a["id"]]
    assert len(admin.get("/v1/leases", params={"worker": "local"}).json()) == 2
    assert admin.get("/v1/leases", params={"worker": "other"}).json() == []


def test_pending_limit_per_holder_answers_429(start_server: Any, tmp_path: Any) -> None:
    config = tmp_path / "arbiter.toml"
    config.write_text('[serve]\nmax_pending_per_holder = 2\nsimulate = "1x8G"\n')
    server: Server = start_server("--config", str(config))
    with server.client() as admin:
        create(admin, vram_mb="8G")
        assert create(admin, vram_mb="8G").status_code == 202
        assert create(admin, vram_mb="8G").status_code == 202
        refused = create(admin, vram_mb="8G")
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "too_many_requests"
        assert create(admin, vram_mb="8G", holder="other").status_code == 202


def test_the_config_files_policy_reaches_the_scheduler(
    start_server: Callable[..., Server], tmp_path: Path
) -> None:
    """The load gate: one load per GPU by default; ``max_concurrent_loads = 2`` in the
    file's ``[policy]`` lets two loads run at once on the one GPU."""
    config = tmp_path / "arbiter.toml"
    config.write_text("[policy]\nmax_concurrent_loads = 2\n")
    for file, loading in ((None, 1), (config, 2)):
        args = ("--simulate", "1x24G") + (("--config", str(file)) if file else ())
        with start_server(*args).client() as admin:
            states = [create(admin, vram_mb="4G").json()["state"] for _ in range(3)]
            assert states == ["loading"] * loading + ["pending"] * (3 - loading)


# ---------------------------------------------------------------- shrink and exact GPUs


def _heartbeats_seen(admin: httpx.Client, worker: str, count: int) -> None:
    """Returns once the controller has taken ``count`` more heartbeats from ``worker``."""
    for _ in range(count):
        seen = _last_heartbeat(admin, worker)
        wait_for(lambda s=seen: _last_heartbeat(admin, worker) > s, what="a heartbeat")


def _last_heartbeat(admin: httpx.Client, worker: str) -> float:
    found = admin.get(f"/v1/workers/{worker}").json()["last_heartbeat_at"]
    return float(found or 0.0)


@pytest.mark.timeout(180)
def test_memory_a_shrink_frees_is_granted_once_the_heartbeat_probe_shows_it_free(
    start_server: Callable[..., Server], tmp_path: Path, cleanup: list[Any]
) -> None:
    """A model server put to sleep: its lease shrinks at once, but a request that needs the
    freed memory waits until the agent's probe shows it free (I2, I4), then is granted."""
    from .agents import AgentProcess, worker_state

    server = start_server()
    admin = server.client()
    cleanup.append(admin)
    runtime = tmp_path / "rt"
    agent = AgentProcess(server.url, server.admin_token, "box-a", runtime, "1x24G:sm_86")
    cleanup.append(agent.start())
    wait_for(lambda: worker_state(admin, "box-a") == "online", what="box-a online")
    usage = runtime / "fake-box-a"  # the fake probe's usage directory (a process reports)
    client = server.client(server.token("client"))
    cleanup.append(client)

    sleeper = create(client, vram_mb="20G", ttl_s=120).json()
    assert sleeper["state"] == "loading"
    report_usage({0: 20 * GIB}, usage_dir=usage, pid=os.getpid())  # the server loaded
    wait_for(lambda: gpu_figures(admin)["box-a:0"]["used_mb"] == 20 * GIB, what="usage")
    assert client.post(f"/v1/leases/{sleeper['id']}/ready").is_success

    shrunk = client.post(f"/v1/leases/{sleeper['id']}/shrink", json={"vram_mb": "1G"})
    assert shrunk.status_code == 200, shrunk.text
    assert (shrunk.json()["vram_mb"], shrunk.json()["token"]) == (GIB, sleeper["token"])
    assert gpu_figures(admin)["box-a:0"]["committed_mb"] == GIB
    waiter = create(client, vram_mb="16G", ttl_s=120)
    assert waiter.status_code == 202
    waiting = waiter.json()
    assert waiting["reason"]["code"] == "insufficient_vram"
    _heartbeats_seen(admin, "box-a", 2)  # the probe still shows the memory in use
    still = admin.get(f"/v1/leases/{waiting['id']}").json()
    assert (still["state"], still["reason"]["code"]) == ("pending", "insufficient_vram")

    report_usage({0: GIB}, usage_dir=usage, pid=os.getpid())  # the server went to sleep
    granted = admin.get(f"/v1/leases/{waiting['id']}", params={"wait": 30, "state": "pending"})
    assert granted.json()["state"] == "loading"
    assert granted.json()["gpus"] == ["box-a:0"]
    assert gpu_figures(admin)["box-a:0"]["committed_mb"] == GIB + 16 * GIB
    (event,) = events(admin, "lease.shrunk")
    assert event["lease_id"] == sleeper["id"]
    assert (event["data"]["from_mb"], event["data"]["vram_mb"]) == (20 * GIB, GIB)

    # waking: the full lease again, through the queue, on the very GPU the process lives on
    admin.delete(f"/v1/leases/{waiting['id']}")
    wake = create(client, vram_mb="23G", constraints={"gpu_ids": ["box-a:0"]})
    assert wake.status_code == 202  # beside the sleeping lease's 1G and its 1G in use
    assert wake.json()["reason"]["code"] == "insufficient_vram"
    client.delete(f"/v1/leases/{sleeper['id']}")
    report_usage({}, usage_dir=usage, pid=os.getpid())
    woke = admin.get(f"/v1/leases/{wake.json()['id']}", params={"wait": 30, "state": "pending"})
    assert (woke.json()["state"], woke.json()["gpus"]) == ("loading", ["box-a:0"])


def test_a_wake_never_preempts_the_lease_it_extends(start_server: Callable[..., Server]) -> None:
    """A higher priority's lease of the difference on a sleeping lease's GPU, naming it in
    ``constraints.never_preempt``, waits rather than revoke it; the same request without
    the name preempts it (the priority and the memory make it a victim)."""
    server = start_server("--simulate", "1x24G:sm_86")
    with server.client() as admin:
        asleep = create(admin, vram_mb="20G", priority="batch", preemptible=True).json()
        admin.post(f"/v1/leases/{asleep['id']}/ready").raise_for_status()
        exact = {"gpu_ids": asleep["gpus"], "never_preempt": [asleep["id"]]}
        wake = create(admin, vram_mb="8G", priority="interactive", constraints=exact)
        assert wake.status_code == 202, wake.text
        assert wake.json()["constraints"]["never_preempt"] == [asleep["id"]]
        assert admin.get(f"/v1/leases/{asleep['id']}").json()["state"] == "active"
        admin.delete(f"/v1/leases/{wake.json()['id']}").raise_for_status()
        other = create(admin, vram_mb="8G", priority="interactive", constraints={
            "gpu_ids": asleep["gpus"]})  # fmt: skip
        assert other.status_code == 202
        revoked = admin.get(f"/v1/leases/{asleep['id']}", params={"wait": 30, "state": "active"})
        assert revoked.json()["state"] == "revoking"


def test_a_shrink_is_stored_before_it_is_answered(start_server: Callable[..., Server]) -> None:
    """I9: after kill -9 and a restart the lease has its shrunk size."""
    server = start_server("--simulate", "1x24G:sm_86")
    with server.client() as admin:
        lease = create(admin, vram_mb="8G", ttl_s=300).json()
        assert admin.post(f"/v1/leases/{lease['id']}/shrink", json={"vram_mb": 300}).is_success
    server.kill9()
    server.start()
    with server.client() as admin:
        after = admin.get(f"/v1/leases/{lease['id']}").json()
        assert (after["state"], after["token"], after["vram_mb"]) == (
            "loading",
            lease["token"],
            300,
        )
        assert gpu_figures(admin)["local:0"]["committed_mb"] == 300


def test_shrink_refuses_bad_input_growth_and_leases_not_held(
    server: Server, cleanup: list[Any]
) -> None:
    admin = server.client()
    cleanup.append(admin)
    lease = create(admin, vram_mb="8G").json()
    shrink = f"/v1/leases/{lease['id']}/shrink"
    for body in ({"vram_mb": 0}, {"vram_mb": "lots"}, {"vram_mb": True}, {}, {"size": 1}):
        answer = admin.post(shrink, json=body)
        assert answer.status_code == 422, body
        error = answer.json()["error"]
        assert error["code"] == "invalid_input"
        assert "vram_mb" in error["message"] or "size" in error["message"], error
    grow = admin.post(shrink, json={"vram_mb": "9G"})
    assert grow.status_code == 409
    assert "grows only through a new grant" in grow.json()["error"]["message"]
    assert grow.json()["error"]["details"]["field"] == "vram_mb"
    assert admin.get(f"/v1/leases/{lease['id']}").json()["vram_mb"] == 8 * GIB
    assert gpu_figures(admin)[lease["gpus"][0]]["committed_mb"] == 8 * GIB
    assert admin.post(shrink, json={"vram_mb": "8G"}).json()["vram_mb"] == 8 * GIB  # no-op
    assert events(admin, "lease.shrunk") == []

    assert admin.post("/v1/leases/lease-nobody/shrink", json={"vram_mb": 1}).status_code == 404
    create(admin, vram_mb="20G")
    pending = create(admin, vram_mb="20G").json()
    assert pending["state"] == "pending"
    refused = admin.post(f"/v1/leases/{pending['id']}/shrink", json={"vram_mb": 1})
    assert (refused.status_code, refused.json()["error"]["details"]["state"]) == (409, "pending")
    admin.delete(f"/v1/leases/{lease['id']}")
    ended = admin.post(shrink, json={"vram_mb": 1})
    assert (ended.status_code, ended.json()["error"]["details"]["state"]) == (409, "released")

    for held in admin.get("/v1/leases").json():
        admin.delete(f"/v1/leases/{held['id']}")
    owner = server.client(server.token("client"))
    stranger = server.client(server.token("client"))
    cleanup.extend((owner, stranger))
    mine = create(owner, vram_mb="2G").json()
    assert mine["state"] == "loading"
    assert stranger.post(f"/v1/leases/{mine['id']}/shrink", json={"vram_mb": 1}).status_code == 403
    assert owner.post(f"/v1/leases/{mine['id']}/shrink", json={"vram_mb": 1}).status_code == 200


def test_a_request_for_exact_gpus(admin: httpx.Client) -> None:
    exact = create(admin, vram_mb="1G", constraints={"gpu_ids": ["local:1"]})
    assert exact.status_code == 201
    lease = exact.json()
    assert (lease["gpus"], lease["gpu_count"]) == (["local:1"], 1)
    assert lease["constraints"]["gpu_ids"] == ["local:1"]
    both = create(admin, vram_mb="1G", constraints={"gpu_ids": ["local:1", "local:0"]}).json()
    assert (both["gpu_count"], both["constraints"]["gpu_ids"]) == (2, ["local:0", "local:1"])
    unknown = create(admin, vram_mb="1G", constraints={"gpu_ids": ["local:7"]})
    assert unknown.status_code == 422
    assert unknown.json()["error"]["details"]["reason"]["code"] == "no_matching_gpu"
    assert "local:7" in unknown.json()["error"]["message"]
    for body, field in (
        ({"constraints": {"gpu_ids": ["local:0", "other:0"]}}, "constraints.gpu_ids"),
        ({"constraints": {"gpu_ids": ["local"]}}, "constraints.gpu_ids"),
        ({"constraints": {"gpu_ids": []}}, "constraints.gpu_ids"),
        ({"gpus": 1, "constraints": {"gpu_ids": ["local:0", "local:1"]}}, "gpus"),
    ):
        answer = create(admin, vram_mb="1G", **body)
        assert answer.status_code == 422, body
        assert answer.json()["error"]["message"].startswith(field), answer.json()
    assert len(admin.get("/v1/leases").json()) == 2


async def test_the_client_shrinks_a_lease(server: Server) -> None:
    from gpu_arbiter.client import ApiError, ArbiterClient

    async with ArbiterClient(server.url, token=server.admin_token) as client:
        lease = await client.create_lease(vram_mb="4G", constraints={"gpu_ids": ["local:1"]})
        assert lease["gpus"] == ["local:1"]
        assert (await client.shrink(lease["id"], "512M"))["vram_mb"] == 512
        with pytest.raises(ApiError) as grown:
            await client.shrink(lease["id"], 513)
        assert (grown.value.status, grown.value.code) == (409, "conflict")
