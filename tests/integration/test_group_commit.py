"""I9 with group commit, through a real server: many clients create and release leases
at once, the controller is killed (-9) while their requests are in flight, and after a
restart every answer a client got is what the store holds: each 201/202 a lease there
(a 201 with its token), each release answered 200 a released lease, and no fencing
token a client was told is handed out again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

from .conftest import Server

CLIENTS = 32
KILL_AFTER = 300  # answers told before the kill


async def _create_and_release(
    client: httpx.AsyncClient, name: str, told: dict[str, dict[str, Any]]
) -> None:
    """Creates and releases leases until the server is gone, noting every answer."""
    try:
        while True:
            created = await client.post("/v1/leases", json={"vram_mb": 1, "holder": name})
            assert created.status_code in (201, 202), created.text
            lease = created.json()
            told[lease["id"]] = {"status": created.status_code, "token": lease.get("token")}
            released = await client.delete(f"/v1/leases/{lease['id']}")
            assert released.status_code == 200, released.text
            told[lease["id"]]["released"] = True
    except httpx.HTTPError:
        return  # killed under it: what it was told so far is checked


async def _load_and_kill(server: Server, told: dict[str, dict[str, Any]]) -> None:
    async with server.async_client(timeout=60) as client:
        tasks = [
            asyncio.create_task(_create_and_release(client, f"c{i}", told)) for i in range(CLIENTS)
        ]
        while len(told) < KILL_AFTER and not all(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        await asyncio.to_thread(server.kill9)  # requests of every client are in flight
        await asyncio.gather(*tasks)


def test_every_answer_survives_kill9_under_concurrent_creates_and_releases(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--simulate", "64x80G")
    told: dict[str, dict[str, Any]] = {}
    asyncio.run(_load_and_kill(server, told))
    assert len(told) >= KILL_AFTER
    server.start()
    with server.client() as admin:
        for lease_id, answer in told.items():
            stored = admin.get(f"/v1/leases/{lease_id}")
            assert stored.status_code == 200, (lease_id, answer)  # told, so stored
            body = stored.json()
            if answer["status"] == 201:
                assert body["token"] == answer["token"]
            if answer.get("released"):
                assert body["state"] == "released", (lease_id, body)
        tokens = [a["token"] for a in told.values() if a["token"] is not None]
        fresh = admin.post("/v1/leases", json={"vram_mb": 1, "holder": "after"})
        assert fresh.status_code == 201
        assert fresh.json()["token"] > max(tokens)  # no token told before is reused
