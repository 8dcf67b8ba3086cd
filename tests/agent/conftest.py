"""Helpers for the probe tests: captured tool outputs and stand-in tool executables."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).resolve().parent.parent / "data"

MakeTool = Callable[[str, str], Path]


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """An empty directory to put on PATH."""
    path = tmp_path / "bin"
    path.mkdir()
    return path


@pytest.fixture
def make_tool(bin_dir: Path) -> MakeTool:
    """Writes an executable Python script ``name`` into ``bin_dir``: a real program that
    a probe runs as a real subprocess."""

    def make(name: str, body: str) -> Path:
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}", encoding="utf-8")
        path.chmod(0o755)
        return path

    return make


def _nvidia_smi_script(
    gpu_file: str, apps_file: str, *, gpu_rc: int = 0, apps_rc: int = 0, log: Path | None = None
) -> str:
    """The body of a stand-in ``nvidia-smi`` that prints captured outputs from tests/data."""
    return f"""
import pathlib, sys
args = sys.argv[1:]
if {str(log) if log else ""!r}:
    with open({str(log)!r}, "a") as log:
        log.write(" ".join(args) + "\\n")
if any(a.startswith("--query-gpu=") for a in args):
    sys.stdout.write(pathlib.Path({str(DATA / gpu_file)!r}).read_text())
    sys.exit({gpu_rc})
if any(a.startswith("--query-compute-apps=") for a in args):
    sys.stdout.write(pathlib.Path({str(DATA / apps_file)!r}).read_text())
    sys.exit({apps_rc})
sys.exit(2)
"""


def _rocm_smi_script(json_file: str, *, rc: int = 0) -> str:
    return f"""
import pathlib, sys
sys.stdout.write(pathlib.Path({str(DATA / json_file)!r}).read_text())
sys.exit({rc})
"""


@pytest.fixture
def fake_nvidia_smi(make_tool: MakeTool) -> Callable[..., Path]:
    """``fake_nvidia_smi(gpu_file, apps_file, gpu_rc=0, apps_rc=0, log=None)``: installs a
    stand-in ``nvidia-smi`` in ``bin_dir`` that prints those captured outputs."""

    def install(gpu_file: str, apps_file: str, **options: Any) -> Path:
        return make_tool("nvidia-smi", _nvidia_smi_script(gpu_file, apps_file, **options))

    return install


@pytest.fixture
def fake_rocm_smi(make_tool: MakeTool) -> Callable[..., Path]:
    """``fake_rocm_smi(json_file, rc=0)``: installs a stand-in ``rocm-smi`` in ``bin_dir``."""

    def install(json_file: str, **options: Any) -> Path:
        return make_tool("rocm-smi", _rocm_smi_script(json_file, **options))

    return install
