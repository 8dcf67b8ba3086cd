"""The event stream: typed, sequenced, filterable, resumable with Last-Event-ID, durable."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from .conftest import Server, events


def read_events(
    client: httpx.Client, count: int, headers: dict[str, str] | None = None, **params: Any
) -> list[dict[str, Any]]:
    """The first ``count`` events the stream sends."""
    found: list[dict[str, Any]] = []
    with client.stream("GET", "/v1/events", params=params, headers=headers or {}) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if "seq" in event:
                    found.append(event)
            if len(found) >= count:
                break
    return found


def test_resume_with_last_event_id(admin: httpx.Client) -> None:
    lease = admin.post("/v1/leases", json={"vram_mb": 1024}).json()
    admin.delete(f"/v1/leases/{lease['id']}")
    everything = events(admin)
    seqs = [e["seq"] for e in everything]
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == len(seqs)
    middle = everything[len(everything) // 2]
    resumed = read_events(admin, 1, headers={"Last-Event-ID": str(middle["seq"])})
    assert resumed[0]["seq"] == middle["seq"] + 1


def test_stream_delivers_live_events_after_the_current_one(admin: httpx.Client) -> None:
    import threading

    got: list[list[dict[str, Any]]] = []
    last = admin.get("/v1/status").json()["last_event"]
    reader = threading.Thread(
        target=lambda: got.append(read_events(admin, 2, headers={"Last-Event-ID": str(last)}))
    )
    reader.start()
    admin.post("/v1/leases", json={"vram_mb": 1024, "holder": "live"})
    reader.join(timeout=60)
    assert got
    assert [e["kind"] for e in got[0]] == ["lease.requested", "lease.granted"]


def test_filters_by_lease_and_worker(admin: httpx.Client) -> None:
    first = admin.post("/v1/leases", json={"vram_mb": 1024}).json()
    second = admin.post("/v1/leases", json={"vram_mb": 1024}).json()
    admin.delete(f"/v1/leases/{second['id']}")
    mine = read_events(admin, 2, since=0, lease=second["id"])
    assert {e["lease_id"] for e in mine} == {second["id"]}
    on_local = read_events(admin, 2, since=0, worker="local")
    assert all(e["worker"] == "local" for e in on_local)
    assert first["id"] in {e["lease_id"] for e in on_local}


def test_events_and_leases_survive_a_restart(start_server: Callable[..., Server]) -> None:
    server = start_server("--simulate", "1x24G")
    with server.client() as admin:
        lease = admin.post("/v1/leases", json={"vram_mb": 1024, "ttl_s": 600}).json()
        before = events(admin)
    server.stop()
    again = start_server("--simulate", "1x24G", state_dir=server.state_dir)
    with again.client() as admin:
        after = events(admin)
        assert after[: len(before)] == before
        assert after[-1]["kind"] == "controller.started"
        kept = admin.get(f"/v1/leases/{lease['id']}").json()
        assert kept["state"] == "loading"
        assert kept["token"] == lease["token"]
        figures = admin.get("/v1/workers/local").json()["gpus"][0]
        assert figures["committed_mb"] == 1024
