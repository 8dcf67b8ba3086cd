"""A stream waiting for the cluster's load of a model sees what the queue says of it (the
host nearest to taking it, the lease in its way, when), and ``gpu-arbiter models`` and
every front door's ``GET /v1/models`` list the model ``queued``, until the lease in its
way goes and the stream is served. Real controller, agents and gateways on 127.0.0.N,
the test model server as the model's server."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from typing import Any

import httpx
import pytest

from .cluster import cluster_leases
from .conftest import wait_for
from .gateways import chat, model_entry
from .test_cli import cli
from .test_cluster import Cluster, cluster

__all__ = ["cluster"]  # the fixture, shared with test_cluster.py

pytestmark = pytest.mark.timeout(180)


def _entry(url: str, model: str) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"{url}/v1/models/{model}", timeout=10).json()
    return found


def _listed_queued(url: str, lease_id: str, blocker: str) -> None:
    """``GET /v1/models`` at ``url`` lists chat queued for the cluster's load."""
    entry = wait_for(
        lambda: (e := _entry(url, "chat"))["state"] == "queued" and e,
        what=f"chat queued at {url}",
    )
    assert entry["load"]["lease"] == lease_id and entry["load"]["asked_by"] == ["gw-2"]
    assert blocker in entry["pending_reason"] and "box-3 (gw-3)" in entry["pending_reason"]


def _printed_queued(cluster: Cluster, given: tuple[str, ...], blocker: str) -> None:
    """``gpu-arbiter models`` (``given``: at a front door, or none: the reports) shows chat
    queued, with the lease in its way, in its table and as JSON."""
    listed = cli(cluster.server, "models", *given)
    assert listed.returncode == 0, listed.stderr
    assert "chat" in listed.stdout and "queued:" in listed.stdout, listed.stdout
    as_json = cli(cluster.server, "models", "--json", *given)
    assert as_json.returncode == 0, as_json.stderr
    rows = [m for g in json.loads(as_json.stdout) for m in g["models"] if m["id"] == "chat"]
    assert len(rows) == (1 if given else 2), rows  # through the controller: each host's
    for row in rows:
        assert row["state"] == "queued", row
        assert blocker in row["pending_reason"] and "box-3:0" in row["pending_reason"]


def test_a_stream_waiting_for_a_cluster_load_says_what_the_queue_says(cluster: Cluster) -> None:
    models = model_entry("chat", cluster.record, mb=6000, vram="8G", queue_timeout="120s")
    door = cluster.host(2, "1x4G:sm_86", models)  # too small for it
    big = cluster.host(3, "1x24G:sm_86", models)  # the only GPU it fits
    cluster.settled("chat")
    made = cluster.admin.post(
        "/v1/leases",
        json={"vram_mb": 20480, "holder": "train", "ttl_s": 600,
              "constraints": {"worker": "box-3"}},
    )  # fmt: skip
    assert made.status_code == 201, made.text
    blocker = made.json()["id"]
    assert cluster.admin.post(f"/v1/leases/{blocker}/ready").status_code == 200

    lines: list[str] = []
    began = threading.Event()

    def stream() -> tuple[int, list[str]]:
        with (
            httpx.Client(timeout=httpx.Timeout(60, read=120)) as client,
            client.stream(
                "POST", door.gateway.url + "/v1/chat/completions", json=chat("chat", stream=True)
            ) as answer,
        ):
            began.set()
            for line in answer.iter_lines():
                lines.append(line)
            return answer.status_code, lines

    def said(*words: str) -> bool:
        return any(line.startswith(":") and all(w in line for w in words) for line in lines)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream)
        try:
            wait_for(
                lambda: said("nearest host box-3 (gw-3)", "box-3:0 insufficient_vram", blocker),
                what="a comment line naming box-3, gw-3 and the lease in the way",
            )
            assert said("queued for the cluster, position 1", "holder 'train'", "not preemptible")
            (load,) = cluster_leases(cluster.admin, "chat")
            assert load["state"] == "pending"

            for host in (door, big):  # the front door that asked, and one that did not
                _listed_queued(host.gateway.url, load["id"], blocker)
            assert _entry(door.gateway.url, "chat")["queued"] == 1
            for given in (("--gateway", door.gateway.url), ()):  # a front door; the reports
                _printed_queued(cluster, given, blocker)
        except AssertionError as error:
            raise AssertionError(f"{error}; the stream so far: {lines}") from None
        finally:  # the lease in the way goes: the load is granted, the stream served
            assert cluster.admin.delete(f"/v1/leases/{blocker}").status_code == 200
        status, found = streaming.result(timeout=120)
    assert status == 200
    assert any(line.startswith("data: {") for line in found), found
    assert found[-1] == "data: [DONE]" or found[-2:] == ["data: [DONE]", ""], found
    (lease,) = cluster_leases(cluster.admin, "chat")
    assert lease["worker"] == "box-3" and lease["state"] == "active"
