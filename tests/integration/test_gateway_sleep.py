"""The asleep tier through a real gateway, controller and agent (fake probe): a fake of
vLLM that follows its sleep-mode interface and frees memory in the probe as it sleeps
(tests/integration/engine_servers.py), and llama.cpp's real server sleeping by itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import wait_for
from .gateways import chat, metric
from .test_engines import ENGINE_SERVERS
from .test_gateway import Setup, setup

__all__ = ["setup"]

pytestmark = pytest.mark.timeout(180)


def entry(name: str, command: list[str], **keys: Any) -> str:
    keys = {"idle_after": "0.2s", "grace": "2s", "queue_timeout": "60s", **keys}
    lines = [f"[models.{name}]", f"command = {json.dumps(command)}"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
    return "\n".join(lines) + "\n"


def test_a_sleeping_vllm_gives_memory_back_and_a_request_takes_it_again(setup: Setup) -> None:
    setup.agent()
    command = [sys.executable, str(ENGINE_SERVERS), "vllm", "--port", "{port}"]
    command += ["--gpu-total-mb", "24576", "--resident-mb", "1500"]
    models = entry("chat", command, engine="vllm", vram="6G", sleep_after="2s", keep_alive="5m")
    gateway = setup.gateway(models)
    with gateway.client() as client:
        assert client.post("/v1/chat/completions", json=chat("chat")).status_code == 200
        pid = gateway.model_state("chat")["replicas"][0]["pid"]
        wait_for(lambda: gateway.model_state("chat")["state"] == "asleep", 60, "asleep")
        [lease] = setup.held("chat")
        wait_for(lambda: setup.held("chat")[0]["vram_mb"] < 6144, 30, "the lease shrunk")
        [lease] = setup.held("chat")
        assert 1500 <= lease["vram_mb"] <= 1600  # what the probe shows it keeps
        answer = client.post("/v1/chat/completions", json=chat("chat"))
        assert answer.status_code == 200, answer.text  # woken, not started again
        assert gateway.model_state("chat")["replicas"][0]["pid"] == pid
        held = sorted(lease["vram_mb"] for lease in setup.held("chat"))
        assert sum(held) == 6144  # what it kept, and the difference taken back
        extra = next(x for x in setup.held("chat") if x["vram_mb"] != held[0])
        assert extra["constraints"]["gpu_ids"] == ["box:0"]
        page = client.get("/metrics").text
    assert metric(page, "gpu_arbiter_gateway_sleeps_total", model="chat") == 1
    assert metric(page, "gpu_arbiter_gateway_wakes_total", model="chat") == 1
    assert metric(page, "gpu_arbiter_gateway_cold_starts_total", model="chat") == 1


def test_the_real_llama_server_sleeps_and_a_request_wakes_it(
    setup: Setup, llama_server: Path, tiny_models: Path
) -> None:
    """llama.cpp sleeps by itself (``--sleep-idle-seconds``): the fake probe does not see
    its memory, so nothing is shown free and the lease keeps its size."""
    setup.agent()
    command = [str(llama_server), "-m", str(tiny_models / "tiny-chat.gguf"), "-c", "512"]
    command += ["--port", "{port}", "-t", "1"]
    gateway = setup.gateway(entry("chat", command, vram="1G", sleep_after="1s"))
    url = gateway.url + "/v1/chat/completions"
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(url, json=body, timeout=60).status_code == 200
    wait_for(lambda: gateway.model_state("chat")["state"] == "asleep", 60, "asleep")
    [lease] = setup.held("chat")
    assert lease["vram_mb"] == 1024
    answer = httpx.post(url, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert gateway.model_state("chat")["state"] in ("warm", "busy")
