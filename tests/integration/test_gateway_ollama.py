"""Ollama through a real gateway, controller and agent (fake probe): one ``ollama serve``
(a fake that follows Ollama's HTTP API and takes each loaded model's memory in the
probe: tests/integration/engine_servers.py) holds two models, each a model of the
gateway with a lease of its own, driven by the official ``openai`` SDK."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from .conftest import gpu_figures, wait_for
from .gateways import GatewayProcess
from .test_engines import ENGINE_SERVERS
from .test_gateway import Setup, _gateway_command, setup
from .test_gateway_admin import cli

__all__ = ["setup"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(180)
TINY_MB, SMALL_MB = 2000, 3000  # what the fake loads them into (size_vram)
MODELS = ("tiny:1b", "small")


def ollama_entry(**keys: Any) -> str:
    """``[models.local]``: one fake ``ollama serve`` on ``OLLAMA_HOST`` for two models,
    each asked for above what it loads into."""
    command = ["env", "OLLAMA_HOST=127.0.0.1:{port}", sys.executable, str(ENGINE_SERVERS)]
    command += ["ollama", "--ollama-model", f"tiny:1b={TINY_MB}"]
    command += ["--ollama-model", f"small:latest={SMALL_MB}", "--free-s", "0.3"]
    keys = {"engine": "ollama", "idle_after": "0.2s", "grace": "2s", "queue_timeout": "60s",
            **keys}  # fmt: skip
    lines = ["[models.local]", f"command = {json.dumps(command)}"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
    lines += ["[models.local.ollama_models]", '"tiny:1b" = "3G"', '"small" = "4G"']
    return "\n".join(lines) + "\n"


def sdk(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def ask(client: openai.OpenAI, model: str) -> str:
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.model in (model, f"{model}:latest")  # Ollama was asked by its own name
    return answer.choices[0].message.content or ""


def listed(gateway: GatewayProcess, through: str) -> list[str]:
    """What the serve's ``/api/ps`` lists, asked through a loaded model's prefix route."""
    with gateway.client() as client:
        answer = client.get(f"/models/{through}/api/ps")
    assert answer.status_code == 200, answer.text
    return [m["name"] for m in answer.json()["models"]]


def serves(runtime: Path) -> list[dict[str, Any]]:
    """The process groups the gateway runs (its servers.json)."""
    found: list[dict[str, Any]] = json.loads((runtime / "state/gateway/servers.json").read_text())[
        "servers"
    ]
    return found


def lease_of(setup: Setup, model: str) -> dict[str, Any] | None:
    held = setup.held(model)
    return held[0] if len(held) == 1 else None


def test_two_models_of_one_serve_each_hold_a_lease_of_their_own(setup: Setup) -> None:
    setup.agent()
    gateway = setup.gateway(ollama_entry(keep_alive="3s"))
    with sdk(gateway) as client:
        assert ask(client, "tiny:1b") == "hi"
        assert ask(client, "small") == "hi"
        assert sorted(m.id for m in client.models.list().data) == ["small", "tiny:1b"]
    assert len(serves(setup.runtime)) == 1  # one serve for both
    tiny = wait_for(lambda: (lease := lease_of(setup, "tiny:1b")) and lease["vram_mb"] == TINY_MB
                    and lease, 30, "tiny's lease shrunk to its size_vram")  # fmt: skip
    small = wait_for(lambda: (lease := lease_of(setup, "small")) and lease["vram_mb"] == SMALL_MB
                     and lease, 30, "small's lease shrunk to its size_vram")  # fmt: skip
    assert tiny["id"] != small["id"]
    assert gateway.model_state("small")["replicas"][0]["pid"] is None  # not attached
    assert sorted(listed(gateway, "small")) == ["small:latest", "tiny:1b"]
    pinned = cli("pin", "small", "--gateway", gateway.url)
    assert pinned.returncode == 0, pinned.stderr
    # tiny reaches keep_alive: unloaded from the serve, its lease released; small stays
    wait_for(lambda: not setup.held("tiny:1b"), 30, "tiny's lease released")
    assert listed(gateway, "small") == ["small:latest"]
    assert lease_of(setup, "small") is not None and len(serves(setup.runtime)) == 1
    # an operator's unload of the last one: released, and the serve stopped
    unloaded = cli("unload", "small", "--gateway", gateway.url)
    assert unloaded.returncode == 0, unloaded.stderr
    wait_for(lambda: not setup.held("small"), 30, "small's lease released")
    wait_for(lambda: not serves(setup.runtime), 30, "the serve stopped")
    assert gateway.model_state("small")["state"] == "cold"
    with sdk(gateway) as client:  # and the next request starts it again
        assert ask(client, "tiny:1b") == "hi"
    assert lease_of(setup, "tiny:1b") is not None


def test_a_model_ollama_drops_by_itself_releases_its_lease(setup: Setup) -> None:
    setup.agent()
    gateway = setup.gateway(ollama_entry(keep_alive="5m"))
    with sdk(gateway) as client:
        assert ask(client, "tiny:1b") == "hi"
        assert ask(client, "small") == "hi"
    # a request of Ollama's own API that sets its own keep_alive: Ollama unloads it
    body = {"model": "tiny:1b", "messages": [{"role": "user", "content": "hi"}]}
    with gateway.client() as http:
        answer = http.post("/models/tiny:1b/api/chat", json={**body, "keep_alive": "1s"})
    assert answer.status_code == 200, answer.text
    wait_for(lambda: not setup.held("tiny:1b"), 30, "the dropped model's lease released")
    assert listed(gateway, "small") == ["small:latest"]
    assert gateway.model_state("tiny:1b")["state"] == "cold"  # not a failure: no backoff
    with sdk(gateway) as client:
        assert ask(client, "tiny:1b") == "hi"  # loaded again
    assert lease_of(setup, "tiny:1b") is not None and lease_of(setup, "small") is not None


def test_the_serve_s_memory_counts_once_in_the_controller(setup: Setup) -> None:
    """The fake probe sees one process (the serve's group) holding both models' memory;
    the serve's account to the agent makes it theirs: the controller's free memory is the
    capacity less the two leases, not less the leases and the same memory again as
    external."""
    setup.agent()
    gateway = setup.gateway(ollama_entry(keep_alive="5m"))
    with sdk(gateway) as client:
        assert ask(client, "tiny:1b") == "hi"
        assert ask(client, "small") == "hi"

    def sizes() -> list[Any]:
        return [(lease_of(setup, model) or {}).get("vram_mb") for model in MODELS]

    wait_for(lambda: sizes() == [TINY_MB, SMALL_MB], 30, "both leases shrunk to size_vram")
    held = TINY_MB + SMALL_MB

    def counted_once() -> dict[str, Any] | None:
        [gpu] = gpu_figures(setup.admin).values()
        once = gpu["used_mb"] == held and gpu["free_mb"] == gpu["capacity_mb"] - held
        return gpu if once else None

    gpu = wait_for(counted_once, 30, f"the GPU's free memory = capacity - {held} MiB")
    assert gpu["committed_mb"] == held
    # one model unloaded: its memory is no longer the serve's, the other's still counts once
    unloaded = cli("unload", "tiny:1b", "--gateway", gateway.url)
    assert unloaded.returncode == 0, unloaded.stderr
    wait_for(lambda: not setup.held("tiny:1b"), 30, "tiny's lease released")

    def small_once() -> bool:
        [gpu] = gpu_figures(setup.admin).values()
        return bool(gpu["free_mb"] == gpu["capacity_mb"] - SMALL_MB)

    wait_for(small_once, 30, f"the GPU's free memory = capacity - {SMALL_MB} MiB")


def test_a_bad_ollama_models_entry_exits_2_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    entry = '[models.local]\ncommand = ["env", "OLLAMA_HOST=127.0.0.1:{port}", "ollama", "serve"]\n'
    config.write_text(entry + '[models.local.ollama_models]\n"llama3.2:3b" = "3X"\n')
    done = _gateway_command("--config", str(config))
    assert done.returncode == 2
    assert "models.local.ollama_models.\"llama3.2:3b\": '3X' is not a size" in done.stderr
    config.write_text(entry)
    done = _gateway_command("--config", str(config))
    assert done.returncode == 2
    assert "models.local.ollama_models: missing" in done.stderr
