"""The Azure LLM inference trace (2023) as a simulator trace.

The public trace (AzurePublicDataset, ``AzureLLMInferenceTrace_conv.csv`` and
``AzureLLMInferenceTrace_code.csv``; CC-BY 4.0, from "Splitwise: Efficient
Generative LLM Inference Using Phase Splitting", Patel et al., ISCA 2024) is one
hour of real request arrivals to a conversation service and a coding service:
``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens`` per request, and nothing
else. Everything the simulator needs beyond that is a mapping choice, each a
field of :class:`AzureMapping` (and a ``simulate --azure-*`` option):

services    each file is one model-server service (``conv`` and ``code``), with
            a model name, a size, a priority and a load time
            (:class:`Service`; default ``conv`` -> ``chat-14b``, 16 GiB,
            ``interactive``, 12 s load; ``code`` -> ``code-14b``, 16 GiB,
            ``normal``, 12 s load).
load        the fraction of requests kept (each kept with this probability,
            seeded: ``seed``); 1 replays every request.
tokens/s    a request is served for ``context / prefill_tps + generated /
            decode_tps`` seconds after it arrives (defaults 4000 and 40 tokens/s:
            a 14B model on one GPU, with continuous batching).
replicas    one replica serves up to ``concurrency`` requests at once (16); the
            k-th replica of a service is busy while more than (k-1) x
            ``concurrency`` requests are in flight.
busy periods  a replica's busy intervals closer than ``gap_s`` (30 s) join one
            busy period; each busy period is one trace request (a lease held
            from its first request's arrival for the period's length). Replicas
            of a service share the model name, so a warm copy serves any of them.
batch       the trace has no batch work: synthetic jobs (:class:`BatchJobs`:
            Poisson arrivals over the trace's span, 1200 s apart on average, 0
            for none) of 20 GiB, a 30 s load and a run of 10 to 40 minutes,
            priority ``batch``, each with a model of its own (nothing reuses a
            finished job warm).

Times start at the earliest arrival of the files read, in milliseconds (as a
trace file holds them: a converted trace saved and read back is the same). The
same files and mapping always give the same trace.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ..core import InvalidInput, parse_mb, parse_priority
from .trace import TraceRequest

__all__ = [
    "FILES",
    "AzureMapping",
    "BatchJobs",
    "Call",
    "Service",
    "convert",
    "parse_batch",
    "parse_pair",
    "parse_service",
    "read_azure",
]

_G = 1024
FILES = {
    "conv": "AzureLLMInferenceTrace_conv.csv",
    "code": "AzureLLMInferenceTrace_code.csv",
}
_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True, slots=True)
class Service:
    """How one service of the trace maps to a model server."""

    model: str
    vram_mb: int
    priority: int
    load_s: float


def _default_services() -> dict[str, Service]:
    return {
        "conv": Service("chat-14b", 16 * _G, 800, 12.0),
        "code": Service("code-14b", 16 * _G, 500, 12.0),
    }


@dataclass(frozen=True, slots=True)
class BatchJobs:
    """Synthetic batch jobs: Poisson arrivals ``every_s`` apart on average (0: none), each
    of ``vram_mb``, loading for ``load_s`` and running uniformly ``run_s[0]..run_s[1]``."""

    every_s: float = 1200.0
    vram_mb: int = 20 * _G
    load_s: float = 30.0
    run_s: tuple[float, float] = (600.0, 2400.0)

    def __post_init__(self) -> None:
        low, high = self.run_s
        if not all(math.isfinite(n) for n in (self.every_s, self.load_s, low, high)):
            raise InvalidInput("azure batch", "seconds must be finite numbers")
        if self.every_s < 0 or self.load_s < 0:
            raise InvalidInput("azure batch", "seconds must be >= 0")
        if not 0 < low <= high:
            raise InvalidInput("azure batch", "run must be MIN-MAX seconds with 0 < MIN <= MAX")


@dataclass(frozen=True, slots=True)
class AzureMapping:
    """Every choice that turns the trace's requests into the simulator's (see the module
    docstring)."""

    services: dict[str, Service] = field(default_factory=_default_services)
    load: float = 1.0
    seed: int = 1
    prefill_tps: float = 4000.0
    decode_tps: float = 40.0
    concurrency: int = 16
    gap_s: float = 30.0
    batch: BatchJobs = field(default_factory=lambda: BatchJobs())

    def __post_init__(self) -> None:
        if not all(math.isfinite(n) for n in (self.prefill_tps, self.decode_tps)):
            raise InvalidInput("azure tokens", "tokens/s must be finite numbers")
        if not 0 < self.load <= 1:
            raise InvalidInput("azure load", "must be in (0, 1]: the fraction of requests kept")
        if not (self.prefill_tps > 0 and self.decode_tps > 0):
            raise InvalidInput("azure tokens", "prefill and decode tokens/s must be > 0")
        if self.concurrency < 1:
            raise InvalidInput("azure concurrency", "must be an integer >= 1")
        if not 0 <= self.gap_s <= 86400:
            raise InvalidInput("azure gap", "must be 0..86400 seconds")


@dataclass(frozen=True, slots=True, order=True)
class Call:
    """One request of the trace: arrival (seconds from the origin) and tokens."""

    at: float
    context: int
    generated: int


def parse_service(text: str) -> Service:
    """``MODEL:SIZE:PRIORITY:LOAD_S`` (``chat-14b:16G:interactive:12``)."""
    parts = text.split(":")
    if len(parts) != 4 or not parts[0]:
        raise InvalidInput("azure service", f"{text!r} is not MODEL:SIZE:PRIORITY:LOAD_S")
    try:
        load_s = float(parts[3])
    except ValueError:
        raise InvalidInput("azure service", f"load {parts[3]!r} is not seconds") from None
    if not 0 <= load_s <= 3600:
        raise InvalidInput("azure service", "load must be 0..3600 seconds")
    return Service(parts[0], parse_mb(parts[1], "azure service"), parse_priority(parts[2]), load_s)


def parse_pair(text: str, field: str) -> tuple[float, float]:
    """``A:B`` as two numbers (``4000:40``)."""
    parts = text.split(":")
    try:
        first, second = (float(part) for part in parts)
    except ValueError:
        raise InvalidInput(field, f"{text!r} is not two numbers A:B") from None
    return first, second


def parse_batch(text: str) -> BatchJobs:
    """``none`` or ``EVERY_S:SIZE:LOAD_S:MIN_S-MAX_S`` (``1200:20G:30:600-2400``)."""
    if text.strip().lower() in ("none", "0"):
        return BatchJobs(every_s=0.0)
    parts = text.split(":")
    low, _, high = parts[-1].partition("-")
    try:
        if len(parts) != 4:
            raise ValueError
        every, load, run = float(parts[0]), float(parts[2]), (float(low), float(high))
    except ValueError:
        raise InvalidInput(
            "azure batch", f"{text!r} is not none or EVERY_S:SIZE:LOAD_S:MIN_S-MAX_S"
        ) from None
    return BatchJobs(every, parse_mb(parts[1], "azure batch"), load, run)


def _timestamp(text: str) -> datetime:
    """``2023-11-16 18:17:03.9799600``: seven fractional digits, read to the microsecond."""
    head, _, fraction = text.strip().partition(".")
    stamp = datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
    return stamp.replace(microsecond=int((fraction + "000000")[:6]) if fraction else 0)


def _rows(path: Path) -> list[tuple[datetime, int, int]]:
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            if reader.fieldnames is None or any(c not in reader.fieldnames for c in _COLUMNS):
                raise InvalidInput("azure", f"{path.name}: columns must be {', '.join(_COLUMNS)}")
            rows = []
            for number, row in enumerate(reader, start=2):
                try:
                    rows.append(
                        (
                            _timestamp(row["TIMESTAMP"]),
                            int(row["ContextTokens"]),
                            int(row["GeneratedTokens"]),
                        )
                    )
                except (TypeError, ValueError):
                    raise InvalidInput("azure", f"{path.name} line {number}: bad row") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput("azure", f"cannot read {str(path)!r}: {exc}") from None
    return rows


def read_azure(path: str | Path) -> dict[str, list[Call]]:
    """The services found in ``path`` (a folder holding the trace's CSV files, by their
    published names), each a list of requests timed from the earliest arrival of all."""
    folder = Path(path)
    found = {name: folder / file for name, file in FILES.items() if (folder / file).is_file()}
    if not found:
        raise InvalidInput("azure", f"{str(folder)!r} holds none of {', '.join(FILES.values())}")
    rows = {name: _rows(file) for name, file in found.items()}
    stamps = [stamp for service in rows.values() for stamp, _, _ in service]
    if not stamps:
        raise InvalidInput("azure", "the trace files hold no requests")
    origin = min(stamps)
    return {
        name: sorted(Call((s - origin).total_seconds(), c, g) for s, c, g in service)
        for name, service in rows.items()
    }


def _busy_intervals(
    calls: Iterable[Call], mapping: AzureMapping
) -> dict[int, list[tuple[float, float]]]:
    """Per replica (1, 2, ...): the intervals it serves at least one request."""
    events = []
    for call in calls:
        served = call.context / mapping.prefill_tps + call.generated / mapping.decode_tps
        events.append((call.at, 1))
        events.append((call.at + max(served, 0.001), -1))
    events.sort()  # at equal times an end (-1) comes before a start
    per_replica: dict[int, list[tuple[float, float]]] = {}
    opened: dict[int, float] = {}
    level = 0
    for at, step in events:
        replica = (level if step > 0 else level - 1) // mapping.concurrency + 1
        starts_or_ends = (level if step > 0 else level - 1) % mapping.concurrency == 0
        level += step
        if not starts_or_ends:
            continue
        if step > 0:
            opened[replica] = at
        else:
            per_replica.setdefault(replica, []).append((opened.pop(replica), at))
    return per_replica


def _periods(intervals: Sequence[tuple[float, float]], gap_s: float) -> list[tuple[float, float]]:
    """Intervals closer than ``gap_s`` merged into busy periods."""
    merged: list[tuple[float, float]] = []
    for start, end in intervals:
        if merged and start - merged[-1][1] < gap_s:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _service_trace(name: str, calls: list[Call], mapping: AzureMapping) -> list[TraceRequest]:
    service = mapping.services.get(name)
    if service is None:
        return []
    rng = random.Random(f"{mapping.seed}:{name}")
    kept = [call for call in calls if rng.random() < mapping.load]
    out = []
    for replica, intervals in sorted(_busy_intervals(kept, mapping).items()):
        for start, end in _periods(intervals, mapping.gap_s):
            out.append(
                TraceRequest(
                    arrival_s=round(start, 3),
                    model=service.model,
                    vram_mb=service.vram_mb,
                    run_s=max(round(end - start, 3), 0.001),
                    priority=service.priority,
                    preemptible=service.priority < 800,
                    load_s=service.load_s,
                    holder=f"{name}-{replica}",
                )
            )
    return out


def _batch(span_s: float, mapping: AzureMapping) -> list[TraceRequest]:
    jobs = mapping.batch
    if jobs.every_s == 0:
        return []
    rng = random.Random(f"{mapping.seed}:batch")
    out: list[TraceRequest] = []
    at = rng.expovariate(1 / jobs.every_s)
    while at < span_s:
        out.append(
            TraceRequest(
                arrival_s=round(at, 3),
                model=f"finetune-{len(out)}",
                vram_mb=jobs.vram_mb,
                run_s=round(rng.uniform(*jobs.run_s), 3),
                priority=100,
                preemptible=True,
                load_s=jobs.load_s,
                holder="batch",
            )
        )
        at += rng.expovariate(1 / jobs.every_s)
    return out


def convert(
    services: dict[str, list[Call]], mapping: AzureMapping | None = None
) -> list[TraceRequest]:
    """The simulator's trace (sorted by arrival) for the services read by
    :func:`read_azure`, under ``mapping`` (default: :class:`AzureMapping`)."""
    mapping = mapping or AzureMapping()
    trace = [r for name in sorted(services) for r in _service_trace(name, services[name], mapping)]
    span = max((call.at for calls in services.values() for call in calls), default=0.0)
    trace.extend(_batch(span, mapping))
    if not trace:
        raise InvalidInput("azure", "the mapping keeps no request (raise the load?)")
    return sorted(trace, key=lambda r: (r.arrival_s, r.model, r.holder))
