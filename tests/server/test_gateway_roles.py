"""Who may be a gateway, in process (the app over a memory store, no socket): a client
or worker token is refused every gateway route (403 naming its role and what it may
do), a gateway token reports and asks leases beside its own worker only, and the
cluster's lease is held by the gateway token of the worker it was granted on (its
asker, a front door on another host, only while it is pending)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gpu_arbiter.controller import Controller
from gpu_arbiter.core import Constraints
from gpu_arbiter.peer_identity import Identity
from gpu_arbiter.server.app import create_app
from gpu_arbiter.server.auth import Authenticator, create_token
from gpu_arbiter.server.routes import _on_worker
from gpu_arbiter.store import MemoryStore


class Cluster:
    """The app, an admin client, and a token of each role by name."""

    def __init__(self, http: httpx.AsyncClient, tokens: dict[str, str]) -> None:
        self.http = http
        self.tokens = tokens

    def as_(self, who: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.tokens[who]}"}

    async def report(self, who: str, name: str, worker: str | None, **more: Any) -> httpx.Response:
        model = {"id": "chat", "state": "cold", "vram_mb": 1000}
        body = {"url": "http://127.0.0.9:1", "worker": worker, "models": [model], **more}
        return await self.http.put(f"/v1/gateways/{name}", json=body, headers=self.as_(who))


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    store = MemoryStore()
    tokens = {
        "admin": create_token(store, "admin")[0],
        "client": create_token(store, "client")[0],
        "worker-3": create_token(store, "worker", "box-3")[0],
        "gw-2": create_token(store, "gateway", "box-2")[0],
        "gw-3": create_token(store, "gateway", "box-3")[0],
        "gw-3b": create_token(store, "gateway", "box-3")[0],
    }
    app = create_app(Controller(store), Authenticator(store))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http,
    ):
        found = Cluster(http, tokens)
        for worker in ("box-2", "box-3"):
            gpus = [{"index": 0, "total_mb": 24576, "headroom_mb": 0}]
            answer = await http.post(
                "/v1/workers", json={"name": worker, "gpus": gpus}, headers=found.as_("admin")
            )
            assert answer.status_code == 201, answer.text
        yield found


def _refused(answer: httpx.Response, *words: str) -> None:
    assert answer.status_code == 403, answer.text
    message = answer.json()["error"]["message"]
    for word in words:
        assert word in message, message


async def test_a_client_or_worker_token_is_no_gateway(cluster: Cluster) -> None:
    for who in ("client", "worker-3"):
        _refused(await cluster.report(who, "gw-9", "box-3"), "may not report a gateway", "may ")
    assert (await cluster.report("gw-3", "gw-3", "box-3")).status_code == 200
    http, client = cluster.http, cluster.as_("client")
    _refused(
        await http.get("/v1/gateways/gw-3/cluster", headers=client),
        "a client token may not read the cluster's view",
        "it may ask for leases",
    )
    _refused(
        await http.post("/v1/gateways/gw-3/loads", json={"model": "chat"}, headers=client),
        "may not ask for the cluster's loads",
    )
    _refused(
        await http.delete("/v1/gateways/gw-3/loads", params={"model": "chat"}, headers=client),
        "may not withdraw",
    )
    _refused(await http.get("/v1/gateways/gw-3/commands", headers=client), "commands")
    listed = (await http.get("/v1/gateways", headers=cluster.as_("admin"))).json()
    assert [g["name"] for g in listed] == ["gw-3"]


async def test_a_gateway_token_reports_beside_its_own_worker_and_keeps_its_name(
    cluster: Cluster,
) -> None:
    _refused(await cluster.report("gw-3", "gw-3", "box-2"), "gateway token of worker box-3")
    _refused(await cluster.report("gw-3", "gw-3", None), "beside no worker")
    assert (await cluster.report("gw-3", "gw-3", "box-3")).status_code == 200
    # another gateway token, of the same worker even, cannot take the name
    taken = await cluster.report("gw-3b", "gw-3", "box-3", url="http://127.0.0.66:1")
    _refused(taken, "belongs to another token", "gateways forget gw-3")
    _refused(await cluster.http.delete("/v1/gateways/gw-3", headers=cluster.as_("gw-3b")))
    (view,) = (await cluster.http.get("/v1/gateways", headers=cluster.as_("admin"))).json()
    assert view["url"] == "http://127.0.0.9:1"
    # an admin forgets it: the name is free for the new token
    forgotten = await cluster.http.delete("/v1/gateways/gw-3", headers=cluster.as_("admin"))
    assert forgotten.status_code == 200
    assert (await cluster.report("gw-3b", "gw-3", "box-3")).status_code == 200


async def test_a_gateways_public_key_is_its_names_and_shown_in_the_cluster_view(
    cluster: Cluster,
) -> None:
    """The key a gateway reports is bound to its name (its token's): the view shows it to
    the other gateways, a new one changes the view's signature (their long-polls answer),
    another token cannot replace it, and a key that is not one is refused (422 naming
    ``public_key``) and changes nothing."""
    http = cluster.http
    first, second = Identity("gw-3").public_key, Identity("gw-3").public_key
    assert (await cluster.report("gw-3", "gw-3", "box-3", public_key=first)).status_code == 200
    assert (await cluster.report("gw-2", "gw-2", "box-2")).status_code == 200  # none: allowed

    async def view() -> dict[str, Any]:
        answer = await http.get("/v1/gateways/gw-2/cluster", headers=cluster.as_("gw-2"))
        assert answer.status_code == 200, answer.text
        found: dict[str, Any] = answer.json()
        assert "peer_key" not in found  # no credential is shared any more
        return found

    before = await view()
    assert {g["name"]: g["public_key"] for g in before["gateways"]} == {"gw-2": None, "gw-3": first}
    for bad in ("", "x" * 42, "+" * 43, first[:-2], first + "AA", 7, "a" * 65):
        refused = await cluster.report("gw-3", "gw-3", "box-3", public_key=bad)
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["message"].startswith("public_key: "), refused.text
    taken = await cluster.report("gw-3b", "gw-3", "box-3", public_key=second)
    _refused(taken, "belongs to another token")
    still = await view()
    assert still["signature"] == before["signature"]
    assert {g["name"]: g["public_key"] for g in still["gateways"]} == {"gw-2": None, "gw-3": first}
    assert (await cluster.report("gw-3", "gw-3", "box-3", public_key=second)).status_code == 200
    after = await view()
    assert {g["name"]: g["public_key"] for g in after["gateways"]}["gw-3"] == second
    assert after["signature"] != before["signature"]


async def test_a_gateway_token_asks_leases_on_its_own_worker_only(cluster: Cluster) -> None:
    def ask(**constraints: Any) -> dict[str, Any]:
        return {"vram_mb": 100, "holder": "gw", "constraints": constraints}

    http, gw = cluster.http, cluster.as_("gw-3")
    _refused(await http.post("/v1/leases", json=ask(), headers=gw), "beyond worker box-3")
    beyond = ask(workers=["box-2", "box-3"])
    _refused(await http.post("/v1/leases", json=beyond, headers=gw), "beyond worker box-3")
    other = ask(gpu_ids=["box-2:0"])
    _refused(await http.post("/v1/leases", json=other, headers=gw), "beyond worker box-3")
    own = await http.post("/v1/leases", json=ask(worker="box-3"), headers=gw)
    assert own.status_code == 201, own.text
    lease = own.json()["id"]
    assert (await http.post(f"/v1/leases/{lease}/idle", headers=gw)).status_code == 200
    _refused(await http.post(f"/v1/leases/{lease}/idle", headers=cluster.as_("gw-3b")))


def test_a_request_is_on_a_worker_only_when_every_gpu_it_may_take_is() -> None:
    assert _on_worker(Constraints.build(worker="box-3"), "box-3")
    assert _on_worker(Constraints.build(gpu_ids=["box-3:0", "box-3:1"]), "box-3")
    assert _on_worker(Constraints.build(workers=["box-3"]), "box-3")
    assert not _on_worker(Constraints.build(), "box-3")
    assert not _on_worker(Constraints.build(worker="box-2"), "box-3")
    assert not _on_worker(Constraints.build(workers=["box-3", "box-2"]), "box-3")
    assert not _on_worker(Constraints.build(worker="box-3"), None)


async def test_the_clusters_lease_is_held_by_the_gateway_of_its_worker(cluster: Cluster) -> None:
    http = cluster.http
    assert (await cluster.report("gw-2", "gw-2", "box-2", models=[])).status_code == 200
    assert (await cluster.report("gw-3", "gw-3", "box-3")).status_code == 200
    asked = await http.post(
        "/v1/gateways/gw-2/loads", json={"model": "chat"}, headers=cluster.as_("gw-2")
    )
    assert asked.status_code == 200, asked.text
    lease = asked.json()
    assert lease["worker"] == "box-3" and lease["state"] == "loading"
    for verb in ("renew", "idle", "ready"):
        for who in ("gw-2", "client", "worker-3"):  # its asker too, once granted
            _refused(await http.post(f"/v1/leases/{lease['id']}/{verb}", headers=cluster.as_(who)))
    _refused(
        await http.delete(f"/v1/leases/{lease['id']}", headers=cluster.as_("gw-2")),
        "the cluster's, granted on box-3",
    )
    held = await http.post(f"/v1/leases/{lease['id']}/renew", headers=cluster.as_("gw-3"))
    assert held.status_code == 200 and held.json()["state"] == "loading"
    gone = await http.delete(f"/v1/leases/{lease['id']}", headers=cluster.as_("gw-3"))
    assert gone.status_code == 200 and gone.json()["state"] == "released"


async def test_a_front_door_withdraws_its_pending_load_and_may_not_end_a_joined_one(
    cluster: Cluster,
) -> None:
    http = cluster.http
    assert (await http.post("/v1/pause", headers=cluster.as_("admin"))).status_code == 200
    assert (await cluster.report("gw-2", "gw-2", "box-2", models=[])).status_code == 200
    assert (await cluster.report("gw-3", "gw-3", "box-3")).status_code == 200
    asked = await http.post(
        "/v1/gateways/gw-3/loads", json={"model": "chat"}, headers=cluster.as_("gw-3")
    )
    lease = asked.json()
    assert lease["state"] == "pending"
    joined = await http.post(
        "/v1/gateways/gw-2/loads", json={"model": "chat"}, headers=cluster.as_("gw-2")
    )
    assert joined.json()["id"] == lease["id"] and joined.json()["joined"] is True
    withdrawn = await http.delete(
        "/v1/gateways/gw-3/loads", params={"model": "chat"}, headers=cluster.as_("gw-3")
    )
    assert withdrawn.json()["kept"] == [lease["id"]]  # gw-2 still waits
    # gw-2 only joined it: its withdrawal does not end gw-3's request
    withdrawn = await http.delete(
        "/v1/gateways/gw-2/loads", params={"model": "chat"}, headers=cluster.as_("gw-2")
    )
    assert withdrawn.json()["kept"] == [lease["id"]]
    # while pending, its asker may cancel it
    cancelled = await http.delete(f"/v1/leases/{lease['id']}", headers=cluster.as_("gw-3"))
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
