"""A cluster that trusts no one: real controller, agents and gateways, each host's agent
with a worker token and its gateway with a gateway token of its worker (token files),
and an attacker who holds a plain client token, another host's gateway token, or the
peer credential. Each attack is refused and changes nothing: the gateway list, the
lease held, the name still its gateway's, the priority asked."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gpu_arbiter.gateway.cluster.cluster import PEER_OVERLAP_S

from .agents import free_port
from .cluster import cluster_leases, model_leases, served_by
from .conftest import Server, wait_for
from .gateways import chat, model_entry
from .test_cluster import Cluster

pytestmark = pytest.mark.timeout(240)
SERVING_KEY = "sk-serving-host-key"


@pytest.fixture
def cluster(start_server: Callable[..., Server], tmp_path: Path) -> Iterator[Cluster]:
    found = Cluster(start_server("--port", str(free_port())), tmp_path)
    yield found
    for host in reversed(found.hosts):
        host.stop()
    found.admin.close()


def _models(cluster: Cluster, key: str = "") -> str:
    keys = f'[[gateway.keys]]\nkey = "{key}"\nname = "serving"\npriority = "interactive"\n\n'
    entry = model_entry("chat", cluster.record, mb=6000, vram="8G", keep_alive="60s")
    return (keys if key else "") + entry


def _names(admin: httpx.Client) -> dict[str, str]:
    return {g["name"]: g["url"] for g in admin.get("/v1/gateways").json()}


def _refused(answer: httpx.Response, *words: str) -> None:
    assert answer.status_code == 403, answer.text
    for word in words:
        assert word in answer.json()["error"]["message"], answer.text


def test_a_client_token_joins_no_cluster_holds_no_lease_and_takes_no_name(
    cluster: Cluster,
) -> None:
    door = cluster.host(2, "1x4G:sm_86", _models(cluster))
    serving = cluster.host(3, "1x24G:sm_86", _models(cluster))
    cluster.settled("chat")
    with door.gateway.client() as client:
        warm = client.post("/v1/chat/completions", json=chat("chat"))
    assert warm.status_code == 200 and served_by(warm) == "gw-3/chat", warm.text
    (lease,) = cluster_leases(cluster.admin, "chat")
    assert lease["worker"] == "box-3"
    known = _names(cluster.admin)

    # 1. a client token cannot join: no report, no view (no peer credential), no load
    with cluster.server.client(cluster.server.token("client")) as attacker:
        body = {"url": "http://127.0.0.66:9", "worker": "box-3", "models": [
            {"id": "chat", "state": "warm", "replicas": [{"state": "warm"}]}]}  # fmt: skip
        _refused(attacker.put("/v1/gateways/evil", json=body), "a client token may not report")
        view = attacker.get("/v1/gateways/gw-2/cluster")
        _refused(view, "may not read the cluster's view")
        assert "peer_key" not in view.text
        _refused(attacker.post("/v1/gateways/gw-2/loads", json={"model": "chat"}))
        # 2. nor touch the cluster's lease
        for verb in ("renew", "idle", "ready"):
            _refused(attacker.post(f"/v1/leases/{lease['id']}/{verb}"), "the cluster's")
        _refused(attacker.delete(f"/v1/leases/{lease['id']}"))
    # another host's gateway token (gw-2's: it asked for the load) holds it no more
    door_token = door.gateway.token_file.read_text().strip()
    with cluster.server.client(door_token) as other_host:
        _refused(other_host.delete(f"/v1/leases/{lease['id']}"), "granted on box-3")
        _refused(other_host.post(f"/v1/leases/{lease['id']}/idle"), "gateway token of worker box-2")
        body = {"url": "http://127.0.0.66:9", "worker": "box-2"}
        _refused(other_host.put("/v1/gateways/gw-3", json=body), "belongs to another token")
    assert _names(cluster.admin) == known
    (still,) = cluster_leases(cluster.admin, "chat")
    assert still["id"] == lease["id"] and still["state"] in ("loading", "active")
    with door.gateway.client() as client:
        again = client.post("/v1/chat/completions", json=chat("chat"))
    assert again.status_code == 200 and served_by(again) == "gw-3/chat"

    # 3. a stale gateway's name is not free for another token
    serving.gateway.kill()
    wait_for(
        lambda: next(g for g in cluster.admin.get("/v1/gateways").json() if g["name"] == "gw-3")[
            "stale"
        ],
        40,
        "gw-3 stale",
    )
    with cluster.server.client(cluster.server.token("gateway", "box-3")) as newcomer:
        body = {"url": "http://127.0.0.66:9", "worker": "box-3"}
        _refused(newcomer.put("/v1/gateways/gw-3", json=body), "gateways forget gw-3")
    assert _names(cluster.admin)["gw-3"] == known["gw-3"]
    serving.gateway.start()  # the real one, its own token: its reports are taken
    wait_for(
        lambda: _names(cluster.admin).get("gw-3") == serving.gateway.url,
        40,
        "gw-3 reporting again",
    )


def test_the_peer_credential_opens_relays_only_capped_and_dies_with_its_leader(
    cluster: Cluster,
) -> None:
    cluster.host(2, "1x4G:sm_86", _models(cluster))
    serving = cluster.host(3, "1x24G:sm_86", _models(cluster, SERVING_KEY))
    cluster.settled("chat")
    old_key = cluster.admin.get("/v1/gateways/gw-3/cluster").json()["peer_key"]
    url = serving.gateway.url

    def as_peer(
        key: str, method: str, path: str, body: object, priority: int | None = None
    ) -> httpx.Response:
        headers = {"x-arbiter-peer": key, "x-arbiter-via": "gw-2"}
        if priority is not None:
            headers["x-arbiter-priority"] = str(priority)
        return httpx.request(method, url + path, headers=headers, json=body, timeout=60)

    # 4. the credential and no API key: nothing but a relayed model request
    for method, path in (
        ("GET", "/metrics"),
        ("GET", "/admin/routes"),
        ("POST", "/admin/models/chat/pin"),
        ("POST", "/admin/models/chat/unpin"),
        ("POST", "/admin/models/chat/unload"),
    ):
        refused = as_peer(old_key, method, path, {})
        assert refused.status_code == 403, (path, refused.text)
        assert "relayed model requests only" in refused.json()["error"]["message"]
    assert serving.gateway.model_state("chat")["pinned"] is False
    served = as_peer(old_key, "POST", "/v1/chat/completions", chat("chat"), priority=1000)
    assert served.status_code == 200 and served_by(served) == "gw-3/chat", served.text
    (lease,) = model_leases(cluster.admin, "chat")
    assert lease["priority"] == 800  # capped at the highest key of gw-3 (interactive)

    # 5. a new leader's credential: the old one dies within PEER_OVERLAP_S of its view
    cluster.server.kill9()
    cluster.server.start()
    admin = cluster.server.client()
    try:
        new_key = wait_for(
            lambda: admin.get("/v1/gateways/gw-3/cluster").json().get("peer_key"),
            40,
            "gw-3 reporting to the new leader",
        )
        seen_at = time.monotonic()
        assert new_key != old_key

        def refused_old() -> bool:
            answer = as_peer(old_key, "POST", "/v1/chat/completions", chat("nothing"))
            return answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_peer"

        wait_for(refused_old, PEER_OVERLAP_S + 20, "the old credential refused")
        took_s = time.monotonic() - seen_at
        print(f"the old peer credential refused {took_s:.1f}s after the new leader's view")
        assert took_s < PEER_OVERLAP_S + 15  # its view comes within a few seconds
        fresh = as_peer(new_key, "POST", "/v1/chat/completions", chat("nothing"))
        assert fresh.status_code == 404 and fresh.json()["error"]["code"] == "model_not_found"
    finally:
        admin.close()
