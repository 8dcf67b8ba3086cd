"""``GET /metrics``: the controller's figures in Prometheus text, through prometheus-client.

Nothing is counted twice: a :class:`ControllerCollector` reads the controller at
scrape time (its GPU figures, ``status()``, the scheduler's counters and the two
histograms the controller keeps) and yields metric families. Each app has its own
``CollectorRegistry``; the library's global registry is never used.

Families (memory in bytes, times in seconds; counters since the process started)::

    gpu_arbiter_gpu_memory_{total,capacity,committed,free,used}_bytes   per GPU
    gpu_arbiter_gpu_loads_in_progress, gpu_arbiter_gpu_probe_stale       per GPU
    gpu_arbiter_queue_depth{priority}          pending requests by base priority
    gpu_arbiter_leases{state}                  held leases by state
    gpu_arbiter_workers{state}                 workers by state
    gpu_arbiter_worker_updating{worker}        1 while an update of the worker runs
    gpu_arbiter_paused, gpu_arbiter_ready, gpu_arbiter_leader, gpu_arbiter_build_info
    gpu_arbiter_requests_{submitted,rejected,cancelled,timed_out}_total
    gpu_arbiter_grants_total, gpu_arbiter_preemptions_total
    gpu_arbiter_revocations_total{reason}
    gpu_arbiter_leases_{released,expired}_total
    gpu_arbiter_refusals_total{limit}          requests refused with 429, by limit
    gpu_arbiter_wait_seconds                   histogram: submitted -> granted
    gpu_arbiter_grant_latency_seconds          histogram: see GRANT_LATENCY_HELP
    process_*                                  the controller process (Linux)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .. import __version__
from ..controller import Controller, Histogram
from ..core import GpuFigures, LeaseState, WorkerStatus
from ..core.units import PRIORITY_NAMES, priority_name
from .config import COUNT_LIMITS

__all__ = [
    "GRANT_LATENCY_HELP",
    "ControllerCollector",
    "metrics_registry",
    "refusal_counter",
    "render",
]

MIB = 1024 * 1024

GRANT_LATENCY_HELP = (
    "Seconds from the start of the controller change that made a grant possible "
    "(a request, release, heartbeat, drain or timer) to the grant being committed "
    "to the store: the decide and commit cycle, not the HTTP handling around it"
)

#  Reasons the controller revokes for; each is exposed (0 until it happens) so
#  that rate() has a series from the start. Others are added when seen.
REVOKE_REASONS = ("preempted", "revoked_by_admin", "drain", "drain_deadline", "worker_removed")

#  (suffix, scheduler counter, help) of the plain counters.
COUNTERS = (
    ("requests_submitted", "submitted", "Requests accepted into the queue"),
    (
        "requests_rejected",
        "rejected",
        "Requests refused because no registered GPU could ever fit them (at submission, "
        "or pending when the cluster shrank)",
    ),
    ("requests_cancelled", "cancelled", "Pending requests cancelled by their holder"),
    ("requests_timed_out", "timed_out", "Pending requests that waited past their max_wait_s"),
    ("grants", "granted", "Leases granted"),
    ("preemptions", "preemptions", "Leases revoked to make room for a request"),
    ("leases_released", "released", "Leases released by their holder"),
    ("leases_expired", "expired", "Leases that lapsed: their TTL passed without a renewal"),
)

#  (name, help, figure) of the per-GPU memory gauges.
_MEMORY: tuple[tuple[str, str, Callable[[GpuFigures], int]], ...] = (
    ("total", "Memory on the GPU", lambda f: f.gpu.total_mb),
    ("capacity", "Memory leases may use (total - headroom)", lambda f: f.gpu.capacity_mb),
    ("committed", "Memory committed to leases", lambda f: f.committed_mb),
    ("free", "Memory a new grant may use", lambda f: f.free_mb),
    (
        "overcommitted",
        "Memory committed beyond the capacity (the GPU was registered again smaller)",
        lambda f: f.overcommitted_mb,
    ),
)


class ControllerCollector(Collector):
    """Reads ``controller`` on each scrape. Runs on the event loop, like every change."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Metric]:
        controller = self.controller
        status = controller.status()
        workers = controller.workers.all()
        figures = [f for w in workers for f in controller.workers.gpu_figures(w.name)]
        yield from _gpus(figures)
        updating = GaugeMetricFamily(
            "gpu_arbiter_worker_updating",
            "1 while an update of the worker runs (drain, update command, restart)",
            labels=["worker"],
        )
        for worker in workers:
            running = controller.updates.running(worker.name) is not None
            updating.add_metric([worker.name], int(running))
        yield updating
        yield _queue(status["pending_by_priority"])
        yield _by_state("leases", "Held leases by state", status["leases_by_state"], _held_states())
        yield _by_state(
            "workers",
            "Workers by state",
            status["workers_by_state"],
            [str(s) for s in WorkerStatus],
        )
        yield from self._controller_state(status)
        yield from _counters(status["counters"])
        yield _histogram(
            "wait_seconds",
            "Seconds a granted request waited in the queue, from submission to grant",
            controller.changes.wait_times,
        )
        latency = controller.changes.grant_latency
        yield _histogram("grant_latency_seconds", GRANT_LATENCY_HELP, latency)

    def _controller_state(self, status: Mapping[str, Any]) -> Iterator[Metric]:
        paused = GaugeMetricFamily("gpu_arbiter_paused", "1 while the arbiter is paused")
        paused.add_metric([], int(status["paused"]))
        yield paused
        gate = self.controller.gate
        ready = gate.started and gate.broken is None
        up = GaugeMetricFamily("gpu_arbiter_ready", "1 while the controller accepts changes")
        up.add_metric([], int(ready))
        yield up
        leader = GaugeMetricFamily(
            "gpu_arbiter_leader",
            "1 while this controller leads (0: a standby of a shared PostgreSQL store)",
        )
        leader.add_metric([], int(not gate.standby))
        yield leader
        info = InfoMetricFamily("gpu_arbiter_build", "The controller's version")
        info.add_metric([], {"version": __version__})
        yield info


