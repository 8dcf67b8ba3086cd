"""A running gateway's models change without a restart, in front of llama.cpp's real
server on a tiny GGUF model, with a real controller and agent: SIGHUP reads its
models.toml again (a model added is served, one removed is a 404 naming the reload, a
change in place keeps the server's pid, a new command starts a new one, a bad file
changes nothing); ``POST /admin/reload`` does the same for an admin key, and so does
``gpu-arbiter gateways reload``; ``serve --local --models`` reloads on SIGHUP too."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from .agents import env_for
from .conftest import Server, wait_for
from .gateways import LISTENING, GatewayProcess, chat
from .test_gateway import Setup, setup
from .test_gateway_llama import llama_entry

__all__ = ["setup"]

pytestmark = pytest.mark.timeout(180)

ADMIN_KEY = "admin-key-0123456789"
USER_KEY = "user-key-0123456789"
KEYS = f"""[gateway]
[[gateway.keys]]
key = "{ADMIN_KEY}"
name = "ops"
role = "admin"
[[gateway.keys]]
key = "{USER_KEY}"
name = "app"
"""


def entry(name: str, llama_server: Path, tiny_models: Path, **keys: Any) -> str:
    model = tiny_models / "tiny-chat.gguf"
    keys = {"vram": "1G", "keep_alive": "5m", **keys}
    return llama_entry(name, llama_server, model, **keys)[0]


def reload_by_signal(gateway: GatewayProcess, models: str, says: str) -> None:
    """Writes ``models`` as the gateway's file, sends SIGHUP, waits for its log line."""
    gateway.config.write_text(models)
    assert gateway.proc is not None
    before = gateway.started_log().count(says)
    gateway.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: gateway.started_log().count(says) > before, 30, f"the log line {says!r}")


def ask(gateway: GatewayProcess, model: str, **headers: str) -> httpx.Response:
    with gateway.client(headers=headers) as client:
        return client.post("/v1/chat/completions", json=chat(model, max_tokens=4))


def pid_of(gateway: GatewayProcess, model: str) -> int:
    [replica] = gateway.model_state(model)["replicas"]
    return int(replica["pid"])


def test_sighup_adds_a_model_served_at_once_and_removes_one_with_a_404(
    setup: Setup, llama_server: Path, tiny_models: Path
) -> None:
    setup.agent()
    gateway = setup.gateway(entry("chat", llama_server, tiny_models))
    assert ask(gateway, "chat").status_code == 200
    reload_by_signal(
        gateway, entry("small", llama_server, tiny_models),
        "reloaded: added small; removed chat",
    )  # fmt: skip
    answer = ask(gateway, "small")
    assert answer.status_code == 200, answer.text
    gone = ask(gateway, "chat")
    assert gone.status_code == 404
    message = gone.json()["error"]["message"]
    assert message.startswith("model chat was removed by the reload of models.toml at ")
    wait_for(lambda: not setup.held("chat"), 30, "the removed model's lease released")
    wait_for(
        lambda: [m["id"] for m in setup.admin.get("/v1/gateways").json()[0]["models"]] == ["small"],
        10,
        "the controller told",
    )


def test_in_place_keeps_the_pid_and_a_new_command_starts_a_new_one(
    setup: Setup, llama_server: Path, tiny_models: Path
) -> None:
    setup.agent()
    gateway = setup.gateway(entry("chat", llama_server, tiny_models))
    assert ask(gateway, "chat").status_code == 200
    pid = pid_of(gateway, "chat")
    models = entry("chat", llama_server, tiny_models, max_parallel=2, aliases=["gpt"])
    reload_by_signal(gateway, models, "reloaded: in place: chat")
    assert ask(gateway, "gpt").status_code == 200  # its new alias
    assert pid_of(gateway, "chat") == pid  # the same server
    flags = ("--temp", "0.5")
    changed = llama_entry(
        "chat", llama_server, tiny_models / "tiny-chat.gguf", vram="1G", keep_alive="5m",
        max_parallel=2, aliases=["gpt"], flags=flags,
    )[0]  # fmt: skip
    reload_by_signal(gateway, changed, "reloaded: replaced chat")
    wait_for(
        lambda: [r["pid"] for r in gateway.model_state("chat")["replicas"]] not in ([pid], []),
        60,
        "the new server in place of the old one",
    )
    wait_for(lambda: len(gateway.model_state("chat")["replicas"]) == 1, 60, "the old one gone")
    assert pid_of(gateway, "chat") != pid
    assert ask(gateway, "chat").status_code == 200


