"""Many clients at once never over-commit a GPU (I1), and a crash loses nothing
acknowledged (I9)."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import httpx

from .conftest import Server

HELD = {"loading", "active", "revoking"}


def check_i1(workers: list[dict[str, Any]], leases: list[dict[str, Any]]) -> None:
    """Committed memory never exceeds capacity, by the GPUs' own figures and by the leases."""
    capacity = {}
    for worker in workers:
        for gpu in worker["gpus"]:
            assert gpu["committed_mb"] <= gpu["capacity_mb"], gpu
            assert gpu["loading"] <= 1, gpu
            capacity[gpu["id"]] = gpu["capacity_mb"]
    by_gpu: dict[str, int] = defaultdict(int)
    for lease in leases:
        if lease["state"] in HELD:
            for gpu in lease["gpus"]:
                by_gpu[gpu] += lease["vram_mb"]
    for gpu, committed in by_gpu.items():
        assert committed <= capacity[gpu], (gpu, committed)


async def _client_loop(client: httpx.AsyncClient, seed: int, rounds: int) -> int:
    rng = random.Random(seed)
    granted = 0
    for _ in range(rounds):
        body = {"vram_mb": rng.choice([2048, 4096, 6144, 8192, 12288]), "holder": f"c{seed}"}
        answer = await client.post("/v1/leases", json=body)
        assert answer.status_code in (201, 202), answer.text
        lease = answer.json()
        for _ in range(100):
            if lease["state"] != "pending":
                break
            polled = await client.get(
                f"/v1/leases/{lease['id']}", params={"wait": 10, "state": "pending"}
            )
            lease = polled.json()
        assert lease["state"] == "loading", lease
        granted += 1
        await client.post(f"/v1/leases/{lease['id']}/ready")
        await client.delete(f"/v1/leases/{lease['id']}")
    return granted


async def _monitor(client: httpx.AsyncClient, done: asyncio.Event) -> int:
    checks = 0
    while not done.is_set() or checks == 0:
        workers = (await client.get("/v1/workers")).json()
        leases = (await client.get("/v1/leases", params={"worker": "local"})).json()
        check_i1(workers, leases)
        checks += 1
    return checks


async def test_hundred_concurrent_clients_never_over_commit(server: Server) -> None:
    """The clients and the monitor run in task groups: when one fails, every other is
    cancelled and has ended before the client closes its connections (with gather, the
    others ran on against a closed client, their connections left to the collector)."""
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with server.async_client(limits=limits) as client:
        done = asyncio.Event()

        async def clients() -> list[int]:
            try:
                async with asyncio.TaskGroup() as group:
                    loops = [group.create_task(_client_loop(client, s, 3)) for s in range(100)]
                return [loop.result() for loop in loops]
            finally:
                done.set()

        async with asyncio.TaskGroup() as group:
            monitor = group.create_task(_monitor(client, done))
            granted = group.create_task(clients())
        assert sum(granted.result()) == 300
        assert monitor.result() > 0
        final = (await client.get("/v1/workers")).json()
        assert all(g["committed_mb"] == 0 for w in final for g in w["gpus"])


async def _churn(
    client: httpx.AsyncClient, seed: int, acked: dict[str, dict[str, Any]], ended: dict[str, str]
) -> None:
    rng = random.Random(seed)
    for _ in range(10):
        try:
            body = {"vram_mb": rng.choice([512, 1024, 2048]), "ttl_s": 600, "holder": f"h{seed}"}
            answer = await client.post("/v1/leases", json=body)
            assert answer.status_code in (201, 202), answer.text
            lease = answer.json()
            acked[lease["id"]] = lease
            if lease["state"] == "pending":
                polled = await client.get(
                    f"/v1/leases/{lease['id']}", params={"wait": 5, "state": "pending"}
                )
                lease = polled.json()
                acked[lease["id"]] = lease
            if lease["state"] == "pending":  # give up: cancel it (or release it, if granted)
                gone = await client.delete(f"/v1/leases/{lease['id']}")
                if gone.status_code == 200:
                    ended[lease["id"]] = gone.json()["state"]
            elif lease["state"] == "loading":
                await client.post(f"/v1/leases/{lease['id']}/ready")
                if rng.random() < 0.8:
                    gone = await client.delete(f"/v1/leases/{lease['id']}")
                    if gone.status_code == 200:
                        ended[lease["id"]] = gone.json()["state"]
        except httpx.HTTPError:
            return  # the server was killed under us: nothing after this was acknowledged


async def test_kill_9_during_grants_and_releases_loses_nothing_acknowledged(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--simulate", "8x80G")
    acked: dict[str, dict[str, Any]] = {}
    ended: dict[str, str] = {}
    limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
    async with server.async_client(limits=limits, timeout=30) as client:
        tasks = [asyncio.create_task(_churn(client, seed, acked, ended)) for seed in range(200)]
        for _ in range(3000):  # kill it in the middle of the churn
            if (len(acked) >= 250 and len(ended) >= 30) or all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        in_flight = sum(not t.done() for t in tasks)
        server.kill9()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert len(acked) >= 250
    assert in_flight > 0  # the kill landed while clients were still busy

    restarted = start_server("--simulate", "8x80G", state_dir=server.state_dir)
    with restarted.client() as admin:
        live = admin.get("/v1/leases").json()
        ids = [lease["id"] for lease in live]
        assert len(ids) == len(set(ids))
        tokens = [lease["token"] for lease in live if lease["token"] is not None]
        assert len(tokens) == len(set(tokens))
        for lease_id, seen in acked.items():
            now = admin.get(f"/v1/leases/{lease_id}")
            assert now.status_code == 200, lease_id
            record = now.json()
            if lease_id in ended:
                assert record["state"] == ended[lease_id], record
            elif seen["state"] != "pending":
                assert record["state"] in HELD | {"released"}, record
                assert record["token"] == seen["token"]
                assert record["gpus"] == seen["gpus"]
            else:
                assert record["state"] in HELD | {"pending", "released", "cancelled"}, record
        check_i1(admin.get("/v1/workers").json(), live)
        highest = max(lease["token"] or 0 for lease in acked.values())
        fresh = admin.post("/v1/leases", json={"vram_mb": 1, "holder": "after"}).json()
        if fresh["state"] != "pending":
            assert fresh["token"] > highest
        assert admin.get("/v1/status").json()["next_token"] > highest
