"""A cluster's cold load prefers the hosts whose gateway holds the model's file (no copy
before its load), in process over a memory store."""

from __future__ import annotations

import pytest

from .test_gateway_roles import Cluster, cluster

__all__ = ["cluster"]

SHA = "ab" * 32
FILE = {"name": "m.gguf", "size": 1000, "sha256": SHA}


async def _ask(cluster: Cluster, holder: str) -> dict[str, object]:
    model = {"id": "chat", "state": "cold", "vram_mb": 1000, "file": "m.gguf"}
    for name, worker in (("gw-2", "box-2"), ("gw-3", "box-3")):
        files = [FILE] if name == holder else []
        answer = await cluster.report(name, name, worker, models=[model], files=files)
        assert answer.status_code == 200, answer.text
    asked = await cluster.http.post(
        "/v1/gateways/gw-2/loads", json={"model": "chat"}, headers=cluster.as_("gw-2")
    )
    assert asked.status_code == 200, asked.text
    lease: dict[str, object] = asked.json()
    return lease


@pytest.mark.parametrize(("holder", "worker"), [("gw-3", "box-3"), ("gw-2", "box-2")])
async def test_a_load_goes_where_the_file_is(cluster: Cluster, holder: str, worker: str) -> None:
    lease = await _ask(cluster, holder)
    assert lease["worker"] == worker, lease
    assert lease["constraints"]["prefer_workers"] == [worker]  # type: ignore[index]


async def test_a_report_names_its_files(cluster: Cluster) -> None:
    await _ask(cluster, "gw-3")
    listed = (await cluster.http.get("/v1/gateways", headers=cluster.as_("admin"))).json()
    files = {g["name"]: g["files"] for g in listed}
    assert files == {"gw-2": [], "gw-3": [FILE]}
    bad = {**FILE, "sha256": "nothex"}
    answer = await cluster.report("gw-3", "gw-3", "box-3", files=[bad])
    assert answer.status_code == 422, answer.text
    assert "sha256" in answer.text
