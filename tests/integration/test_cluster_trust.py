"""A cluster that trusts no one: real controller, agents and gateways, each host's agent
with a worker token and its gateway with a gateway token of its worker (token files),
and an attacker who holds a plain client token, another host's gateway token, or a
relay's signed header. Each attack is refused and changes nothing: the gateway list,
the lease held, the name and key still its gateway's, the priority asked."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_arbiter.peer_identity import Identity, PublicKey, Relayed, decode_key

from .agents import free_port
from .cluster import cluster_leases, model_leases, routable, served_by
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


def _routes(admin: httpx.Client, gateway: str) -> list[dict[str, Any]]:
    found = next(g for g in admin.get("/v1/gateways").json() if g["name"] == gateway)
    return list(found["routes"])


def test_a_peers_word_proves_its_sender_opens_relays_only_and_is_taken_once(
    cluster: Cluster,
) -> None:
    """gw-2's gateway token (the real gateway's own, from its token file) in an
    attacker's hands: it may report a gateway of its own beside box-2 (gw-9, its own key),
    whose signed relays gw-3 takes, for model requests only, at a priority capped by
    gw-3's keys, and records as gw-9's, verified. It cannot speak as another host's
    gateway: gw-3's name (and key) is gw-3's token's, and a relay signed as gw-2 with any
    key but the one the real gw-2 reported is refused. A signed header that leaked is
    refused when sent again, to another gateway, or with another path; a key replaced
    (its gateway restarted) is refused once the serving gateway's view shows the new
    one. The real gateways' own relays go on through a new leader."""
    door = cluster.host(2, "1x4G:sm_86", _models(cluster))
    serving = cluster.host(3, "1x24G:sm_86", _models(cluster, SERVING_KEY))
    cluster.settled("chat")
    url = serving.gateway.url
    stolen = door.gateway.token_file.read_text().strip()
    own = Identity("gw-9")
    attacker = cluster.server.client(stolen)

    def report(name: str, identity: Identity) -> httpx.Response:
        body = {"url": "http://127.0.0.66:9", "worker": "box-2", "public_key": identity.public_key}
        return attacker.put(f"/v1/gateways/{name}", json=body)

    def gw3_key() -> PublicKey:
        """gw-3's public key as the view shows it (a relay is made with the key its
        sender shares with it)."""
        found = {g["name"]: g["public_key"] for g in _view(cluster)["gateways"]}
        return decode_key(found["gw-3"])

    def as_peer(
        signer: Identity,
        method: str,
        path: str,
        body: object,
        priority: int | None = None,
    ) -> tuple[httpx.Response, dict[str, str]]:
        given = "" if priority is None else str(priority)
        relayed = Relayed(method, path.encode(), given)
        headers = {"x-arbiter-peer": signer.sign("gw-3", gw3_key(), relayed)}
        if priority is not None:
            headers["x-arbiter-priority"] = given
        answer = httpx.request(method, url + path, headers=headers, json=body, timeout=60)
        return answer, headers

    def code(signer: Identity) -> str:
        """gw-3's error code for ``GET /metrics`` signed by ``signer``: permission_denied
        when its relay is taken (a peer's word opens no metrics), else invalid_peer."""
        return str(as_peer(signer, "GET", "/metrics", {})[0].json()["error"]["code"])

    def refused(answer: httpx.Response, *words: str) -> None:
        assert answer.status_code == 403, answer.text
        assert answer.json()["error"]["code"] == "invalid_peer", answer.text
        for word in words:
            assert word in answer.json()["error"]["message"], answer.text

    try:
        # 4. its own gateway: taken, for a relayed model request only, priority capped
        assert report("gw-9", own).status_code == 200
        wait_for(lambda: code(own) == "permission_denied", 20, "gw-9's key in gw-3's view")
        for method, path in (
            ("GET", "/metrics"),
            ("GET", "/admin/routes"),
            ("GET", "/v1/models"),
            ("POST", "/admin/models/chat/pin"),
            ("POST", "/admin/models/chat/unpin"),
            ("POST", "/admin/models/chat/unload"),
        ):
            answer, _ = as_peer(own, method, path, {})
            assert answer.status_code == 403, (path, answer.text)
            assert "relayed model requests only" in answer.json()["error"]["message"]
        assert serving.gateway.model_state("chat")["pinned"] is False
        served, _ = as_peer(own, "POST", "/v1/chat/completions", chat("chat"), priority=1000)
        assert served.status_code == 200 and served_by(served) == "gw-3/chat", served.text
        (lease,) = model_leases(cluster.admin, "chat")
        assert lease["priority"] == 800  # capped at the highest key of gw-3 (interactive)
        wait_for(
            lambda: any(r.get("from") == "gw-9" and r.get("verified") is True
                        for r in _routes(cluster.admin, "gw-3")),
            20, "gw-3's report naming gw-9's relay, verified",
        )  # fmt: skip

        # 5. not another's: its name, its key, its signature
        taken = report("gw-3", own)
        assert taken.status_code == 403 and "belongs to another token" in taken.text
        theirs = {g["name"]: g["public_key"] for g in _view(cluster)["gateways"]}
        assert theirs["gw-9"] == own.public_key
        assert own.public_key not in (theirs["gw-2"], theirs["gw-3"]) and theirs["gw-3"]
        forged = Identity("gw-2")  # signs as gw-2, with a key that is not gw-2's
        answer, _ = as_peer(forged, "POST", "/v1/chat/completions", chat("chat"))
        refused(answer, "does not verify with the key this gateway shares with gateway gw-2's")
        answer, _ = as_peer(Identity("gw-7"), "POST", "/v1/chat/completions", chat("chat"))
        refused(answer, "gw-7 is not in this gateway's view")

        # 6. a leaked header: taken once, for one gateway and one request
        path = "/v1/chat/completions"
        first, leaked = as_peer(own, "POST", path, chat("nothing"))
        assert first.json()["error"]["code"] == "model_not_found", first.text  # taken
        again = httpx.post(url + path, headers=leaked, json=chat("chat"), timeout=30)
        refused(again, "replay")
        elsewhere = httpx.post(
            door.gateway.url + path, headers=leaked, json=chat("chat"), timeout=30
        )
        refused(elsewhere, "made for gateway gw-3, not for this one (gw-2)")
        other = {"x-arbiter-peer": own.sign("gw-3", gw3_key(), Relayed("POST", b"/v1/embeddings"))}
        moved = httpx.post(url + path, headers=other, json=chat("chat"), timeout=30)
        refused(moved, "altered")
        # 7. a key replaced: the old one refused once gw-3's view shows the new one
        renewed = Identity("gw-9")
        assert report("gw-9", renewed).status_code == 200
        reported_at = time.monotonic()
        wait_for(lambda: code(own) == "invalid_peer", 20, "gw-9's old key refused")
        print(f"a replaced key refused {time.monotonic() - reported_at:.2f}s after its report")
        assert code(renewed) == "permission_denied"
        assert cluster.admin.delete("/v1/gateways/gw-9").status_code == 200
    finally:
        attacker.close()

    # 8. a new leader: the real gateways report their keys again, and relay on
    cluster.server.kill9()
    cluster.server.start()
    admin = cluster.server.client()
    try:
        wait_for(
            lambda: (
                (view := admin.get("/v1/gateways/gw-3/cluster")).status_code == 200
                and len(view.json()["gateways"]) == 2
            ),
            40,
            "both reporting again (gw-3's view is a 404 until gw-3 reported)",
        )
        wait_for(lambda: routable(admin, cluster.hosts, "chat"), 40, "every host routable")
        with door.gateway.client() as client:
            again = client.post("/v1/chat/completions", json=chat("chat"))
        assert again.status_code == 200 and served_by(again) == "gw-3/chat", again.text
    finally:
        admin.close()


def _view(cluster: Cluster, admin: httpx.Client | None = None) -> dict[str, Any]:
    answer = (admin or cluster.admin).get("/v1/gateways/gw-3/cluster")
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found
