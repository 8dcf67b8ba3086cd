"""Traces, clusters and policies: what is accepted, and clear errors for the rest."""

from __future__ import annotations

import pytest

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.sim import (
    TraceError,
    dump_trace,
    generate,
    load_trace,
    parse_cluster,
    parse_policies,
    parse_trace,
)


def test_trace_fields_and_defaults() -> None:
    [request] = parse_trace(
        [
            '{"arrival_s": 1.5, "model": "m", "vram_mb": "1.5G", "run_s": 3,'
            ' "constraints": {"gpu_arch": ["sm_89"]}}'
        ]
    )
    assert (request.vram_mb, request.gpus, request.priority, request.preemptible) == (
        1536,
        1,
        500,
        True,
    )
    assert request.constraints.gpu_arch == ("sm_89",)
    assert parse_trace(dump_trace([request]).splitlines()) == [request]


@pytest.mark.parametrize(
    ("line", "where"),
    [
        ("{not json", "line 2: json"),
        ("[1]", "line 2: json"),
        ('{"model": "m", "vram_mb": 1, "run_s": 1}', "line 2: arrival_s"),
        ('{"arrival_s": -1, "model": "m", "vram_mb": 1, "run_s": 1}', "line 2: arrival_s"),
        ('{"arrival_s": 0, "model": "m", "vram_mb": "8X", "run_s": 1}', "line 2: vram_mb"),
        ('{"arrival_s": 0, "model": "m", "vram_mb": 1, "run_s": 0}', "line 2: run_s"),
        (
            '{"arrival_s": 0, "model": "m", "vram_mb": 1, "run_s": 1, "priority": "vip"}',
            "line 2: priority",
        ),
        ('{"arrival_s": 0, "model": "m", "vram_mb": 1, "run_s": 1, "gpus": 0}', "line 2: gpus"),
        ('{"arrival_s": 0, "model": "m", "vram_mb": 1, "run_s": 1, "colour": 1}', "line 2: colour"),
        (
            '{"arrival_s": 0, "model": "m", "vram_mb": 1, "run_s": 1,'
            ' "constraints": {"gpu_arch": ["sm_8 6"]}}',
            "line 2: constraints.gpu_arch",
        ),
        (
            '{"arrival_s": 0, "model": "m", "vram_mb": 1, "run_s": 1, "constraints": {"x": 1}}',
            "line 2: constraints",
        ),
    ],
)
def test_trace_errors_name_line_and_field(line: str, where: str) -> None:
    good = '{"arrival_s": 0, "model": "m", "vram_mb": 1, "run_s": 1}'
    with pytest.raises(TraceError) as info:
        parse_trace(["# a comment", line, good])
    assert str(info.value).startswith(where + ":")


def test_trace_file_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidInput, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n# nothing\n")
    with pytest.raises(InvalidInput, match="no requests"):
        load_trace(empty)


def test_cluster_specs() -> None:
    assert [len(g) for _, g in parse_cluster("medium").workers] == [1, 1, 2, 2]
    large = parse_cluster("large")
    assert (len(large.workers), large.largest_gpu_mb, large.gpus[0].arch) == (2, 81920, "sm_90")
    cluster = parse_cluster("3w:2x16G@sm_86+1x48G")
    assert [w.name for w, _ in cluster.workers] == ["w1", "w2", "w3", "w4"]
    assert cluster.total_mb == 3 * 2 * 16384 + 49152
    assert cluster.gpus[0].arch == "sm_86"


@pytest.mark.parametrize("spec", ["", "huge", "0x24G", "2w:1x", "1x24Q", "2w:1x24G+", "1x24G@SM 9"])
def test_bad_cluster_specs(spec: str) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_cluster(spec)
    assert str(info.value).startswith("cluster")


def test_policies_and_kinds() -> None:
    assert parse_policies("all") == [
        "ours",
        "fifo",
        "priority",
        "slots",
        "lru",
        "prio-warm",
        "ollama",
    ]
    assert parse_policies("tiers") == ["ours", "ours-sleep", "ours-stop"]
    assert parse_policies("all,tiers")[-2:] == ["ours-sleep", "ours-stop"]
    assert parse_policies("Prio-Warm,ollama") == ["prio-warm", "ollama"]
    assert parse_policies("lru, ours,lru") == ["lru", "ours"]
    with pytest.raises(InvalidInput, match="policy"):
        parse_policies("ours,best")
    with pytest.raises(InvalidInput, match="generate"):
        generate("chat+video", 1, parse_cluster("single"))
    with pytest.raises(InvalidInput, match="hours"):
        generate("chat", 1, parse_cluster("single"), hours=0)
