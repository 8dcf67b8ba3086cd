"""Every wait ends and no figure lies, through the real server: a revoked holder that keeps
renewing, pending requests the cluster can no longer hold, a GPU registered again smaller
than its leases."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from .conftest import Server, events, gpu_figures, register, wait_for

pytestmark = pytest.mark.timeout(120)

GRACE_S = 10.0  # the controller's policy.grace_s (default)


def _lease(client: httpx.Client, lease_id: str) -> dict[str, object]:
    answer = client.get(f"/v1/leases/{lease_id}")
    assert answer.status_code == 200, answer.text
    found: dict[str, object] = answer.json()
    return found


def _ask(client: httpx.Client, **fields: object) -> dict[str, object]:
    answer = client.post("/v1/leases", json=fields)
    assert answer.status_code < 300, answer.text
    found: dict[str, object] = answer.json()
    return found


def test_a_revoked_holder_that_keeps_renewing_stalls_its_preemptor_at_most_grace_plus_ttl(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--simulate", "1x24G:sm_86")
    with server.client() as admin:
        ttl_s = 1.0
        victim = _ask(admin, vram_mb=20480, priority="batch", ttl_s=ttl_s, holder="victim")
        assert victim["state"] == "loading"
        preemptor = _ask(admin, vram_mb=16384, priority="interactive", holder="preemptor")
        victim_id, preemptor_id = str(victim["id"]), str(preemptor["id"])
        revoked = wait_for(
            lambda: (lease := _lease(admin, victim_id))["state"] == "revoking" and lease,
            what="the victim revoked",
        )
        revoked_at = float(revoked["revoked_at"])  # type: ignore[arg-type]
        statuses: list[int] = []
        refusal = None
        while _lease(admin, preemptor_id)["state"] == "pending":  # it ignores its revocation
            assert time.time() < revoked_at + GRACE_S + ttl_s + 10, "the preemptor still waits"
            answer = admin.post(f"/v1/leases/{victim_id}/renew")
            statuses.append(answer.status_code)
            if answer.status_code == 409 and refusal is None:
                refusal = answer.json()["error"]
                reason = _lease(admin, preemptor_id)["reason"]
                assert reason["blocked_by"] == victim_id  # type: ignore[index]
                assert "has ignored its revocation" in reason["message"]  # type: ignore[index]
            time.sleep(0.3)
        granted = _lease(admin, preemptor_id)
        assert granted["state"] == "loading"
        assert float(granted["granted_at"]) <= revoked_at + GRACE_S + ttl_s + 0.5  # type: ignore[arg-type]
        assert 200 in statuses and statuses[-1] == 409  # renewed in its grace, refused after
        assert refusal is not None and "grace" in refusal["message"]
        assert _lease(admin, victim_id)["state"] == "expired"


def test_pending_requests_end_rejected_when_their_worker_is_removed(server: Server) -> None:
    with server.client() as admin:
        register(admin, "x", gpus=1)
        register(admin, "y", gpus=1)
        _ask(admin, vram_mb=24576, constraints={"worker": "x"}, ttl_s=300)
        queued = _ask(admin, vram_mb=8192, constraints={"worker": "x"})
        anywhere = _ask(admin, vram_mb=8192)
        assert queued["state"] == "pending"
        assert anywhere["state"] == "loading"  # on y

        answer = admin.delete("/v1/workers/x", params={"force": "true"})
        assert answer.status_code == 200, answer.text
        ended = _lease(admin, str(queued["id"]))
        assert (ended["state"], ended["end_reason"]) == ("rejected", "no_matching_gpu")
        fresh = admin.post("/v1/leases", json={"vram_mb": 8192, "constraints": {"worker": "x"}})
        assert fresh.status_code >= 400  # exactly as a new request is answered
        assert fresh.json()["error"]["details"]["reason"]["code"] == "no_matching_gpu"
        (event,) = [e for e in events(admin, "lease.rejected") if e["lease_id"] == queued["id"]]
        assert event["data"]["reason"] == "no_matching_gpu"
        assert "worker=x" in event["data"]["message"]


def test_a_gpu_registered_again_smaller_is_over_committed_never_negative(server: Server) -> None:
    """Accepted (an agent restarting after a driver change must be able to come back), the
    GPU shows no negative figure anywhere, takes no grant until its leases fit, and pending
    requests it can no longer ever hold are rejected."""
    with server.client() as admin:
        register(admin, "y", gpus=1, total_mb=24576)
        on_y = {"worker": "y"}
        held = _ask(admin, vram_mb=20480, ttl_s=300, constraints=on_y)
        too_big = _ask(admin, vram_mb=16384, constraints=on_y)
        small = _ask(admin, vram_mb=1024, constraints=on_y)
        assert (too_big["state"], small["state"]) == ("pending", "pending")

        register(admin, "y", gpus=1, total_mb=8192)  # accepted
        gpu = gpu_figures(admin)["y:0"]
        assert gpu["committed_mb"] == 20480
        assert gpu["free_mb"] == 0
        assert gpu["overcommitted_mb"] == 20480 - 8192
        metrics = admin.get("/metrics").text
        assert "gpu_arbiter_gpu_memory_overcommitted_bytes{" in metrics
        assert not any(
            line.startswith("gpu_arbiter_gpu_memory_free_bytes")
            and line.split()[-1].startswith("-")
            for line in metrics.splitlines()
        )
        ended = _lease(admin, str(too_big["id"]))
        assert (ended["state"], ended["end_reason"]) == ("rejected", "too_large")
        waiting = _lease(admin, str(small["id"]))
        assert waiting["state"] == "pending"  # no grant on an over-committed GPU
        assert all(v["free_mb"] >= 0 for v in waiting["reason"]["gpus"])  # type: ignore[index]
        (registered,) = events(admin, "worker.registered")[-1:]
        assert registered["data"]["overcommitted_mb"] == {"y:0": 20480 - 8192}

        assert admin.delete(f"/v1/leases/{held['id']}").status_code == 200
        assert _lease(admin, str(small["id"]))["state"] == "loading"
        assert gpu_figures(admin)["y:0"]["overcommitted_mb"] == 0
