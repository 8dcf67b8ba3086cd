"""``gpu-arbiter gateway``'s checks of a models file, through the real command."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from ..gateway.test_estimate import write_gguf
from ..integration.conftest import Server

SRC = Path(__file__).resolve().parents[2] / "src"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "GPU_ARBITER_RUNTIME_DIR": str(tmp_path)}
    env["GPU_ARBITER_STATE_DIR"] = str(tmp_path / "state")
    return env


def _gateway(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gpu_arbiter", "gateway", *args]
    return subprocess.run(command, capture_output=True, text=True, env=_env(tmp_path), timeout=60)


def test_check_says_which_server_it_read_and_which_flags(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    write_gguf(model)
    config = tmp_path / "models.toml"
    server = f"{sys.executable} -m llama_cpp.server --model {model}"
    config.write_text(f'[models.chat]\ncommand = "{server} --n_ctx 512 --port {{port}}"\n')
    done = _gateway(tmp_path, "--config", str(config), "--check")
    assert done.returncode == 0, done.stderr
    read = "read as llama-cpp-python: model file from --model, ctx 512 from --n_ctx"
    assert f"({model}; {read})" in done.stdout
    assert "\n  note: no --n_gpu_layers (llama-cpp-python's default: 0): no layer on the GPU" in (
        done.stdout
    )


def test_a_gateway_table_alone_checks_as_a_gateway_of_no_model_yet(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text("[gateway]\nport = 9123\n")
    done = _gateway(tmp_path, "--config", str(config), "--check")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("no model: no [models.NAME] table; the gateway serves")
    config.write_text("[gateway]\nport = 9123\ncatalogue = false\n")
    done = _gateway(tmp_path, "--config", str(config), "--check")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("no model: no [models.NAME] table, and catalogue = false")


def test_check_exits_2_naming_each_command_whose_program_is_not_found(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srv").write_text("#!/bin/sh\n")
    (bin_dir / "srv").chmod(0o755)
    config = tmp_path / "models.toml"
    config.write_text(
        '[models.a]\ncommand = "no-such-server-7f3 --port {port}"\nvram = "1G"\n'
        '[models.b]\ncommand = "/nowhere/bin/srv --port {port}"\nvram = "1G"\n'
        f'[models.c]\ncommand = "srv --port {{port}}"\nvram = "1G"\nenv = {{PATH = "{bin_dir}"}}\n'
    )
    done = _gateway(tmp_path, "--config", str(config), "--check")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"gpu-arbiter gateway: {config}: models.a.command: no-such-server-7f3 is not on PATH: "
        "install it, or give its full path",
        f"gpu-arbiter gateway: {config}: models.b.command: /nowhere/bin/srv is not an "
        "executable file",
    ]  # c's is found on the PATH its env gives it
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == ["a", "b", "c"]


def test_check_looks_past_env_to_the_program_it_runs(tmp_path: Path) -> None:
    """The Ollama example of docs/gateway.md, ``env NAME=VALUE program ...``: the program
    env runs is checked, past env's options and words, on the PATH env would search."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = shutil.which("env")
    assert env is not None
    (bin_dir / "env").symlink_to(env)
    (bin_dir / "srv").write_text("#!/bin/sh\n")
    (bin_dir / "srv").chmod(0o755)
    path = f'env = {{PATH = "{bin_dir}"}}\n'
    config = tmp_path / "models.toml"
    config.write_text(
        '[models.local]\ncommand = ["env", "OLLAMA_HOST=127.0.0.1:{port}", "ollama", "serve"]\n'
        f'{path}[models.local.ollama_models]\n"llama3.2:3b" = "3G"\n"qwen3:8b" = "6G"\n'
        '[models.b]\ncommand = "env -i -u HOME -- no-such-server-7f3 --port {port}"\n'
        f'vram = "1G"\n{path}'
        '[models.c]\ncommand = "env -i PATH=/nowhere srv --port {port}"\nvram = "1G"\n'
        f"{path}"
        f'[models.d]\ncommand = "env -i PATH={bin_dir} A=1 srv --port {{port}}"\nvram = "1G"\n'
        '[models.e]\ncommand = "env PORT={port}"\nvram = "1G"\n'
    )
    done = _gateway(tmp_path, "--config", str(config), "--check")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"gpu-arbiter gateway: {config}: models.local.command: ollama is not on PATH: "
        "install it, or give its full path",
        f"gpu-arbiter gateway: {config}: models.b.command: no-such-server-7f3 is not on "
        "PATH: install it, or give its full path",
        f"gpu-arbiter gateway: {config}: models.c.command: srv is not on PATH: install it, "
        "or give its full path",
        f"gpu-arbiter gateway: {config}: models.e.command: env is given no program to run",
    ]  # d's is found on the PATH env gives it


