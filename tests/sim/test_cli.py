"""``gpu-arbiter simulate`` as a user runs it: a subprocess, JSON read back, bad input refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "gpu_arbiter", "simulate", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def _json(*args: str) -> dict[str, Any]:
    result = _run(*args, "-o", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_generated_comparison_as_json_with_plots(tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.jsonl"
    out = _json(
        "--generate",
        "mixed",
        "--seed",
        "5",
        "--cluster",
        "4w:1x24G",
        "--hours",
        "0.25",
        "--plots",
        str(tmp_path / "plots"),
        "--save-trace",
        str(trace_file),
    )
    assert [p["policy"] for p in out["policies"]] == ["ours", "fifo", "priority", "slots", "lru"]
    assert (out["generate"], out["seed"], out["cluster"]) == ("mixed", 5, "4w:1x24G")
    ours = out["policies"][0]
    assert ours["violations"] == ours["overcommits"] == ours["concurrent_loads"] == 0
    assert out["targets"]["safety"]["met"] is True
    for name in ("wait_cdf.png", "memory_utilization.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the saved trace replays to the very same figures
    replay = _json(str(trace_file), "--cluster", "4w:1x24G")
    assert replay["policies"] == out["policies"]
    assert replay["requests"] == out["requests"] == len(trace_file.read_text().splitlines())


def test_table_output_and_policy_choice(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "model": "m", "vram_mb": "4G", "run_s": 5}\n')
    result = _run(str(trace), "--policy", "ours,fifo")
    assert result.returncode == 0, result.stderr
    assert "ours" in result.stdout
    assert "fifo" in result.stdout
    assert "lru" not in result.stdout
    assert "zero over-commit" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cluster", "9x"], "error: cluster: "),
        (["--policy", "ours,magic"], "error: policy: "),
        (["--generate", "video"], "error: generate: "),
        (["--seed", "x"], "error: seed: "),
        (["--hours", "-1"], "error: hours: "),
        (["--keep-alive", "nan"], "error: keep-alive: "),
        (["-o", "yaml"], "error: output: "),
        (["missing.jsonl"], "error: trace: cannot read"),
        (["missing.jsonl", "--generate", "chat"], "error: give a TRACE file or --generate"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(args: list[str], message: str) -> None:
    result = _run(*args)
    assert result.returncode == 2
    assert result.stderr.startswith(message)
    assert result.stderr.count("\n") == 1
    assert result.stdout == ""


def test_bad_trace_line_names_line_and_field(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"arrival_s": 0, "model": "m", "vram_mb": "4G", "run_s": 5}\n'
        '{"arrival_s": 1, "model": "m", "vram_mb": "4X", "run_s": 5}\n'
    )
    result = _run(str(trace))
    assert result.returncode == 2
    assert result.stderr.startswith("error: line 2: vram_mb: ")
