"""Workers over HTTP: register, heartbeat, drain (graceful, force, deadline), cancel,
offline exactly once, removal, and names that share a prefix."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from .conftest import Server, events, gpu_figures, register, wait_for

GIB = 1024


@pytest.fixture
def cluster(start_server: Callable[..., Server]) -> Iterator[httpx.Client]:
    """A controller without simulated workers (none goes offline during a test)."""
    server = start_server("--heartbeat-timeout-s", "600")
    with server.client() as client:
        yield client


@pytest.fixture
def quiet_cluster(start_server: Callable[..., Server]) -> Iterator[httpx.Client]:
    """A controller where a worker silent for 2 s goes offline."""
    server = start_server("--heartbeat-timeout-s", "2")
    with server.client() as client:
        yield client


def lease_on(client: httpx.Client, worker: str, mb: int = 4 * GIB, **body: Any) -> dict[str, Any]:
    answer = client.post(
        "/v1/leases", json={"vram_mb": mb, "constraints": {"worker": worker}, **body}
    )
    assert answer.status_code in (201, 202), answer.text
    return answer.json()


def active_on(client: httpx.Client, worker: str, mb: int = 4 * GIB) -> dict[str, Any]:
    """A lease that finished loading (the GPU's load gate is free again)."""
    lease = lease_on(client, worker, mb)
    assert lease["state"] == "loading"
    return dict(client.post(f"/v1/leases/{lease['id']}/ready").json())


def state_of(client: httpx.Client, lease: dict[str, Any]) -> str:
    return str(client.get(f"/v1/leases/{lease['id']}").json()["state"])


def worker_state(client: httpx.Client, name: str) -> str:
    return str(client.get(f"/v1/workers/{name}").json()["state"])


def test_register_and_heartbeat_report_gpu_figures(cluster: httpx.Client) -> None:
    register(cluster, "box-1")
    lease = lease_on(cluster, "box-1", 4 * GIB)
    beat = cluster.post(
        "/v1/workers/box-1/heartbeat", json={"gpus": [{"index": 0, "used_mb": 9000}]}
    )
    assert beat.status_code == 200
    assert beat.json() == {
        "name": "box-1",
        "state": "online",
        "leases": [lease["id"]],
        "revoking": [],
    }
    figures = gpu_figures(cluster)
    assert figures["box-1:0"]["used_mb"] == 9000
    assert figures["box-1:0"]["free_mb"] == 24576 - max(9000, figures["box-1:0"]["committed_mb"])
    assert cluster.post("/v1/workers/box-9/heartbeat", json={}).status_code == 404
    unknown_gpu = cluster.post(
        "/v1/workers/box-1/heartbeat", json={"gpus": [{"index": 7, "used_mb": 1}]}
    )
    assert unknown_gpu.status_code == 404


def test_graceful_drain_keeps_leases_then_drained_once_empty(cluster: httpx.Client) -> None:
    register(cluster, "box-1")
    register(cluster, "box-2")
    lease = lease_on(cluster, "box-1")
    answer = cluster.post("/v1/workers/box-1/drain", json={"mode": "graceful"})
    assert answer.status_code == 200
    assert answer.json()["previous_state"] == "online"
    assert answer.json()["state"] == "draining"
    assert answer.json()["revoked"] == 0
    assert state_of(cluster, lease) == "loading"
    blocked = lease_on(cluster, "box-1")
    assert blocked["state"] == "pending"
    assert blocked["reason"]["code"] == "workers_draining"
    anywhere = cluster.post("/v1/leases", json={"vram_mb": 4 * GIB}).json()
    assert anywhere["gpus"][0].startswith("box-2:")
    cluster.delete(f"/v1/leases/{lease['id']}")
    assert worker_state(cluster, "box-1") == "drained"
    assert len(events(cluster, "worker.drained")) == 1


def test_force_drain_revokes_and_keeps_memory_until_release(cluster: httpx.Client) -> None:
    register(cluster, "box-1")
    leases = [active_on(cluster, "box-1") for _ in range(3)]
    answer = cluster.post("/v1/workers/box-1/drain", json={"mode": "force"}).json()
    assert answer["revoked"] == 3
    assert answer["state"] == "draining"
    assert {state_of(cluster, lease) for lease in leases} == {"revoking"}
    committed = sum(g["committed_mb"] for g in gpu_figures(cluster).values())
    assert committed == 3 * 4 * GIB  # I4: memory stays until the holders stop
    for lease in leases:
        cluster.delete(f"/v1/leases/{lease['id']}")
    assert worker_state(cluster, "box-1") == "drained"
    revoked = events(cluster, "lease.revoked")
    assert {e["data"]["reason"] for e in revoked} == {"drain"}


def test_drain_with_deadline_revokes_what_is_left(cluster: httpx.Client) -> None:
    register(cluster, "box-1")
    lease = lease_on(cluster, "box-1")
    cluster.post("/v1/workers/box-1/drain", json={"mode": "graceful", "deadline_s": 0.3})
    cluster.post("/v1/workers/box-1/heartbeat", json={})
    revoked = cluster.get(
        f"/v1/leases/{lease['id']}", params={"wait": 30, "state": "loading"}
    ).json()
    assert revoked["state"] == "revoking"
    assert revoked["revoke_reason"] == "drain_deadline"


def test_cancel_drain_keeps_the_leases(cluster: httpx.Client) -> None:
    register(cluster, "box-1")
    lease = lease_on(cluster, "box-1")
    cluster.post("/v1/workers/box-1/drain", json={})
    answer = cluster.post("/v1/workers/box-1/cancel-drain")
    assert answer.status_code == 200
    assert answer.json()["previous_state"] == "draining"
    assert answer.json()["state"] == "online"
    assert answer.json()["leases_left"] == 1
    assert state_of(cluster, lease) == "loading"
    assert cluster.post("/v1/workers/box-1/cancel-drain").status_code == 409


def test_heartbeat_loss_gives_offline_exactly_once(quiet_cluster: httpx.Client) -> None:
    register(quiet_cluster, "box-1")
    lease = lease_on(quiet_cluster, "box-1")
    wait_for(lambda: worker_state(quiet_cluster, "box-1") == "offline", 30, "offline")
    assert state_of(quiet_cluster, lease) == "loading"  # leases stay committed
    blocked = lease_on(quiet_cluster, "box-1")
    assert blocked["state"] == "pending"
    # watch for longer than the heartbeat timeout: no second offline event
    quiet_cluster.get(f"/v1/leases/{blocked['id']}", params={"wait": 2.5})
    assert len(events(quiet_cluster, "worker.offline")) == 1
    quiet_cluster.post("/v1/workers/box-1/heartbeat", json={})
    assert worker_state(quiet_cluster, "box-1") == "online"
    assert len(events(quiet_cluster, "worker.online")) == 1


def test_drain_then_heartbeat_loss_finishes_the_drain(quiet_cluster: httpx.Client) -> None:
    register(quiet_cluster, "box-1")
    lease = lease_on(quiet_cluster, "box-1")
    quiet_cluster.post("/v1/workers/box-1/drain", json={})
    wait_for(lambda: worker_state(quiet_cluster, "box-1") == "offline", 30, "offline")
    assert state_of(quiet_cluster, lease) == "revoking"
    offline = events(quiet_cluster, "worker.offline")
    assert len(offline) == 1
    assert offline[0]["data"]["revoked"] == 1
    quiet_cluster.post("/v1/workers/box-1/heartbeat", json={"stopped": [lease["id"]]})
    assert state_of(quiet_cluster, lease) == "released"
    assert worker_state(quiet_cluster, "box-1") == "drained"


def test_removal_is_refused_with_leases_unless_forced(cluster: httpx.Client) -> None:
    register(cluster, "box-1")
    lease = lease_on(cluster, "box-1")
    refused = cluster.delete("/v1/workers/box-1")
    assert refused.status_code == 409
    assert worker_state(cluster, "box-1") == "online"
    removed = cluster.delete("/v1/workers/box-1", params={"force": True})
    assert removed.status_code == 200
    assert removed.json()["revoked"] == 1
    ended = cluster.get(f"/v1/leases/{lease['id']}").json()
    assert ended["state"] == "released"
    assert ended["end_reason"] == "worker_removed"
    assert cluster.get("/v1/workers/box-1").status_code == 404
    register(cluster, "box-2")
    empty = cluster.delete("/v1/workers/box-2")
    assert empty.status_code == 200


def test_workers_sharing_a_prefix_never_touch_each_others_leases(cluster: httpx.Client) -> None:
    register(cluster, "gpu")
    register(cluster, "gpu-2")
    mine = lease_on(cluster, "gpu")
    theirs = lease_on(cluster, "gpu-2")
    assert theirs["gpus"][0].startswith("gpu-2:")
    cluster.post("/v1/workers/gpu/heartbeat", json={"stopped": [theirs["id"]]})
    assert state_of(cluster, theirs) == "loading"
    cluster.post("/v1/workers/gpu/drain", json={"mode": "force"})
    assert state_of(cluster, mine) == "revoking"
    assert state_of(cluster, theirs) == "loading"
    listed = cluster.get("/v1/leases", params={"worker": "gpu"}).json()
    assert [x["id"] for x in listed] == [mine["id"]]
    cluster.delete("/v1/workers/gpu", params={"force": True})
    assert state_of(cluster, theirs) == "loading"


def test_agent_reported_stop_releases_a_revoked_lease(cluster: httpx.Client) -> None:
    register(cluster, "box-1")
    lease = lease_on(cluster, "box-1")
    cluster.post(f"/v1/leases/{lease['id']}/revoke")
    assert state_of(cluster, lease) == "revoking"
    told = cluster.post("/v1/workers/box-1/heartbeat", json={}).json()
    assert told["revoking"] == [lease["id"]]
    cluster.post("/v1/workers/box-1/heartbeat", json={"stopped": [lease["id"]]})
    ended = cluster.get(f"/v1/leases/{lease['id']}").json()
    assert ended["state"] == "released"
    assert ended["end_reason"] == "holder_stopped"


def test_per_process_usage_counts_what_a_holder_uses_beyond_its_lease(
    cluster: httpx.Client,
) -> None:
    register(cluster, "box-1", gpus=1)
    lease = active_on(cluster, "box-1", 4 * GIB)
    processes = [
        {"pid": 10, "used_mb": 6 * GIB, "lease": lease["id"]},  # grew past its 4 GiB
        {"pid": 11, "used_mb": 1 * GIB},  # a process the arbiter does not know
    ]
    beat = {"gpus": [{"index": 0, "used_mb": 7 * GIB, "processes": processes}]}
    assert cluster.post("/v1/workers/box-1/heartbeat", json=beat).status_code == 200
    blocked = lease_on(cluster, "box-1", 18 * GIB)
    assert blocked["state"] == "pending"  # 24 - max(4, 6) - 1 = 17 GiB free
    fits = lease_on(cluster, "box-1", 16 * GIB)
    assert fits["state"] == "pending"  # behind the larger request's nomination (I6)
    cluster.delete(f"/v1/leases/{blocked['id']}")
    assert state_of(cluster, fits) == "loading"
