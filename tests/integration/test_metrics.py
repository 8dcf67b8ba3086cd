"""GET /metrics: parsed with prometheus-client's parser, it agrees with /v1/status and
/v1/workers of the same server after a scripted workload."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Server, events, register, wait_for

MIB = 1024 * 1024
Samples = dict[str, dict[frozenset[tuple[str, str]], float]]


def scrape(client: httpx.Client) -> Samples:
    """Every sample of ``/metrics``: name -> labels -> value."""
    answer = client.get("/metrics")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == CONTENT_TYPE_LATEST
    samples: Samples = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            labels = frozenset(sample.labels.items())
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def one(samples: Samples, name: str, **labels: str) -> float:
    return samples[name][frozenset(labels.items())]


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: value for labels, value in samples[name].items()}


def create(client: httpx.Client, vram: str, **body: Any) -> httpx.Response:
    return client.post("/v1/leases", json={"holder": "metrics", "vram_mb": vram, **body})


def lease(client: httpx.Client, lease_id: str) -> dict[str, Any]:
    found: dict[str, Any] = client.get(f"/v1/leases/{lease_id}").json()
    return found


@pytest.fixture
def busy(start_server: Callable[..., Server]) -> Server:
    """Two 24 GiB GPUs of ``local`` and one 8 GiB GPU of ``w2``, after: six grants, two
    releases, a rejection, a preemption, an admin revoke, a forced drain, a TTL lapse,
    and two requests left pending (priorities 100 and 200)."""
    server = start_server("--simulate", "2x24G:sm_86", "--heartbeat-timeout-s", "600")
    with server.client() as admin:
        register(admin, "w2", gpus=1, total_mb=8192)
        batch = [create(admin, "20G", priority="batch", ttl_s=3600) for _ in range(2)]
        assert [a.status_code for a in batch] == [201, 201]
        assert create(admin, "100G").status_code == 422  # rejected: no GPU is that big
        preemptor = create(admin, "20G", priority="critical", ttl_s=3600)
        assert preemptor.status_code == 202
        ids = [a.json()["id"] for a in batch]
        victim = next(i for i in ids if lease(admin, i)["state"] == "revoking")
        assert admin.delete(f"/v1/leases/{victim}").status_code == 200
        assert lease(admin, preemptor.json()["id"])["state"] == "loading"
        other = next(i for i in ids if i != victim)
        assert admin.post(f"/v1/leases/{other}/revoke").json()["state"] == "revoking"
        assert admin.delete(f"/v1/leases/{other}").status_code == 200
        on_w2 = create(admin, "4G", constraints={"worker": "w2"}, ttl_s=3600)
        assert on_w2.status_code == 201
        drained = admin.post("/v1/workers/w2/drain", json={"mode": "force"})
        assert drained.status_code == 200, drained.text
        short = create(admin, "1G", ttl_s=0.2)
        assert short.status_code == 201
        wait_for(lambda: lease(admin, short.json()["id"])["state"] == "expired", what="lapse")
        assert create(admin, "20G", ttl_s=3600).status_code == 201
        for priority in ("batch", 200):
            assert create(admin, "20G", priority=priority, ttl_s=3600).status_code == 202
    return server


def test_counters_count_the_workload(busy: Server) -> None:
    with busy.client() as admin:
        samples = scrape(admin)
        granted = len(events(admin, "lease.granted"))
    assert granted == 6
    assert one(samples, "gpu_arbiter_grants_total") == granted
    assert one(samples, "gpu_arbiter_requests_submitted_total") == 8
    assert one(samples, "gpu_arbiter_requests_rejected_total") == 1
    assert one(samples, "gpu_arbiter_preemptions_total") == 1
    assert one(samples, "gpu_arbiter_leases_released_total") == 2
    assert one(samples, "gpu_arbiter_leases_expired_total") == 1
    revocations = by_label(samples, "gpu_arbiter_revocations_total", "reason")
    assert revocations["preempted"] == 1
    assert revocations["revoked_by_admin"] == 1
    assert revocations["drain"] == 1
    assert revocations["drain_deadline"] == 0
    assert one(samples, "gpu_arbiter_wait_seconds_count") == granted
    assert one(samples, "gpu_arbiter_wait_seconds_bucket", le="+Inf") == granted
    assert one(samples, "gpu_arbiter_grant_latency_seconds_count") == granted
    assert one(samples, "gpu_arbiter_grant_latency_seconds_sum") > 0


def test_counters_agree_with_status(busy: Server) -> None:
    with busy.client() as admin:
        samples = scrape(admin)
        counters = admin.get("/v1/status").json()["counters"]
    names = {
        "gpu_arbiter_grants_total": "granted",
        "gpu_arbiter_preemptions_total": "preemptions",
        "gpu_arbiter_requests_submitted_total": "submitted",
        "gpu_arbiter_requests_rejected_total": "rejected",
        "gpu_arbiter_requests_cancelled_total": "cancelled",
        "gpu_arbiter_requests_timed_out_total": "timed_out",
        "gpu_arbiter_leases_released_total": "released",
        "gpu_arbiter_leases_expired_total": "expired",
    }
    for name, key in names.items():
        assert one(samples, name) == counters.get(key, 0), name
    for reason, value in by_label(samples, "gpu_arbiter_revocations_total", "reason").items():
        assert value == counters.get(f"revoked:{reason}", 0), reason


def test_gauges_agree_with_status_and_workers(busy: Server) -> None:
    with busy.client() as admin:
        samples = scrape(admin)
        status = admin.get("/v1/status").json()
        workers = admin.get("/v1/workers").json()
    assert by_label(samples, "gpu_arbiter_queue_depth", "priority") == {
        "100": 1,
        "200": 1,
        "300": 0,
        "500": 0,
        "800": 0,
        "1000": 0,
    }
    assert status["pending_by_priority"] == {"100": 1, "200": 1}
    states = by_label(samples, "gpu_arbiter_workers", "state")
    assert states == {"online": 0, "draining": 0, "drained": 0, "offline": 0} | dict(
        Counter(w["state"] for w in workers)
    )
    assert states["draining"] == 1  # w2: its revoked lease has not ended yet
    held = by_label(samples, "gpu_arbiter_leases", "state")
    assert held == {"loading": 0, "active": 0, "revoking": 0} | status["leases_by_state"]
    assert held["revoking"] == 1
    assert one(samples, "gpu_arbiter_paused") == 0


def test_per_gpu_figures_agree_with_workers(busy: Server) -> None:
    with busy.client() as admin:
        samples = scrape(admin)
        workers = admin.get("/v1/workers").json()
    gpus = [(w["name"], gpu) for w in workers for gpu in w["gpus"]]
    assert len(gpus) == 3
    for worker, gpu in gpus:
        labels = {"worker": worker, "gpu": gpu["id"], "index": str(gpu["index"])}
        labels["model"] = gpu["model"]
        for field in ("total", "capacity", "committed", "free"):
            value = one(samples, f"gpu_arbiter_gpu_memory_{field}_bytes", **labels)
            assert value == gpu[f"{field}_mb"] * MIB, (gpu["id"], field)
        assert one(samples, "gpu_arbiter_gpu_loads_in_progress", **labels) == gpu["loading"]
    committed = sum(samples["gpu_arbiter_gpu_memory_committed_bytes"].values())
    assert committed == (20 + 20 + 4) * 1024 * MIB  # the preemptor, the last grant, w2's


def test_a_running_update_shows_until_it_ends(admin: httpx.Client) -> None:
    register(admin, "w3")
    assert by_label(scrape(admin), "gpu_arbiter_worker_updating", "worker") == {
        "local": 0,
        "w3": 0,
    }
    assert admin.post("/v1/workers/w3/update").status_code == 202
    assert one(scrape(admin), "gpu_arbiter_worker_updating", worker="w3") == 1
    assert admin.post("/v1/workers/w3/cancel-drain").status_code == 200  # ends the update
    assert one(scrape(admin), "gpu_arbiter_worker_updating", worker="w3") == 0


def test_pause_shows(admin: httpx.Client) -> None:
    assert one(scrape(admin), "gpu_arbiter_paused") == 0
    assert admin.post("/v1/pause").status_code == 200
    assert one(scrape(admin), "gpu_arbiter_paused") == 1


def test_metrics_need_a_valid_token(server: Server) -> None:
    assert httpx.get(server.url + "/metrics").status_code == 401
    bad = {"Authorization": "Bearer gat_not-a-real-token"}
    assert httpx.get(server.url + "/metrics", headers=bad).status_code == 401
    with server.client(server.token("client")) as client:
        assert one(scrape(client), "gpu_arbiter_ready") == 1
