"""``constraints.workers`` and ``constraints.prefer_workers`` through the real server:
refused with the field named and nothing stored, or stored and read back as written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..integration.conftest import Server, register


@pytest.fixture(scope="module")
def admin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    server = Server(Path(tmp_path_factory.mktemp("worker-sets")))
    try:
        server.start()
        with server.client() as client:
            for name in ("box-a", "box-b"):
                register(client, name, gpus=1)
            yield client
    finally:
        server.stop()


def _leases(client: httpx.Client) -> list[Any]:
    answer = client.get("/v1/leases")
    assert answer.status_code == 200
    return list(answer.json())


@pytest.mark.parametrize(
    ("field", "names", "says"),
    [
        ("workers", ["BAD NAME"], "is not a worker name"),
        ("workers", [f"w{i}" for i in range(65)], "64"),
        ("workers", [], "1"),
        ("prefer_workers", ["box-a", "no:colon"], "is not a worker name"),
        ("prefer_workers", [f"w{i}" for i in range(65)], "64"),
    ],
)
def test_a_bad_worker_set_is_a_422_naming_the_field_and_stores_nothing(
    admin: httpx.Client, field: str, names: list[str], says: str
) -> None:
    before = _leases(admin)
    answer = admin.post("/v1/leases", json={"vram_mb": 1024, "constraints": {field: names}})
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert f"constraints.{field}" in error["message"]
    assert says in error["message"]
    assert _leases(admin) == before


def test_gpu_ids_off_the_workers_are_a_422_naming_gpu_ids(admin: httpx.Client) -> None:
    body = {"vram_mb": 1024, "constraints": {"workers": ["box-a"], "gpu_ids": ["box-b:0"]}}
    answer = admin.post("/v1/leases", json=body)
    assert answer.status_code == 422, answer.text
    assert "constraints.gpu_ids" in answer.json()["error"]["message"]


def test_a_worker_set_is_stored_and_read_back_and_placement_honours_it(
    admin: httpx.Client,
) -> None:
    body = {
        "vram_mb": 1024,
        "holder": "worker-sets",
        "constraints": {"workers": ["BOX-B", "box-a", "box-b"], "prefer_workers": ["Box-B"]},
    }
    answer = admin.post("/v1/leases", json=body)
    assert answer.status_code == 201, answer.text
    lease = answer.json()
    assert lease["constraints"]["workers"] == ["box-a", "box-b"]
    assert lease["constraints"]["prefer_workers"] == ["box-b"]
    assert lease["gpus"] == ["box-b:0"]  # both empty: binpack's tie goes to box-a
    read = admin.get(f"/v1/leases/{lease['id']}")
    assert read.status_code == 200
    assert read.json()["constraints"] == lease["constraints"]
    plain = admin.post("/v1/leases", json={"vram_mb": 1024, "constraints": {}})
    assert plain.status_code == 201, plain.text
    assert plain.json()["constraints"]["workers"] == []
    assert plain.json()["constraints"]["prefer_workers"] == []
    for made in (lease, plain.json()):
        assert admin.delete(f"/v1/leases/{made['id']}").status_code in (200, 204)
