"""A token named by the path of a file of mode 0600 (``--token-file``, ``[gateway]
token_file``), never written on a command line: read when it is the owner's only,
refused naming the path and its mode when others may read it, and a clear error when
it is missing or empty; through the real ``agent`` and ``gateway`` commands too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.paths import read_token_file

SRC = Path(__file__).resolve().parents[2] / "src"


def _file(path: Path, text: str, mode: int) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_token_file_of_mode_0600_is_read(tmp_path: Path) -> None:
    path = _file(tmp_path / "gateway.token", "gat_secret\n# a comment\n", 0o600)
    assert read_token_file(path) == "gat_secret"
    assert read_token_file(_file(tmp_path / "ro.token", " gat_ro \n", 0o400)) == "gat_ro"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_token_file_others_may_read_is_refused_naming_its_path_and_mode(
    tmp_path: Path, mode: int
) -> None:
    path = _file(tmp_path / "gateway.token", "gat_secret\n", mode)
    with pytest.raises(InvalidInput) as refused:
        read_token_file(path, "gateway.token_file")
    assert refused.value.field == "gateway.token_file"
    assert f"the token file {path} has mode {mode:04o}" in str(refused.value)
    assert f"chmod 600 {path}" in str(refused.value)
    assert "gat_secret" not in str(refused.value)


def test_a_missing_or_empty_token_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.token"
    with pytest.raises(InvalidInput, match=f"cannot read the token file {missing}: No such"):
        read_token_file(missing)
    empty = _file(tmp_path / "empty.token", "\n", 0o600)
    with pytest.raises(InvalidInput, match=f"the token file {empty} is empty"):
        read_token_file(empty)


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_ARBITER_")}
    env |= {"PYTHONPATH": str(SRC), "GPU_ARBITER_RUNTIME_DIR": str(tmp_path / "rt")}
    env["GPU_ARBITER_STATE_DIR"] = str(tmp_path / "state")
    command = [sys.executable, "-m", "gpu_arbiter", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_the_agent_refuses_a_token_file_others_may_read_and_a_missing_one(
    tmp_path: Path,
) -> None:
    shared = _file(tmp_path / "worker.token", "gat_secret\n", 0o644)
    base = ("agent", "--controller", "http://127.0.0.1:1", "--simulate", "1x1G")
    done = _run(tmp_path, *base, "--token-file", str(shared))
    assert done.returncode == 2
    said = " ".join(done.stderr.split())  # click wraps its box's lines
    assert "--token-file" in said and "has mode 0644" in said and "gat_secret" not in said
    done = _run(tmp_path, *base, "--token-file", str(tmp_path / "nowhere.token"))
    assert done.returncode == 2 and "cannot read the token file" in " ".join(done.stderr.split())


def test_the_gateway_reads_its_configured_token_file_and_refuses_one_others_may_read(
    tmp_path: Path,
) -> None:
    config = tmp_path / "models.toml"
    table = '[models.chat]\ncommand = "no-such-server-7f3 --port {port}"\nvram = "1G"\n'
    config.write_text('[gateway]\ntoken_file = "gateway.token"\n\n' + table)
    shared = _file(tmp_path / "gateway.token", "gat_secret\n", 0o644)
    base = ("gateway", "--config", str(config), "--controller", "http://127.0.0.1:1")
    done = _run(tmp_path, *base)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (  # after the warning for the program
        f"gpu-arbiter gateway: gateway.token_file: the token file {shared} has mode 0644: "
        f"others than its owner may read it; make it 0600 (chmod 600 {shared})"
    )
    done = _run(tmp_path, *base, "--token-file", str(tmp_path / "nowhere.token"))
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].startswith(
        "gpu-arbiter gateway: --token-file: cannot read the token file"
    )
    done = _run(tmp_path, *base, "--token-file", str(shared), "--token", "gat_x")
    assert done.returncode == 2 and "not both" in done.stderr
