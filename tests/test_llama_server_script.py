"""``scripts/llama-server``: which llama.cpp server the tests get, where one is there
already (its build, 15 minutes long, is left to CI's fresh machines)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _program(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho llama-server stub\n")
    path.chmod(0o755)
    return path


def _run(repo: Path, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The script as a copy in ``repo`` would run, with ``home``'s cache."""
    environment = {k: v for k, v in os.environ.items() if k != "GPU_ARBITER_LLAMA_SERVER"}
    environment |= {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), **env}
    script = repo / "scripts" / "llama-server"
    return subprocess.run(
        [str(script)], capture_output=True, text=True, env=environment, timeout=60
    )


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "work" / "repo"
    shutil.copytree(SCRIPTS, repo / "scripts")
    return repo


def test_the_variable_then_shared_then_the_cache(tmp_path: Path) -> None:
    repo, home = _repo(tmp_path), tmp_path / "home"
    cached = _program(home / ".cache/gpu-arbiter/llama-server/llama-cpp-python-0.3.36/llama-server")
    assert _run(repo, home).stdout == f"{cached}\n"  # no ../shared: the cached build
    shared = _program(tmp_path / "work" / "shared" / "bin" / "llama-server")
    assert _run(repo, home).stdout == f"{shared}\n"  # ../shared beside the repository
    named = _program(tmp_path / "elsewhere" / "llama-server")
    done = _run(repo, home, GPU_ARBITER_LLAMA_SERVER=str(named))
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{named}\n", "")


def test_a_variable_naming_no_program_is_an_error(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    _program(tmp_path / "work" / "shared" / "bin" / "llama-server")
    done = _run(repo, tmp_path / "home", GPU_ARBITER_LLAMA_SERVER=str(tmp_path / "nope"))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"GPU_ARBITER_LLAMA_SERVER={tmp_path}/nope is not an executable file\n"
