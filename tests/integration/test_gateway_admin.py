"""An operator's control of a gateway's models through a real gateway, controller and
agent: a pin keeps an equal priority from reclaiming the model (until unpin), a strictly
higher priority still preempts it; ``gpu-arbiter unload`` stops it and releases its
lease; ``gpu-arbiter models`` shows every gateway's models; the admin key rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import httpx
import pytest

from .conftest import SRC, wait_for
from .gateways import GatewayProcess, chat, metric, model_entry, records
from .test_gateway import Setup, setup

__all__ = ["setup"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(120)
STOPS = "gpu_arbiter_gateway_stops_total"
ADMIN_KEY = "admin-key-0123456789"
USER_KEY = "user-key-0123456789"
NOWHERE = "http://127.0.0.1:1"  # nothing listens on port 1


def cli(*args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "250"}
    for name in ("GPU_ARBITER_GATEWAY", "GPU_ARBITER_GATEWAY_KEY"):
        env.pop(name, None)
    if key is not None:
        env["GPU_ARBITER_GATEWAY_KEY"] = key
    command = [sys.executable, "-m", "gpu_arbiter", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=90)


def admin(gateway: GatewayProcess, name: str, verb: str, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with gateway.client(headers=headers) as client:
        return client.post(f"/admin/models/{name}/{verb}", json={})


def lease_idle(setup: Setup, model: str) -> bool:
    [lease] = setup.held(model)
    return bool(lease["idle"])


def stops(gateway: GatewayProcess, model: str, reason: str) -> float | None:
    return metric(httpx.get(gateway.url + "/metrics").text, STOPS, model=model, reason=reason)


def test_a_pin_keeps_an_equal_priority_from_reclaiming_the_model_until_unpin(
    setup: Setup,
) -> None:
    setup.agent()
    models = model_entry("a", setup.record, mb=15000, vram="16G", keep_alive="5m")
    models += model_entry("b", setup.record, mb=15000, vram="16G", queue_timeout="2s")
    gateway = setup.gateway(models)
    url = gateway.url + "/v1/completions"
    assert httpx.post(url, json=chat("a"), timeout=60).status_code == 200
    wait_for(lambda: lease_idle(setup, "a"), 10, "a's lease marked idle")
    pinned = admin(gateway, "a", "pin")
    assert pinned.status_code == 200, pinned.text
    found = pinned.json()
    assert found["pinned"] is True and found["preemptible_by"] == "priority above 500"
    assert found["replicas"][0]["lease_idle"] is False
    assert not lease_idle(setup, "a")  # marked busy before the pin answered
    refused = httpx.post(url, json=chat("b"), timeout=60)  # equal priority: it queues
    assert refused.status_code == 503, refused.text
    message = refused.json()["error"]["message"]
    assert "still queued for its lease after 2s" in message, message
    assert "'a' is pinned (normal): only a higher priority may preempt it" in message
    assert gateway.model_state("a")["state"] == "warm"
    assert "term_at" not in records(setup.record, "a")[0]
    wait_for(lambda: not setup.held("b"), 10, "b's queued request withdrawn")
    unpinned = admin(gateway, "a", "unpin")
    assert unpinned.status_code == 200 and unpinned.json()["pinned"] is False

    def served() -> httpx.Response | None:
        """b's answer; None when its 2 s queue timeout (a's stop and b's start, which a
        loaded machine can make longer) ran out first: b's load goes on."""
        answer = httpx.post(url, json=chat("b"), timeout=60)  # a is idle again: reclaimed
        if answer.status_code == 200:
            return answer
        assert "not ready after 2s" in answer.text, answer.text
        return None

    wait_for(served, 60, "b served once a is reclaimed")
    [a] = records(setup.record, "a")
    b = records(setup.record, "b")[-1]
    assert a["term_at"] < b["started_at"]
    assert stops(gateway, "a", "reclaimed") == 1


def test_a_strictly_higher_priority_preempts_a_pinned_preemptible_model(setup: Setup) -> None:
    setup.agent()
    models = model_entry("a", setup.record, mb=15000, vram="16G", pinned=True)
    models += model_entry("c", setup.record, mb=15000, vram="16G", priority="interactive")
    gateway = setup.gateway(models)
    url = gateway.url + "/v1/completions"
    assert httpx.post(url, json=chat("a"), timeout=60).status_code == 200
    assert gateway.model_state("a")["pinned"] is True
    answer = httpx.post(url, json=chat("c"), timeout=60)
    assert answer.status_code == 200, answer.text
    [a] = records(setup.record, "a")
    [c] = records(setup.record, "c")
    assert a["term_at"] < c["started_at"]  # I4: c started once a was gone
    assert stops(gateway, "a", "preempted") == 1  # busy-marked: preempted, not reclaimed
    assert stops(gateway, "a", "reclaimed") is None


