"""Bad input: wrong types, negative, zero, huge, missing, malformed, oversized, unknown ids.

Every answer is a 4xx in the error shape, the server keeps running, and the state
afterwards is exactly the state before."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import Server, register

_VALID: dict[str, Any] = {"vram_mb": 1024}

LEASE_BODIES: dict[str, Any] = {
    "vram_mb missing": {},
    "vram_mb text": {"vram_mb": "lots"},
    "vram_mb negative": {"vram_mb": -1},
    "vram_mb zero": {"vram_mb": 0},
    "vram_mb zero text": {"vram_mb": "0G"},
    "vram_mb huge": {"vram_mb": 1 << 50},
    "vram_mb float": {"vram_mb": 1.5},
    "vram_mb bool": {"vram_mb": True},
    "vram_mb null": {"vram_mb": None},
    "vram_mb list": {"vram_mb": [1]},
    "gpus zero": {**_VALID, "gpus": 0},
    "gpus negative": {**_VALID, "gpus": -1},
    "gpus huge": {**_VALID, "gpus": 10**9},
    "gpus text": {**_VALID, "gpus": "2"},
    "gpus float": {**_VALID, "gpus": 1.5},
    "priority huge": {**_VALID, "priority": 1001},
    "priority negative": {**_VALID, "priority": -1},
    "priority unknown name": {**_VALID, "priority": "urgent"},
    "priority float": {**_VALID, "priority": 2.5},
    "preemptible text": {**_VALID, "preemptible": "yes"},
    "preemptible number": {**_VALID, "preemptible": 1},
    "ttl zero": {**_VALID, "ttl_s": 0},
    "ttl negative": {**_VALID, "ttl_s": -5},
    "ttl huge": {**_VALID, "ttl_s": 1e12},
    "ttl text": {**_VALID, "ttl_s": "30"},
    "ttl null": {**_VALID, "ttl_s": None},
    "max_wait negative": {**_VALID, "max_wait_s": -1},
    "load_timeout zero": {**_VALID, "load_timeout_s": 0},
    "holder too long": {**_VALID, "holder": "h" * 300},
    "holder number": {**_VALID, "holder": 5},
    "metadata list": {**_VALID, "metadata": [1, 2]},
    "metadata too many keys": {**_VALID, "metadata": {f"k{i}": i for i in range(40)}},
    "metadata too large": {**_VALID, "metadata": {"blob": "x" * 5000}},
    "idempotency key empty": {**_VALID, "idempotency_key": ""},
    "idempotency key too long": {**_VALID, "idempotency_key": "k" * 300},
    "unknown field": {**_VALID, "colour": "blue"},
    "constraints not object": {**_VALID, "constraints": "sm_86"},
    "constraints unknown field": {**_VALID, "constraints": {"speed": "fast"}},
    "gpu_arch not list": {**_VALID, "constraints": {"gpu_arch": "sm_86"}},
    "gpu_arch malformed": {**_VALID, "constraints": {"gpu_arch": ["sm 86!"]}},
    "capability malformed": {**_VALID, "constraints": {"min_compute_capability": "eight"}},
    "capability bool": {**_VALID, "constraints": {"min_compute_capability": True}},
    "never_preempt not list": {**_VALID, "constraints": {"never_preempt": "lease-1"}},
    "never_preempt bad id": {**_VALID, "constraints": {"never_preempt": ["a b"]}},
    "never_preempt too many": {
        **_VALID,
        "constraints": {"never_preempt": [f"l-{i}" for i in range(17)]},
    },
    "labels not text": {**_VALID, "constraints": {"labels": {"zone": 1}}},
    "worker name invalid": {**_VALID, "constraints": {"worker": "Not A Name!"}},
    "body a list": [1, 2],
    "body a string": "8G",
    "body a number": 5,
    "body null": None,
}

WORKER_BODIES: dict[str, Any] = {
    "name invalid": {"name": "Bad Name!", "gpus": [{"index": 0, "total_mb": 1000}]},
    "name missing": {"gpus": [{"index": 0, "total_mb": 1000}]},
    "no gpus": {"name": "box-9", "gpus": []},
    "too many gpus": {"name": "box-9", "gpus": [{"index": i, "total_mb": 1} for i in range(65)]},
    "total zero": {"name": "box-9", "gpus": [{"index": 0, "total_mb": 0}]},
    "total negative": {"name": "box-9", "gpus": [{"index": 0, "total_mb": -10}]},
    "headroom above total": {
        "name": "box-9",
        "gpus": [{"index": 0, "total_mb": 100, "headroom_mb": 100}],
    },
    "duplicate index": {
        "name": "box-9",
        "gpus": [{"index": 0, "total_mb": 1000}, {"index": 0, "total_mb": 1000}],
    },
    "index text": {"name": "box-9", "gpus": [{"index": "0", "total_mb": 1000}]},
    "arch malformed": {
        "name": "box-9",
        "gpus": [{"index": 0, "total_mb": 1000, "arch": "not an arch"}],
    },
}

HEARTBEATS: dict[str, Any] = {
    "used negative": {"gpus": [{"index": 0, "used_mb": -1}]},
    "used text": {"gpus": [{"index": 0, "used_mb": "lots"}]},
    "gpus not list": {"gpus": {"index": 0}},
    "stopped not list": {"stopped": "lease-1"},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = Server(
        tmp_path_factory.mktemp("bad") / "state",
        "--simulate",
        "2x24G",
        "--heartbeat-timeout-s",
        "3600",
    ).start()
    try:
        with started.client() as admin:
            register(admin, "box-1")
            lease = admin.post("/v1/leases", json={"vram_mb": 2048, "holder": "keep"})
            assert lease.status_code == 201
        yield started
    finally:
        started.stop()


@pytest.fixture
def admin(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        before = _state(client)
        yield client
        assert client.get("/healthz").status_code == 200
        assert _state(client) == before


def _state(client: httpx.Client) -> Any:
    status = client.get("/v1/status").json()
    return status, client.get("/v1/workers").json(), client.get("/v1/leases").json()


def _assert_error(answer: httpx.Response, *statuses: int) -> None:
    assert answer.status_code in statuses, answer.text
    error = answer.json()["error"]
    assert set(error) == {"code", "message", "details"}
    assert error["message"]


@pytest.mark.parametrize("case", sorted(LEASE_BODIES))
def test_bad_lease_request(admin: httpx.Client, case: str) -> None:
    _assert_error(admin.post("/v1/leases", json=LEASE_BODIES[case]), 422)


@pytest.mark.parametrize("case", sorted(WORKER_BODIES))
def test_bad_worker_registration(admin: httpx.Client, case: str) -> None:
    _assert_error(admin.post("/v1/workers", json=WORKER_BODIES[case]), 422)


@pytest.mark.parametrize("case", sorted(HEARTBEATS))
def test_bad_heartbeat(admin: httpx.Client, case: str) -> None:
    _assert_error(admin.post("/v1/workers/box-1/heartbeat", json=HEARTBEATS[case]), 422)


@pytest.mark.parametrize(
    "body", [{"mode": "soft"}, {"deadline_s": -1}, {"deadline_s": "soon"}, {"force": True}]
)
def test_bad_drain(admin: httpx.Client, body: Any) -> None:
    _assert_error(admin.post("/v1/workers/box-1/drain", json=body), 422)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": "soon"}, "timeout_s"),
        ({"timeout_s": 1e12}, "timeout_s"),
        ({"drain_deadline_s": -1}, "drain_deadline_s"),
        ({"wait": True}, "wait"),
    ],
)
def test_bad_update(admin: httpx.Client, body: Any, field: str) -> None:
    answer = admin.post("/v1/workers/box-1/update", json=body)  # the fixture: nothing changed
    _assert_error(answer, 422)
    assert field in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    "text", [b"{", b'{"vram_mb": }', b"\xff\xfe", b'{"vram_mb": NaN}', b"{'vram_mb': 1}"]
)
def test_malformed_json(admin: httpx.Client, text: bytes) -> None:
    answer = admin.post("/v1/leases", content=text, headers={"content-type": "application/json"})
    _assert_error(answer, 400, 422)


def test_oversized_body(admin: httpx.Client) -> None:
    body = b'{"vram_mb": 1, "holder": "' + b"x" * 200_000 + b'"}'
    answer = admin.post("/v1/leases", content=body, headers={"content-type": "application/json"})
    _assert_error(answer, 413)


def test_oversized_body_without_length(admin: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"vram_mb": 1, "holder": "'
        for _ in range(20):
            yield b"x" * 10_000
        yield b'"}'

    answer = admin.post(
        "/v1/leases", content=chunks(), headers={"content-type": "application/json"}
    )
    _assert_error(answer, 413)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/leases/nope"),
        ("DELETE", "/v1/leases/nope"),
        ("POST", "/v1/leases/nope/renew"),
        ("POST", "/v1/leases/nope/ready"),
        ("POST", "/v1/leases/nope/revoke"),
        ("GET", "/v1/workers/nope"),
        ("POST", "/v1/workers/nope/drain"),
        ("POST", "/v1/workers/nope/cancel-drain"),
        ("DELETE", "/v1/workers/nope"),
        ("POST", "/v1/workers/nope/heartbeat"),
        ("GET", "/v1/nothing-here"),
    ],
)
def test_unknown_ids(admin: httpx.Client, method: str, path: str) -> None:
    _assert_error(admin.request(method, path, json={} if method == "POST" else None), 404)


@pytest.mark.parametrize(
    "params", [{"wait": -1}, {"wait": 1000}, {"wait": "soon"}, {"wait": "nan"}]
)
def test_bad_long_poll(admin: httpx.Client, params: Any) -> None:
    lease = admin.get("/v1/leases").json()[0]["id"]
    _assert_error(admin.get(f"/v1/leases/{lease}", params=params), 422)


def test_bad_filters(admin: httpx.Client) -> None:
    _assert_error(admin.get("/v1/leases", params={"state": "bogus"}), 422)
    _assert_error(admin.get("/v1/leases/" + "x" * 100), 422)


def test_wrong_method(admin: httpx.Client) -> None:
    _assert_error(admin.put("/v1/leases", json={}), 405)
