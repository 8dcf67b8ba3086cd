"""Gateways report to the controller (``PUT /v1/gateways/{name}``) and take the commands
an admin queues there: real controller, agent and gateway processes, the real
llama-server behind the gateway, everything through the HTTP APIs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import SRC, wait_for
from .gateways import GatewayProcess, chat, model_entry
from .test_gateway import Setup, setup
from .test_gateway_llama import llama_entry

__all__ = ["setup"]

pytestmark = pytest.mark.timeout(180)


def reported(admin: httpx.Client, gateway: GatewayProcess) -> dict[str, Any] | None:
    """The controller's entry for ``gateway`` (found by its URL), None while it has none."""
    answer = admin.get("/v1/gateways")
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] | None = next((g for g in answer.json() if g["url"] == gateway.url), None)
    return found


def model_of(entry: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(m for m in entry["models"] if m["id"] == name)
    return found


def own_view(gateway: GatewayProcess, name: str) -> dict[str, Any]:
    with gateway.client() as client:
        answer = client.get(f"/v1/models/{name}")
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


def test_a_gateway_reports_its_models_and_takes_pin_unpin_and_unload_from_the_controller(
    setup: Setup, llama_server: Path, tiny_models: Path
) -> None:
    setup.agent()
    entry, _ = llama_entry(
        "chat", llama_server, tiny_models / "tiny-chat.gguf", vram="1G",
        aliases=["gpt-4o-mini"], keep_alive="5m",
    )  # fmt: skip
    gateway = setup.gateway(entry)
    found = wait_for(lambda: reported(setup.admin, gateway), 30, "the gateway's report")
    assert found["stale"] is False and found["worker"] == "box"
    assert model_of(found, "chat")["state"] == "cold"
    assert model_of(found, "chat")["aliases"] == ["gpt-4o-mini"]
    name = found["name"]

    pin = setup.admin.post(f"/v1/gateways/{name}/models/gpt-4o-mini/pin")  # by its alias
    assert pin.status_code == 202, pin.text
    assert pin.json()["model"] == "chat" and pin.json()["verb"] == "pin"
    wait_for(lambda: own_view(gateway, "chat")["pinned"], 30, "the gateway's model pinned")
    wait_for(
        lambda: model_of(reported(setup.admin, gateway) or {"models": []}, "chat")["pinned"],
        30, "the controller's list to show it pinned",
    )  # fmt: skip
    assert setup.admin.post(f"/v1/gateways/{name}/models/chat/unpin").status_code == 202
    wait_for(lambda: not own_view(gateway, "chat")["pinned"], 30, "the model unpinned")

    with gateway.client() as client:  # started: warm, holding its lease
        answer = client.post("/v1/chat/completions", json=chat("chat", max_tokens=4))
        assert answer.status_code == 200, answer.text
    wait_for(
        lambda: model_of(reported(setup.admin, gateway) or {"models": []}, "chat")["held_mb"],
        30, "the controller's list to show the memory held",
    )  # fmt: skip
    assert setup.admin.post(f"/v1/gateways/{name}/models/chat/unload").status_code == 202
    wait_for(lambda: own_view(gateway, "chat")["state"] == "cold", 60, "the model stopped")
    wait_for(lambda: not setup.held("chat"), 30, "its lease released")
    wait_for(
        lambda: model_of(reported(setup.admin, gateway) or {"models": []}, "chat")["state"]
        == "cold",
        30, "the controller's list to show it stopped",
    )  # fmt: skip


def test_bad_commands_and_reports_are_refused_naming_why_and_change_nothing(
    setup: Setup,
) -> None:
    gateway_token = setup.server.token("gateway", "box")
    gateway = gateway_in(setup, "gateway", gateway_token, worker="box")
    found = wait_for(lambda: reported(setup.admin, gateway), 30, "the gateway's report")
    name = found["name"]

    unknown = setup.admin.post("/v1/gateways/nowhere/models/chat/pin")
    assert unknown.status_code == 404 and "nowhere" in unknown.json()["error"]["message"]
    no_model = setup.admin.post(f"/v1/gateways/{name}/models/embed/pin")
    assert no_model.status_code == 404
    assert "no model 'embed'" in no_model.json()["error"]["message"]
    verb = setup.admin.post(f"/v1/gateways/{name}/models/chat/reboot")
    assert verb.status_code == 422
    assert verb.json()["error"]["details"]["errors"][0]["field"] == "path.verb"
    bad_name = setup.admin.put("/v1/gateways/Not%20a%20name", json={"models": []})
    assert bad_name.status_code == 422 and bad_name.json()["error"]["details"]["field"] == "name"
    with setup.server.client(gateway_token) as own:  # the gateway's own token: no commands
        refused = own.post(f"/v1/gateways/{name}/models/chat/pin")
        assert refused.status_code == 403
        assert "only an admin" in refused.json()["error"]["message"]
    with setup.server.client(setup.server.token("gateway", "box")) as other:
        body = {"url": "http://elsewhere:1", "worker": "box"}
        taken = other.put(f"/v1/gateways/{name}", json=body)
        assert taken.status_code == 403
        assert "only the token that first reported it" in taken.json()["error"]["message"]
        assert other.delete(f"/v1/gateways/{name}").status_code == 403
    with setup.server.client(setup.server.token("client")) as client:
        joined = client.put("/v1/gateways/gw-new", json={"url": "http://elsewhere:1"})
        assert joined.status_code == 403
        assert "a client token may not report a gateway" in joined.json()["error"]["message"]
    extra = setup.admin.put(f"/v1/gateways/{name}", json={"models": [], "shell": "rm -rf"})
    assert extra.status_code == 422
    assert extra.json()["error"]["details"]["errors"][0]["field"] == "shell"

    after = reported(setup.admin, gateway)
    assert after is not None and after["commands_queued"] == 0
    assert [m["id"] for m in after["models"]] == ["chat"]
    assert own_view(gateway, "chat")["pinned"] is False


def gateway_in(
    setup: Setup, runtime: str, token: str | None = None, worker: str | None = None
) -> GatewayProcess:
    """A gateway of its own runtime directory (its own log, state and lock), beside
    ``worker`` when given."""
    models = model_entry("chat", setup.record, vram="1G")
    if worker is not None:
        models = f'[gateway]\nworker = "{worker}"\n\n' + models
    found = GatewayProcess(
        setup.server.url, token or setup.server.admin_token, setup.runtime / runtime, models
    )
    setup.started.append(found.start())
    return found


def test_a_gateway_stopped_says_goodbye_and_one_killed_turns_stale(setup: Setup) -> None:
    stopped = gateway_in(setup, "stopped")
    wait_for(lambda: reported(setup.admin, stopped), 30, "the first gateway's report")
    stopped.stop()  # SIGTERM: a clean stop
    wait_for(lambda: reported(setup.admin, stopped) is None, 30, "the goodbye")

    killed = gateway_in(setup, "killed")
    found = wait_for(lambda: reported(setup.admin, killed), 30, "the second gateway's report")
    killed.kill9()
    stale = wait_for(
        lambda: (reported(setup.admin, killed) or {}).get("stale"), 60, "the report stale"
    )
    assert stale is True
    late = setup.admin.post(f"/v1/gateways/{found['name']}/models/chat/pin")
    assert late.status_code == 409 and "nobody would take" in late.json()["error"]["message"]


def cli(setup: Setup, *args: str) -> subprocess.CompletedProcess[str]:
    """``gpu-arbiter ARGS`` against the controller, with no gateway given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_ARBITER_GATEWAY")}
    env["PYTHONPATH"] = str(SRC)
    command = [sys.executable, "-m", "gpu_arbiter", *args]
    command += ["--controller", setup.server.url, "--token", setup.server.admin_token]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_the_model_commands_without_a_gateway_go_through_the_controller(setup: Setup) -> None:
    gateway = gateway_in(setup, "gateway")
    found = wait_for(lambda: reported(setup.admin, gateway), 30, "the gateway's report")
    listed = cli(setup, "models")
    assert listed.returncode == 0, listed.stderr
    assert found["name"] in listed.stdout and "chat" in listed.stdout
    pinned = cli(setup, "pin", "chat")
    assert pinned.returncode == 0, pinned.stderr
    assert f"{found['name']}: pin chat queued" in pinned.stdout
    wait_for(lambda: own_view(gateway, "chat")["pinned"], 30, "the gateway's model pinned")
    unknown = cli(setup, "unpin", "embed")
    assert unknown.returncode == 1
    assert "no gateway reporting to the controller has a model 'embed'" in unknown.stderr
    assert own_view(gateway, "chat")["pinned"] is True