def test_a_gateway_starts_with_a_warning_for_a_program_not_found(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text('[models.a]\ncommand = "no-such-server-7f3 --port {port}"\nvram = "1G"\n')
    command = [sys.executable, "-m", "gpu_arbiter", "gateway", "--config", str(config)]
    command += ["--port", "0", "--controller", "http://127.0.0.1:1"]
    with subprocess.Popen(
        command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=_env(tmp_path), text=True
    ) as gateway:
        assert gateway.stderr is not None
        first = gateway.stderr.readline()  # said before it starts: it starts all the same
        gateway.send_signal(signal.SIGTERM)
        gateway.communicate(timeout=60)
    assert first == (
        f"gateway: warning: {config}: models.a.command: no-such-server-7f3 is not on PATH: "
        "install it, or give its full path; its requests fail until it is\n"
    )


def test_a_gateway_beside_a_local_controller_finds_its_admin_token(tmp_path: Path) -> None:
    server = Server(tmp_path / "state", "--simulate", "1x24G").start()
    config = tmp_path / "models.toml"
    config.write_text('[models.chat]\ncommand = "no-such-server-7f3 --port {port}"\nvram = "1G"\n')
    env = {**_env(tmp_path), "GPU_ARBITER_STATE_DIR": str(server.state_dir)}
    env["GPU_ARBITER_URL"] = server.url
    env.pop("GPU_ARBITER_TOKEN", None)  # none given: the state directory's admin token
    command = [sys.executable, "-m", "gpu_arbiter", "gateway", "--config", str(config)]
    try:
        with subprocess.Popen(
            [*command, "--port", "0"], stderr=subprocess.PIPE, env=env, text=True
        ) as gateway:
            assert gateway.stderr is not None
            port = next(m[1] for line in gateway.stderr if (m := LISTENING.search(line)))
            chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            answer = httpx.post(url, json=chat, timeout=60)
            gateway.send_signal(signal.SIGTERM)
            gateway.communicate(timeout=60)
        assert "unauthorized" not in answer.text  # its lease was granted: it could not start
        with server.client() as admin:
            holders = [lease["holder"] for lease in admin.get("/v1/leases").json()]
        assert any(holder.startswith("gateway chat #1@") for holder in holders), holders
    finally:
        server.stop()


LISTENING = re.compile(r"gateway on http://127\.0\.0\.1:(\d+)")


def test_check_takes_a_model_file_not_here_yet_and_names_a_bad_one(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    file = '{ name = "q.gguf", size = 1000, sha256 = "' + "ab" * 32 + '" }'
    entry = f'[models.chat]\ncommand = "{sys.executable} -m {{file}} --port {{port}}"\n'
    config.write_text(entry + f"file = {file}\n")
    done = _gateway(tmp_path, "--config", str(config), "--check")
    assert done.returncode == 0, done.stderr
    assert "chat: vram auto (estimated from its file once it is in models_dir)" in done.stdout
    config.write_text(entry + f"file = {file.replace('q.gguf', 'a/q.gguf')}\n")
    done = _gateway(tmp_path, "--config", str(config), "--check")
    assert done.returncode == 2
    assert "models.chat.file.name: 'a/q.gguf' is a path" in done.stderr
