"""Several controllers on one PostgreSQL database: one leads, the others stand by and
take over; nothing acknowledged is lost or granted twice (I1, I9)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpu_arbiter.client import ApiError, ArbiterClient, ControllerUnreachable

from ..postgres import Relay
from .agents import AgentProcess, RunProcess, lease_of, worker_state
from .conftest import SRC, Server, wait_for
from .test_concurrency import HELD, check_i1

TTL = "1.5"


class Controllers:
    """Controller processes sharing one database, each with its own state directory."""

    def __init__(self, root: Path, dsn: str) -> None:
        self.root = root
        self.dsn = dsn
        self.started: list[Server] = []

    def start(self, name: str, dsn: str | None = None, ttl: str = TTL) -> Server:
        args = ("--store", dsn or self.dsn, "--leader-ttl-s", ttl, "--simulate", "2x24G:sm_86")
        server = Server(self.root / name, *args)
        server.start(ready=False)
        self.started.append(server)
        return server

    def stop(self) -> None:
        for server in self.started:
            server.stop()


@pytest.fixture
def controllers(tmp_path: Path, postgres_dsn: str) -> Iterator[Controllers]:
    made = Controllers(tmp_path, postgres_dsn)
    yield made
    made.stop()


def role(server: Server) -> str | None:
    try:
        answer = httpx.get(server.url + "/readyz", timeout=2)
    except httpx.HTTPError:
        return None
    if answer.status_code == 200:
        return "leader"
    code = answer.json()["error"]["code"]
    return "standby" if code == "not_leader" else None


def leader_of(*servers: Server, timeout_s: float = 20.0) -> Server:
    """The one server that leads, once exactly one does."""

    def one() -> Server | None:
        leading = [s for s in servers if role(s) == "leader"]
        return leading[0] if len(leading) == 1 else None

    found: Server = wait_for(one, timeout_s, "exactly one leader")
    return found


def _gauge(client: httpx.Client, name: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == name:
            return float(family.samples[0].value)
    raise AssertionError(f"no {name} in /metrics")


def test_one_leads_the_other_redirects_changes_and_answers_reads(
    controllers: Controllers,
) -> None:
    first = controllers.start("a")
    assert leader_of(first) is first
    second = controllers.start("b")
    wait_for(lambda: role(second) == "standby", 20, "the second to stand by")
    assert leader_of(first, second) is first

    with first.client() as admin:  # its admin token is in the shared database
        assert _gauge(admin, "gpu_arbiter_leader") == 1
        made = admin.post("/v1/leases", json={"vram_mb": 1024, "holder": "chat"})
        assert made.status_code == 201, made.text
        lease = made.json()
    with second.client(token=first.admin_token) as standby:
        status = wait_for(
            lambda: (s := standby.get("/v1/status").json())["leader"] == first.url and s,
            10,
            "the standby to know the leader",
        )
        assert status["role"] == "standby"
        shown = _cli(second.url, first.admin_token, "status")
        assert shown.returncode == 0, shown.stderr
        assert f"read from a standby controller (leader: {first.url})" in shown.stdout
        assert "standby" not in _cli(first.url, first.admin_token, "status").stdout
        every = f"{second.url},{first.url},http://127.0.0.1:1"
        listed = json.loads(_cli(every, first.admin_token, "status", "-o", "json").stdout)
        assert [(c["url"], c["role"]) for c in listed["controllers"]] == [
            (second.url, "standby"),
            (first.url, "leader"),
            ("http://127.0.0.1:1", "unreachable"),
        ]
        assert listed["controllers"][0]["leader"] == first.url
        line = f"controllers: {second.url} standby, {first.url} leader, http://127.0.0.1:1"
        assert line in _cli(every, first.admin_token, "status").stdout
        assert _gauge(standby, "gpu_arbiter_leader") == 0
        assert _gauge(standby, "gpu_arbiter_ready") == 0
        seen = wait_for(
            lambda: (r := standby.get(f"/v1/leases/{lease['id']}")).status_code == 200 and r,
            10,
            "the standby to have the lease",
        )
        assert seen.json()["token"] == lease["token"]
        redirected = standby.post("/v1/leases", json={"vram_mb": 1024})
        assert redirected.status_code == 307
        assert redirected.headers["location"] == first.url + "/v1/leases"
        assert redirected.json()["error"]["code"] == "not_leader"
        # 307 keeps the method and the body; HTTP clients drop the token when they follow
        # a redirect to another origin, so the client sends it again to the leader.
        followed = standby.post(redirected.headers["location"], json={"vram_mb": 1024})
        assert followed.status_code == 201, followed.text
        assert followed.json()["token"] > lease["token"]

    async def through_the_client(urls: list[str]) -> dict[str, Any]:
        async with ArbiterClient(urls, token=first.admin_token) as client:
            made: dict[str, Any] = await client.create_lease(vram_mb=512, holder="via-standby")
            return made

    # the client sends its token to the controllers it was given, never elsewhere
    with pytest.raises(ControllerUnreachable, match="is not among the controller URLs"):
        asyncio.run(through_the_client([second.url]))
    via = asyncio.run(through_the_client([second.url, first.url]))
    assert via["state"] == "pending"  # both GPUs are loading already: loads never overlap
    with first.client() as admin:
        assert admin.get(f"/v1/leases/{via['id']}").json()["holder"] == "via-standby"


async def _operate(
    urls: list[str], token: str, index: int, acked: dict[str, dict[str, Any]], released: set[str]
) -> None:
    """One holder's life: create (the same idempotency key on every retry, so the request
    is queued once), wait for the grant, ready, and release again for odd indices. Every
    step is retried through a failover."""
    async with ArbiterClient(urls, token=token, timeout_s=10) as client:
        await _steps(client, index, acked, released)


async def _steps(
    client: ArbiterClient, index: int, acked: dict[str, dict[str, Any]], released: set[str]
) -> None:
    key = f"op-{index}"
    deadline = time.monotonic() + 90
    lease: dict[str, Any] | None = None
    while True:
        try:
            if lease is None:
                lease = await client.create_lease(
                    vram_mb=256, holder=f"h{index}", idempotency_key=key
                )
            elif lease["state"] == "pending":
                lease = await client.lease(lease["id"], wait_s=5, state="pending")
            elif lease["state"] == "loading":
                lease = await client.ready(lease["id"])
            elif index % 2 and lease["id"] not in released:
                await client.release(lease["id"])
                released.add(lease["id"])
            else:
                return
            acked[lease["id"]] = lease
        except (ControllerUnreachable, ApiError) as error:
            if isinstance(error, ApiError) and error.status != 503:
                raise
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def test_kill_9_the_leader_during_200_operations(controllers: Controllers) -> None:
    first = controllers.start("a")
    leader_of(first)
    second = controllers.start("b")
    wait_for(lambda: role(second) == "standby", 20, "the second to stand by")
    acked: dict[str, dict[str, Any]] = {}
    released: set[str] = set()

    async def churn() -> int:
        urls = [first.url, second.url]
        tasks = [
            asyncio.create_task(_operate(urls, first.admin_token, index, acked, released))
            for index in range(200)
        ]
        while len(acked) < 60 and not all(t.done() for t in tasks):
            await asyncio.sleep(0.005)
        in_flight = sum(not t.done() for t in tasks)
        first.kill9()  # the leader dies in the middle of the operations
        await asyncio.wait_for(asyncio.gather(*tasks), 100)
        return in_flight

    in_flight = asyncio.run(churn())
    assert in_flight > 0
    assert len(acked) == 200 and len(released) == 100
    assert leader_of(second) is second

    with second.client(token=first.admin_token) as admin:
        listed = admin.get("/v1/leases").json()
        live = [lease for lease in listed if lease["state"] in HELD | {"pending"}]
        ids = [lease["id"] for lease in listed]
        assert len(ids) == len(set(ids))
        keys = [lease["idempotency_key"] for lease in listed]
        assert len(keys) == len(set(keys))  # no operation was queued twice
        for lease_id, seen in acked.items():
            now = admin.get(f"/v1/leases/{lease_id}").json()
            assert now["token"] == seen["token"] and now["gpus"] == seen["gpus"], now
            assert now["state"] == ("released" if lease_id in released else "active"), now
        assert sorted(lease["id"] for lease in live) == sorted(set(acked) - released)
        by_grant = sorted(acked.values(), key=lambda lease: lease["granted_at"])
        tokens = [lease["token"] for lease in by_grant]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
        check_i1(admin.get("/v1/workers").json(), live)
        fresh = admin.post("/v1/leases", json={"vram_mb": 1, "holder": "after"}).json()
        assert fresh["token"] > max(tokens)

    restarted = Server(first.state_dir, *first.args)
    restarted.start(ready=False)
    controllers.started.append(restarted)
    wait_for(lambda: role(restarted) == "standby", 20, "the old leader to come back as a standby")
    assert leader_of(restarted, second) is second


def test_a_leader_cut_off_from_the_database_stops_granting(
    controllers: Controllers, postgres_dsn: str
) -> None:
    cut = Relay(postgres_dsn)
    try:
        first = controllers.start("a", dsn=cut.dsn)
        leader_of(first)
        second = controllers.start("b")
        wait_for(lambda: role(second) == "standby", 20, "the second to stand by")
        with first.client() as admin:
            before = admin.post("/v1/leases", json={"vram_mb": 1024, "holder": "before"})
            assert before.status_code == 201
        cut.sever()
        with first.client() as admin:
            refused = admin.post("/v1/leases", json={"vram_mb": 1024, "holder": "cut-off"})
            assert refused.status_code in (307, 503), refused.text  # never granted there
        new = leader_of(first, second, timeout_s=30)
        assert new is second
        with second.client(token=first.admin_token) as admin:
            live = {lease["holder"]: lease for lease in admin.get("/v1/leases").json()}
            assert "cut-off" not in live
            assert live["before"]["token"] == before.json()["token"]
            after = admin.post("/v1/leases", json={"vram_mb": 1024, "holder": "after"}).json()
            assert after["token"] > before.json()["token"]
        assert role(first) != "leader"
    finally:
        cut.close()


def test_a_stopped_leader_hands_over_without_waiting_for_its_term(
    controllers: Controllers,
) -> None:
    first = controllers.start("a", ttl="120")
    leader_of(first)
    second = controllers.start("b", ttl="120")
    wait_for(lambda: role(second) == "standby", 20, "the second to stand by")
    first.stop()  # SIGTERM: it ends its term; the standby need not wait 120 s for it to lapse
    assert leader_of(second, timeout_s=30) is second


def _cli(urls: str, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "GPU_ARBITER_URL": urls}
    env["GPU_ARBITER_TOKEN"] = token
    command = [sys.executable, "-m", "gpu_arbiter", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_an_agent_and_a_run_wrapper_follow_the_new_leader(
    controllers: Controllers, tmp_path: Path
) -> None:
    first = controllers.start("a")
    leader_of(first)
    second = controllers.start("b")
    wait_for(lambda: role(second) == "standby", 20, "the second to stand by")
    both = f"{first.url},{second.url}"
    runtime = tmp_path / "rt"
    runtime.mkdir()
    agent = AgentProcess(both, first.admin_token, "box-a", runtime, "1x24G:sm_86")
    run = RunProcess(both, first.admin_token, runtime, "job", "--vram", "4G", "--ttl", "20")
    try:
        agent.start()
        with first.client() as admin:
            wait_for(lambda: worker_state(admin, "box-a") == "online", what="box-a online")
        run.start()
        run.wait_child()
        with first.client() as admin:
            wait_for(lambda: (lease_of(admin, "job") or {}).get("state") == "active", what="ready")
            lease = lease_of(admin, "job")
            assert lease is not None

        first.kill9()
        killed_at = time.time()
        assert leader_of(second, timeout_s=30) is second
        with second.client(token=first.admin_token) as admin:
            wait_for(
                lambda: (
                    (admin.get("/v1/workers/box-a").json()["last_heartbeat_at"] or 0) > killed_at
                ),
                20,
                "the agent's heartbeats to reach the new leader",
            )
            assert worker_state(admin, "box-a") == "online"
            renewed = admin.get(f"/v1/leases/{lease['id']}").json()["expires_at"]
            wait_for(
                lambda: admin.get(f"/v1/leases/{lease['id']}").json()["expires_at"] > renewed,
                30,
                "the run wrapper to renew on the new leader",
            )
            run.go()
            assert run.wait() == 0
            ended = admin.get(f"/v1/leases/{lease['id']}").json()
            assert (ended["state"], ended["token"]) == ("released", lease["token"])

            # the CLI too: the dead controller first in the list, the new leader next
            paused = _cli(both, first.admin_token, "pause")
            assert paused.returncode == 0, paused.stderr
            assert admin.get("/v1/status").json()["paused"] is True
    finally:
        run.kill()
        agent.stop()


def test_a_standby_that_takes_over_refuses_a_gateway_name_to_another_token(
    controllers: Controllers,
) -> None:
    first = controllers.start("a")
    leader_of(first)
    second = controllers.start("b")
    wait_for(lambda: role(second) == "standby", 20, "the second to stand by")
    token_a, token_b = first.token("gateway", "box-1"), first.token("gateway", "box-2")
    report = {"url": "http://box.internal:8080", "host": "box"}
    with first.client(token_a) as a:
        assert a.put("/v1/gateways/gw-x", json={**report, "worker": "box-1"}).status_code == 200
    first.kill9()
    assert leader_of(second) is second

    with second.client(token_b) as b:
        refused = b.put("/v1/gateways/gw-x", json={**report, "worker": "box-2"})
        assert refused.status_code == 403, refused.text
        owner = refused.json()["error"]["details"]["owner"]
        assert owner.startswith("gateway-") and owner in refused.json()["error"]["message"]
    with second.client(token=first.admin_token) as admin:
        assert admin.delete("/v1/gateways/gw-x").status_code == 200
    with second.client(token_b) as b:
        assert b.put("/v1/gateways/gw-x", json={**report, "worker": "box-2"}).status_code == 200