def _gpu_labels(f: GpuFigures) -> list[str]:
    return [f.gpu.worker, str(f.gpu.id), str(f.gpu.index), f.gpu.model]


def _gpu_gauge(name: str, text: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(
        f"gpu_arbiter_gpu_{name}", text, labels=["worker", "gpu", "index", "model"]
    )


def _gpus(figures: list[GpuFigures]) -> Iterator[Metric]:
    for field, text, get in _MEMORY:
        family = _gpu_gauge(f"memory_{field}_bytes", f"{text}, in bytes")
        for f in figures:
            family.add_metric(_gpu_labels(f), get(f) * MIB)
        yield family
    used = _gpu_gauge("memory_used_bytes", "Memory in use by the last probe, in bytes")
    loads = _gpu_gauge("loads_in_progress", "Leases still loading on the GPU (the load gate)")
    stale = _gpu_gauge("probe_stale", "1 while the GPU's last probe is too old to trust")
    for f in figures:
        if f.used_mb is not None:
            used.add_metric(_gpu_labels(f), f.used_mb * MIB)
        loads.add_metric(_gpu_labels(f), f.loading)
        stale.add_metric(_gpu_labels(f), int(f.stale))
    yield from (used, loads, stale)


def _queue(pending_by_priority: Mapping[str, int]) -> Metric:
    """Every named priority level is present (0 when empty), and any other level pending."""
    levels = {p: 0 for p in PRIORITY_NAMES.values()}
    levels.update({int(p): n for p, n in pending_by_priority.items()})
    family = GaugeMetricFamily(
        "gpu_arbiter_queue_depth",
        "Pending requests by base priority (priority: the number; name: its name, if any)",
        labels=["priority", "name"],
    )
    for priority, count in sorted(levels.items()):
        family.add_metric([str(priority), priority_name(priority)], count)
    return family


def _held_states() -> list[str]:
    return [str(s) for s in LeaseState if s.holds_memory]


def _by_state(
    name: str, text: str, counts: Mapping[str, int], states: list[str]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"gpu_arbiter_{name}", text, labels=["state"])
    for state in sorted({*states, *counts}):
        family.add_metric([state], counts.get(state, 0))
    return family


def _counters(counters: Mapping[str, int]) -> Iterator[Metric]:
    for name, key, text in COUNTERS:
        family = CounterMetricFamily(f"gpu_arbiter_{name}", f"{text}, since the process started")
        family.add_metric([], counters.get(key, 0))
        yield family
    revocations = CounterMetricFamily(
        "gpu_arbiter_revocations",
        "Leases revoked, by reason, since the process started",
        labels=["reason"],
    )
    seen = {k.partition(":")[2] for k in counters if k.startswith("revoked:")}
    for reason in sorted({*REVOKE_REASONS, *seen}):
        revocations.add_metric([reason], counters.get(f"revoked:{reason}", 0))
    yield revocations


def _histogram(name: str, text: str, histogram: Histogram) -> Metric:
    buckets: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts, strict=True):
        running += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
    return HistogramMetricFamily(
        f"gpu_arbiter_{name}", text, buckets=buckets, sum_value=histogram.total_s
    )


def metrics_registry(controller: Controller) -> CollectorRegistry:
    """A registry of its own for one app: the controller's figures and the process's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControllerCollector(controller))
    ProcessCollector(registry=registry)
    return registry


#  Limits a request can be refused for (429); each is exposed from the start.
REFUSAL_LIMITS = (*COUNT_LIMITS, "max_workers")


def refusal_counter(registry: CollectorRegistry) -> Callable[[str], None]:
    """``gpu_arbiter_refusals_total{limit}`` in ``registry``; returns the function that
    counts one refusal for a limit's name."""
    counter = Counter(
        "gpu_arbiter_refusals",
        "Requests refused with 429 because a limit was reached, by limit, "
        "since the process started",
        labelnames=["limit"],
        registry=registry,
    )
    for limit in REFUSAL_LIMITS:
        counter.labels(limit)
    return lambda limit: counter.labels(limit).inc()


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
