"""GET /metrics: Prometheus text with the GPU figures, counters and wait times."""

from __future__ import annotations

import httpx


def test_metrics_in_prometheus_text(admin: httpx.Client) -> None:
    admin.post("/v1/leases", json={"vram_mb": 2048})
    answer = admin.get("/metrics")
    assert answer.status_code == 200
    text = answer.text
    assert 'gpu_arbiter_gpu_committed_mb{gpu="local:0",worker="local"} 2048' in text or (
        'gpu_arbiter_gpu_committed_mb{gpu="local:1",worker="local"} 2048' in text
    )
    assert 'gpu_arbiter_scheduler_total{counter="granted"} 1' in text
    assert "gpu_arbiter_wait_seconds_count 1" in text
    assert httpx.get(str(admin.base_url) + "/metrics").status_code == 401
