"""The Azure LLM inference trace as simulator input: a committed slice of the real CSVs."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.sim import Simulation, dump_trace, parse_cluster, parse_trace
from gpu_arbiter.sim.azure import (
    AzureMapping,
    BatchJobs,
    Call,
    Service,
    convert,
    parse_batch,
    parse_service,
    read_azure,
)
from gpu_arbiter.sim.ours import Ours

Services = dict[str, list[Call]]
SLICE = Path(__file__).resolve().parents[1] / "data" / "azure-llm-2023"


@pytest.fixture(scope="module")
def services() -> Services:
    return read_azure(SLICE)


def test_the_slice_is_read_with_times_from_the_earliest_arrival(services: Services) -> None:
    assert {name: len(calls) for name, calls in services.items()} == {"conv": 447, "code": 579}
    assert min(call.at for calls in services.values() for call in calls) == 0.0
    assert max(call.at for calls in services.values() for call in calls) < 90
    first = services["conv"][0]
    assert first.context > 0 and first.generated > 0


def test_one_replica_busy_period_per_burst_with_a_large_gap(services: Services) -> None:
    mapping = AzureMapping(concurrency=10**6, gap_s=3600, batch=BatchJobs(every_s=0))
    trace = convert(services, mapping)
    # every request of a service joins one busy period of one replica
    assert sorted((r.holder, r.model) for r in trace) == [
        ("code-1", "code-14b"),
        ("conv-1", "chat-14b"),
    ]
    conv = next(r for r in trace if r.holder == "conv-1")
    calls = services["conv"]
    last_end = max(c.at + c.context / 4000 + c.generated / 40 for c in calls)
    assert conv.arrival_s == round(calls[0].at, 3)
    assert math.isclose(conv.run_s, last_end - calls[0].at, abs_tol=0.001)
    assert (conv.priority, conv.preemptible, conv.vram_mb, conv.load_s) == (800, False, 16384, 12)
    code = next(r for r in trace if r.holder == "code-1")
    assert (code.priority, code.preemptible) == (500, True)


def test_replicas_and_gaps_split_busy_periods(services: Services) -> None:
    one = convert(services, AzureMapping(concurrency=10**6, gap_s=0, batch=BatchJobs(every_s=0)))
    few = convert(services, AzureMapping(concurrency=4, gap_s=0, batch=BatchJobs(every_s=0)))
    assert {r.holder for r in one} == {"conv-1", "code-1"}
    assert {r.holder for r in few} > {"conv-1", "conv-2", "conv-3", "code-1", "code-2"}
    # replica k serves only while more than (k-1) x 4 requests are in flight: less work
    work = {h: sum(r.run_s for r in few if r.holder == h) for h in {r.holder for r in few}}
    assert work["conv-1"] > work["conv-2"] > work["conv-3"]
    # periods of one replica never overlap, and gaps merge them
    for holder in work:
        periods = sorted((r.arrival_s, r.arrival_s + r.run_s) for r in few if r.holder == holder)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(periods))
    merged = convert(services, AzureMapping(concurrency=4, gap_s=5, batch=BatchJobs(every_s=0)))
    assert len(merged) < len(few)


def test_load_thins_arrivals_by_seed(services: Services) -> None:
    def periods(load: float, seed: int) -> str:
        mapping = AzureMapping(load=load, seed=seed, gap_s=0, batch=BatchJobs(every_s=0))
        return dump_trace(convert(services, mapping))

    assert periods(0.2, 1) == periods(0.2, 1)
    assert periods(0.2, 1) != periods(0.2, 2)
    assert len(periods(0.05, 1).splitlines()) < len(periods(1.0, 1).splitlines())


def test_batch_jobs_and_service_mapping(services: Services) -> None:
    mapping = AzureMapping(
        services={"conv": Service("chat-70b", 70 * 1024, 800, 40)},
        batch=BatchJobs(every_s=10, vram_mb=76 * 1024, load_s=60, run_s=(100, 200)),
    )
    trace = convert(services, mapping)
    assert {r.model for r in trace if r.holder.startswith("conv")} == {"chat-70b"}
    assert not any(r.holder.startswith("code") for r in trace)  # not mapped: left out
    jobs = [r for r in trace if r.holder == "batch"]
    assert len(jobs) > 3
    assert len({r.model for r in jobs}) == len(jobs)  # each job its own model
    assert all(r.priority == 100 and r.vram_mb == 76 * 1024 and 100 <= r.run_s <= 200 for r in jobs)


def test_converted_trace_round_trips_and_simulates(services: Services) -> None:
    trace = convert(services, AzureMapping(concurrency=8, batch=BatchJobs(every_s=30)))
    assert parse_trace(dump_trace(trace).splitlines()) == trace
    cluster = parse_cluster("2x24G")
    rec = Simulation(trace, cluster, Ours(cluster)).run()
    assert rec.violations == []
    assert rec.unfinished == 0
    assert rec.completed == len(trace)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: AzureMapping(load=0), "azure load"),
        (lambda: AzureMapping(load=float("nan")), "azure load"),
        (lambda: AzureMapping(concurrency=0), "azure concurrency"),
        (lambda: AzureMapping(decode_tps=0), "azure tokens"),
        (lambda: BatchJobs(run_s=(10, 5)), "azure batch"),
        (lambda: BatchJobs(every_s=float("inf")), "azure batch"),
        (lambda: parse_service("chat:16G:interactive"), "azure service"),
        (lambda: parse_service("chat:16Q:interactive:3"), "azure service"),
        (lambda: parse_batch("1200:20G:30"), "azure batch"),
        (lambda: read_azure(SLICE / "missing"), "azure"),
    ],
)
def test_bad_mapping_names_the_field(call: Callable[[], object], field: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        call()
    assert raised.value.field == field


def test_bad_csv_row_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "AzureLLMInferenceTrace_code.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319600,many,8\n"
    )
    with pytest.raises(InvalidInput, match=r"AzureLLMInferenceTrace_code\.csv line 3"):
        read_azure(tmp_path)