def test_a_bad_file_changes_nothing_and_says_why(
    setup: Setup, llama_server: Path, tiny_models: Path
) -> None:
    setup.agent()
    good = entry("chat", llama_server, tiny_models)
    gateway = setup.gateway(good)
    assert ask(gateway, "chat").status_code == 200
    pid = pid_of(gateway, "chat")
    bad = good + "bogus = 1\n"
    reload_by_signal(gateway, bad, "reload refused, nothing changed: models.chat.bogus: unknown")
    missing = good.replace(str(llama_server), "/nowhere/llama-server")
    reload_by_signal(gateway, missing, "models.chat.command: /nowhere/llama-server is not")
    assert ask(gateway, "chat").status_code == 200
    assert pid_of(gateway, "chat") == pid


def test_admin_reload_takes_an_admin_key_and_the_cli_prints_what_changed(
    setup: Setup, llama_server: Path, tiny_models: Path
) -> None:
    setup.agent()
    gateway = setup.gateway(KEYS + entry("chat", llama_server, tiny_models))
    gateway.config.write_text(
        KEYS.replace("[gateway]", "[gateway]\nmax_headers = 50")
        + entry("chat", llama_server, tiny_models)
        + entry("small", llama_server, tiny_models)
    )
    with gateway.client() as client:
        assert client.post("/admin/reload", json={}).status_code == 401
        user = {"authorization": f"Bearer {USER_KEY}"}
        assert client.post("/admin/reload", json={}, headers=user).status_code == 403
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        done = client.post("/admin/reload", json={}, headers=admin)
        assert done.status_code == 200, done.text
        assert done.json()["added"] == ["small"]
        assert done.json()["not_applied"] == ["gateway.max_headers"]  # the listener's
        gateway.config.write_text(KEYS + entry("chat", llama_server, tiny_models, vram="7X"))
        refused = client.post("/admin/reload", json={}, headers=admin)
        assert refused.status_code == 422
        assert refused.json()["error"]["param"] == "models.chat.vram"
    assert ask(gateway, "small", authorization=f"Bearer {USER_KEY}").status_code == 200
    gateway.config.write_text(KEYS + entry("chat", llama_server, tiny_models))
    command = [sys.executable, "-m", "gpu_arbiter", "gateways", "reload"]
    command += ["--gateway", gateway.url, "--key", ADMIN_KEY]
    printed = subprocess.run(
        command, capture_output=True, text=True, env=env_for(gateway.runtime), timeout=60
    )
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == f"{gateway.url}: removed small"


def test_serve_local_reloads_its_models_on_sighup(
    start_server: Callable[..., Server],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    llama_server: Path,
    tiny_models: Path,
) -> None:
    """The gateway in the controller's process: SIGHUP reads ``--models`` again."""
    monkeypatch.setenv("GPU_ARBITER_RUNTIME_DIR", str(tmp_path / "rt"))
    models = tmp_path / "models.toml"
    models.write_text("[gateway]\nport = 0\n")  # no model yet
    server = start_server(
        "--local", "--simulate", "1x24G", "--models", str(models), state_dir=tmp_path / "state"
    )
    port = wait_for(lambda: LISTENING.findall(server.log.read_text()), 60, "the gateway")[-1]
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, timeout=60) as client:
        none = client.post("/v1/chat/completions", json=chat("chat", max_tokens=4))
        assert none.status_code == 404
        assert none.json()["error"]["message"] == "no model is served here yet: 'chat' is not known"
        models.write_text("[gateway]\nport = 0\n" + entry("chat", llama_server, tiny_models))
        assert server.proc is not None
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded: added chat" in server.log.read_text(), 30, "the reload")
        answer = client.post("/v1/chat/completions", json=chat("chat", max_tokens=4))
        assert answer.status_code == 200, answer.text
    assert server.proc.poll() is None  # SIGHUP did not stop the controller
