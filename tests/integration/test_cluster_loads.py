"""A model's load for the cluster (``POST /v1/gateways/{name}/loads``) on a bad day: a
lease on a host that is draining, offline or out of the front door's reach still holds
its memory (I4) but is not the model's load any more, and a model whose every host is
down is a 503 naming each host and why. The real controller, workers and gateway
reports through its HTTP API, as agents and gateways send them."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from .conftest import Server, register, wait_for

pytestmark = pytest.mark.timeout(120)


def _report(admin: httpx.Client, gateway: str, worker: str, *models: str) -> None:
    body = {
        "url": f"http://127.0.0.{gateway[-1]}:9",
        "host": worker,
        "worker": worker,
        "models": [{"id": m, "state": "cold", "vram_mb": 6000} for m in models],
    }
    answer = admin.put(f"/v1/gateways/{gateway}", json=body)
    assert answer.status_code == 200, answer.text


def _load(admin: httpx.Client, model: str, **fields: Any) -> httpx.Response:
    return admin.post(
        "/v1/gateways/gw-2/loads", params={"wait": 10}, json={"model": model, **fields}
    )


def _lease(admin: httpx.Client, lease_id: str) -> dict[str, Any]:
    answer = admin.get(f"/v1/leases/{lease_id}")
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


@pytest.fixture
def admin(start_server: Callable[..., Server]) -> Iterator[httpx.Client]:
    """Two hosts, box-2 and box-3, each with a gateway reporting (gw-2, gw-3); ``solo``
    is declared by gw-3 alone."""
    with start_server("--heartbeat-timeout-s", "600").client() as client:  # never offline
        for worker in ("box-2", "box-3"):
            register(client, worker, gpus=1)
        _report(client, "gw-2", "box-2", "chat", "code")
        _report(client, "gw-3", "box-3", "chat", "code", "solo")
        yield client


def test_a_load_on_a_draining_host_is_not_joined_and_keeps_its_memory(
    admin: httpx.Client,
) -> None:
    first = _load(admin, "chat")
    assert first.status_code == 200, first.text
    assert first.json()["state"] == "loading" and not first.json()["joined"]
    again = _load(admin, "chat")
    assert again.json()["id"] == first.json()["id"] and again.json()["joined"]
    host = first.json()["worker"]
    drained = admin.post(f"/v1/workers/{host}/drain", json={})
    assert drained.status_code in (200, 202), drained.text
    after = _load(admin, "chat")
    assert after.status_code == 200, after.text
    assert not after.json()["joined"] and after.json()["id"] != first.json()["id"]
    assert after.json()["worker"] not in (None, host)
    assert _lease(admin, first.json()["id"])["state"] == "loading"  # still held (I4)


def test_a_load_on_a_host_the_front_door_cannot_reach_is_not_joined(admin: httpx.Client) -> None:
    first = _load(admin, "code")
    assert first.status_code == 200, first.text
    host = first.json()["worker"]
    lost = {"box-2": "gw-2", "box-3": "gw-3"}[host]
    other = _load(admin, "code", unreachable=[lost])
    assert other.status_code == 200, other.text
    assert not other.json()["joined"] and other.json()["worker"] not in (None, host)
    assert lost not in other.json()["free_mb"] and host not in other.json()["free_mb"]
    joined = _load(admin, "code", unreachable=[lost])
    assert joined.json()["joined"] and joined.json()["id"] == other.json()["id"]


def test_a_model_whose_only_host_is_out_of_reach_is_a_503_naming_it(admin: httpx.Client) -> None:
    answer = _load(admin, "solo", unreachable=["gw-3"])
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == "2"
    error = answer.json()["error"]
    assert error["code"] == "unavailable"
    assert error["message"] == (
        "solo: its only host box-3 is out of the front door's reach (its gateway gw-3 does "
        "not answer)"
    )
    assert error["details"]["model"] == "solo"
    missing = _load(admin, "nope")
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]


@pytest.mark.parametrize(
    "unreachable",
    [["BAD NAME"], "gw-3", [3], ["gw-" + "x" * 70], ["gw"] * 65, [None]],
    ids=["not-a-name", "not-a-list", "not-text", "too-long", "too-many", "null"],
)
def test_unreachable_is_validated_and_changes_nothing(
    admin: httpx.Client, unreachable: object
) -> None:
    answer = _load(admin, "chat", unreachable=unreachable)
    assert answer.status_code == 422, answer.text
    assert "unreachable" in answer.text
    leases = admin.get("/v1/leases").json()
    assert leases == []


def test_a_model_whose_only_host_is_offline_is_a_503_naming_it_and_since_when(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--heartbeat-timeout-s", "1")
    with server.client() as admin:
        register(admin, "box-3", gpus=1)
        _report(admin, "gw-2", "box-3", "solo")  # a front door beside the lone host
        wait_for(
            lambda: admin.get("/v1/workers/box-3").json()["state"] == "offline",
            what="box-3 offline",
        )
        last = admin.get("/v1/workers/box-3").json()["last_heartbeat_at"]
        since = time.strftime("%H:%M:%S UTC", time.gmtime(last))
        answer = admin.post("/v1/gateways/gw-2/loads", json={"model": "solo"})
        assert answer.status_code == 503, answer.text
        message = answer.json()["error"]["message"]
        assert message == f"solo: its only host box-3 is offline since {since}"


def _withdraw(admin: httpx.Client, gateway: str, model: str) -> dict[str, Any]:
    answer = admin.delete(f"/v1/gateways/{gateway}/loads", params={"model": model})
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


def test_a_load_its_only_front_door_withdraws_ends_at_once_pending_or_loading(
    admin: httpx.Client,
) -> None:
    """Withdrawn by the one front door that asked: a pending load is cancelled, a granted
    one still loading is given back; twice is nothing more."""
    fillers = [
        admin.post("/v1/leases", json={"vram_mb": 24000, "priority": 1000, "ttl_s": 300,
                                       "constraints": {"worker": w}}).json()
        for w in ("box-2", "box-3")
    ]  # fmt: skip
    pending = admin.post("/v1/gateways/gw-2/loads", json={"model": "chat"}).json()
    assert pending["state"] == "pending"
    assert _withdraw(admin, "gw-2", "chat") == {"model": "chat", "ended": [pending["id"]],
                                                "kept": []}  # fmt: skip
    assert _lease(admin, pending["id"])["state"] == "cancelled"
    assert _withdraw(admin, "gw-2", "chat")["ended"] == []  # idempotent
    for filler in fillers:
        assert admin.delete(f"/v1/leases/{filler['id']}").status_code == 200
    loading = _load(admin, "chat").json()
    assert loading["state"] == "loading"
    assert _withdraw(admin, "gw-2", "chat")["ended"] == [loading["id"]]
    assert _lease(admin, loading["id"])["state"] == "released"


def test_a_withdrawn_load_another_front_door_asked_for_is_kept_and_a_serving_one_too(
    admin: httpx.Client,
) -> None:
    first = _load(admin, "chat").json()
    joined = admin.post("/v1/gateways/gw-3/loads", json={"model": "chat"}).json()
    assert joined["id"] == first["id"] and joined["joined"]
    assert _withdraw(admin, "gw-2", "chat") == {"model": "chat", "ended": [],
                                                "kept": [first["id"]]}  # fmt: skip
    assert _lease(admin, first["id"])["state"] == "loading"
    assert _withdraw(admin, "gw-3", "chat")["ended"] == [first["id"]]  # the last one
    serving = _load(admin, "code").json()
    assert admin.post(f"/v1/leases/{serving['id']}/ready").status_code == 200
    assert _withdraw(admin, "gw-2", "code")["kept"] == [serving["id"]]
    assert _lease(admin, serving["id"])["state"] == "active"
    assert _withdraw(admin, "gw-3", "solo") == {"model": "solo", "ended": [], "kept": []}


def test_a_pending_loads_long_poll_answers_when_its_reason_moves(admin: httpx.Client) -> None:
    """A front door that has not read the reason is answered at once (its ``signature``);
    one that has (``after``) once the reason moves (here: the arbiter paused), whenever
    the pause comes: an answer after the whole wait would carry the same signature."""
    for worker in ("box-2", "box-3"):
        filler = {
            "vram_mb": 24000,
            "priority": 1000,
            "ttl_s": 300,
            "constraints": {"worker": worker},
        }
        assert admin.post("/v1/leases", json=filler).status_code == 201
    first = _load(admin, "chat").json()
    assert first["state"] == "pending" and first["signature"], first
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        moved = pool.submit(
            admin.post, "/v1/gateways/gw-2/loads", json={"model": "chat"},
            params={"wait": 60, "after": first["signature"]}, timeout=90,
        )  # fmt: skip
        assert admin.post("/v1/pause").status_code == 200
        answer = moved.result(timeout=90)
    assert answer.status_code == 200, answer.text
    found = answer.json()
    assert found["id"] == first["id"] and found["state"] == "pending"
    assert found["reason"]["code"] == "paused" and found["signature"] != first["signature"]