def test_the_cli_shows_every_gateways_models_and_unloads_one(setup: Setup) -> None:
    setup.agent()
    models = model_entry("chat", setup.record, mb=3000, vram="4G", keep_alive="5m")
    models += model_entry("embed", setup.record, mb=1000, vram="1G", aliases=["e5"])
    gateway = setup.gateway(models)
    assert httpx.post(gateway.url + "/v1/completions", json=chat("chat")).status_code == 200
    [lease] = setup.held("chat")
    shown = cli("models", "--gateway", gateway.url)
    assert shown.returncode == 0, shown.stderr
    [row] = [line for line in shown.stdout.splitlines() if " chat " in line]
    assert "warm" in row and lease["id"] in row and "4.0 GiB" in row and " ago" in row
    [cold] = [line for line in shown.stdout.splitlines() if " embed " in line]
    assert "cold" in cold and "never" in cold
    assert " e5 " not in shown.stdout  # an alias is not a model of its own
    listed = cli("models", "--json", "--gateway", f"{gateway.url},{NOWHERE}")
    assert listed.returncode == 0, listed.stderr  # one gateway answered
    [here, nowhere] = json.loads(listed.stdout)
    assert [m["id"] for m in here["models"]] == ["chat", "embed"]
    assert here["models"][0]["replicas"][0]["lease"] == lease["id"]
    assert nowhere["status"] == 0 and NOWHERE in nowhere["error"]
    assert f"{NOWHERE}: not reachable" in listed.stderr

    unloaded = cli("unload", "chat", "--gateway", gateway.url)
    assert unloaded.returncode == 0, unloaded.stderr
    assert "unloaded chat: 1 replica(s) stopped" in unloaded.stdout
    assert "its leases released" in unloaded.stdout
    assert not setup.held("chat")  # released before the command returned
    assert "term_at" in records(setup.record, "chat")[0]
    assert stops(gateway, "chat", "unloaded") == 1
    again = cli("models", "--gateway", gateway.url)
    [row] = [line for line in again.stdout.splitlines() if " chat " in line]
    assert "cold" in row

    unknown = cli("unload", "nope", "--gateway", gateway.url)
    assert unknown.returncode == 1
    assert "no gateway has a model 'nope'" in unknown.stderr
    alone = cli("models", "--gateway", NOWHERE)
    assert alone.returncode == 1 and f"{NOWHERE}: not reachable" in alone.stderr


def test_admin_routes_need_an_admin_key(setup: Setup) -> None:
    keys = f"""[[gateway.keys]]
key = "{ADMIN_KEY}"
name = "ops"
role = "admin"

[[gateway.keys]]
key = "{USER_KEY}"
name = "ui"

"""
    gateway = setup.gateway(keys + model_entry("chat", setup.record, vram="1G"))
    assert admin(gateway, "chat", "pin").status_code == 401
    denied = admin(gateway, "chat", "pin", USER_KEY)
    assert denied.status_code == 403
    error: dict[str, Any] = denied.json()["error"]
    assert error["code"] == "permission_denied" and "'ui' is a user key" in error["message"]
    assert admin(gateway, "chat", "pin", ADMIN_KEY).status_code == 200
    with gateway.client(headers={"authorization": f"Bearer {USER_KEY}"}) as client:
        assert client.get("/v1/models/chat").json()["pinned"] is True
    unknown = admin(gateway, "nope", "unload", ADMIN_KEY)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    refused = cli("unpin", "chat", "--gateway", gateway.url, key=USER_KEY)
    assert refused.returncode == 1 and "403 permission_denied" in refused.stderr
    done = cli("unpin", "chat", "--gateway", gateway.url, key=ADMIN_KEY)
    assert done.returncode == 0, done.stderr
    assert "unpinned chat" in done.stdout
    with gateway.client(headers={"authorization": f"Bearer {USER_KEY}"}) as client:
        assert client.get("/v1/models/chat").json()["pinned"] is False
