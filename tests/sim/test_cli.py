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
    assert [p["policy"] for p in out["policies"]] == [
        "ours",
        "fifo",
        "priority",
        "slots",
        "lru",
        "prio-warm",
        "ollama",
    ]
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


def test_azure_slice_replays_with_its_mapping(tmp_path: Path) -> None:
    trace_file = tmp_path / "azure.jsonl"
    args = (
        "--azure",
        "tests/data/azure-llm-2023",
        "--azure-load",
        "0.5",
        "--azure-conv",
        "chat-8b:10G:interactive:8",
        "--azure-code",
        "none",
        "--azure-concurrency",
        "4",
        "--azure-batch",
        "20:12G:5:30-60",
        "--cluster",
        "4x24G",  # within capacity (0.86x), so that the goals are judged
    )
    out = _json(*args, "--save-trace", str(trace_file))
    assert (out["azure"], out["load"], out["seed"]) == ("tests/data/azure-llm-2023", 0.5, 1)
    saved = [json.loads(line) for line in trace_file.read_text().splitlines()]
    assert {r["model"] for r in saved if r["holder"].startswith("conv")} == {"chat-8b"}
    assert not any(r["holder"].startswith("code") for r in saved)
    assert {r["holder"] for r in saved} >= {"conv-1", "conv-2", "batch"}
    for summary in out["policies"]:
        assert set(summary) >= {"busy_mem_util", "mem_util", "mem_util_no_idle"}
        assert summary["mem_util_no_idle"] <= summary["mem_util"]
    assert set(out["targets"]) >= {"interactive_p99", "busy_mem", "batch_max", "safety"}
    replay = _json(str(trace_file), "--cluster", "4x24G")
    assert replay["policies"] == out["policies"]


def test_an_overloaded_run_judges_no_goal_and_the_azure_defaults_fit() -> None:
    """Every request of the slice on one 24 GiB GPU asks for 2.8x what it holds: the table
    says so and judges no goal. Given no cluster and no load, --azure runs on 2x24G at
    0.01, within capacity, and judges the goals."""
    slice_ = ("--azure", "tests/data/azure-llm-2023", "--policy", "ours,fifo,priority")
    over = _run(*slice_, "--azure-load", "1", "--cluster", "1x24G", "--seed", "3")
    assert over.returncode == 0, over.stderr
    assert "offered load 2.83x capacity" in over.stdout  # the table's title
    assert "goals not judged: offered load 2.8x capacity: the trace asks for" in over.stdout
    assert "wait <= best safe baseline" not in over.stdout
    assert "busy memory >=" not in over.stdout
    assert "zero over-commit, concurrent loads, violations: 0, 0, 0: met" in over.stdout
    judged = _json(*slice_, "--azure-load", "1", "--cluster", "1x24G", "--seed", "3")
    assert judged["offered_load"] == 2.834
    assert judged["targets"]["not_judged"]["why"] == "offered load 2.8x capacity"
    assert set(judged["targets"]) == {"not_judged", "safety"}

    default = _json(*slice_)
    assert (default["cluster"], default["load"]) == ("2x24G", 0.01)
    assert default["offered_load"] < 1
    assert "not_judged" not in default["targets"] and "interactive_p99" in default["targets"]


def test_tiers_compare_keep_warm_sleep_and_stop_only() -> None:
    """``--policy tiers`` runs ours, ours-sleep and ours-stop with the sleep options given;
    the goals are judged against baselines only, so with no baseline there are none."""
    out = _json(
        "--azure",
        "tests/data/azure-llm-2023",
        "--azure-conv",
        "chat-8b:10G:interactive:20",
        "--azure-code",
        "code-8b:10G:normal:20",
        "--azure-batch",
        "none",
        "--azure-tokens",
        "40000:4000",
        "--azure-concurrency",
        "4",
        "--azure-gap",
        "0.5",
        "--keep-alive",
        "30",
        "--cluster",
        "1x24G",
        "--policy",
        "tiers",
        "--sleep-after",
        "1",
        "--sleep-resident",
        "0.2",
        "--wake-s",
        "0.5",
    )
    assert out["sleep"] == {"after_s": 1.0, "resident": 0.2, "sleep_s": 2.0, "wake_s": 0.5}
    ours, sleep, stop = out["policies"]
    assert [ours["policy"], sleep["policy"], stop["policy"]] == ["ours", "ours-sleep", "ours-stop"]
    assert sleep["sleeps"] > 0 and sleep["wakes"] > 0
    assert ours["sleeps"] == stop["sleeps"] == stop["warm_starts"] == 0
    assert stop["loads"] > sleep["loads"]
    assert sleep["mem_util"] < ours["mem_util"]
    for summary in out["policies"]:
        assert summary["violations"] == summary["overcommits"] == summary["unfinished"] == 0
    assert set(out["targets"]) == {"safety"}


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
        (["missing.jsonl", "--generate", "chat"], "error: give one of a TRACE file"),
        (["--azure", "tests/data/azure-llm-2023", "--generate", "chat"], "error: give one of"),
        (["--azure", "tests/data"], "error: azure: "),
        (["--azure", "tests/data/azure-llm-2023", "--azure-load", "2"], "error: azure-load: "),
        (
            ["--azure", "tests/data/azure-llm-2023", "--azure-conv", "x:1G"],
            "error: azure service: ",
        ),
        (["--azure", "tests/data/azure-llm-2023", "--azure-batch", "5"], "error: azure batch: "),
        (["--azure", "tests/data/azure-llm-2023", "--azure-tokens", "9"], "error: azure-tokens: "),
        (["--azure", "tests/data/azure-llm-2023", "--azure-gap", "-1"], "error: azure-gap: "),
        (["--sleep-resident", "1"], "error: sleep-resident: "),
        (["--sleep-after", "x"], "error: sleep-after: "),
        (["--wake-s", "-1"], "error: wake-s: "),
        (["--sleep-s", "inf"], "error: sleep-s: "),
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
