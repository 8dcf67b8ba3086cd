"""``gpu-arbiter logs MODEL``: the last lines (reaching back into the rotated file),
following through a rotation, and an unknown model named with those that have logs.
The real command, on logs written the way the launcher writes them (ModelLog)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_arbiter.gateway.servers.interfaces import log_path
from gpu_arbiter.gateway.servers.process import ModelLog

pytestmark = pytest.mark.timeout(60)

SRC = Path(__file__).resolve().parents[2] / "src"


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpu_arbiter", "logs", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC)}


def _logs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_command(*args), capture_output=True, text=True, env=_env(), timeout=30)


def _written(state: Path, model: str, count: int, max_bytes: int) -> ModelLog:
    """A model log of ``count`` numbered lines, rotated at ``max_bytes``."""
    model_log = ModelLog(log_path(state, model), max_bytes)
    for i in range(count):
        model_log.write(f"line {i}\n".encode())
    return model_log


def test_the_last_lines_reach_back_into_the_rotated_file(tmp_path: Path) -> None:
    _written(tmp_path, "chat", 100, max_bytes=200).close()
    rotated = log_path(tmp_path, "chat").with_name("chat.log.1")
    assert rotated.exists()
    kept = len(log_path(tmp_path, "chat").read_text().splitlines())

    done = _logs("chat", "--state-dir", str(tmp_path), "--lines", str(kept + 3))

    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"line {i}" for i in range(100 - kept - 3, 100)]
    assert _logs("chat", "--state-dir", str(tmp_path), "-n", "2").stdout == "line 98\nline 99\n"


def test_an_unknown_model_is_named_with_the_models_that_have_logs(tmp_path: Path) -> None:
    none = _logs("chat", "--state-dir", str(tmp_path))
    assert none.returncode == 1
    assert none.stderr == (
        f"gpu-arbiter logs: no log of model chat (none in {tmp_path / 'gateway' / 'logs'})\n"
    )
    for model in ("embed", "chat"):
        _written(tmp_path, model, 1, max_bytes=1000).close()

    unknown = _logs("../chat", "--state-dir", str(tmp_path))

    assert unknown.returncode == 1 and unknown.stdout == ""
    assert unknown.stderr == (
        "gpu-arbiter logs: no log of model ../chat (models with logs: chat, embed)\n"
    )


def _read_until(proc: subprocess.Popen[bytes], text: bytes, timeout_s: float = 30.0) -> bytes:
    assert proc.stdout is not None
    found = b""
    deadline = time.monotonic() + timeout_s
    while text not in found:
        assert time.monotonic() < deadline, f"never printed {text!r}: {found!r}"
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            found += os.read(proc.stdout.fileno(), 65536)
    return found


def test_follow_prints_what_is_written_through_a_rotation_until_ctrl_c(tmp_path: Path) -> None:
    model_log = _written(tmp_path, "chat", 3, max_bytes=100)
    with subprocess.Popen(
        _command("chat", "--state-dir", str(tmp_path), "--follow", "-n", "1"),
        stdout=subprocess.PIPE, env=_env(),
    ) as proc:  # fmt: skip
        try:
            assert _read_until(proc, b"line 2\n") == b"line 2\n"
            for i in range(3, 21):  # past 100 bytes: rotated once on the way
                model_log.write(f"line {i}\n".encode())
            assert log_path(tmp_path, "chat").with_name("chat.log.1").exists()
            printed = _read_until(proc, b"line 20\n")
            assert printed.decode().splitlines() == [f"line {i}" for i in range(3, 21)]
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 130
        finally:
            model_log.close()
            if proc.poll() is None:
                proc.kill()
