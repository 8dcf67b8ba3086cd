"""``GET /metrics``: Prometheus text exposition of the controller's figures.

Per GPU: total, capacity, used (when probed), committed, free MiB and loads in
progress; queue depth by base priority; leases by state; workers by state; the
scheduler's counters (grants, preemptions, expiries, ...) since this start; and
a histogram of how long granted requests waited.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..controller import Controller
from ..core import GpuFigures

__all__ = ["render"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sample(name: str, value: float, **labels: str) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {value}" if inner else f"{name} {value}"


def _family(name: str, kind: str, text: str, samples: Iterable[str]) -> list[str]:
    return [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples]


def _gpus(controller: Controller) -> list[str]:
    lines: list[str] = []
    figures = [f for w in controller.workers() for f in controller.gpu_figures(w.name)]
    fields: tuple[tuple[str, str, Callable[[GpuFigures], int]], ...] = (
        ("total_mb", "MiB of memory on the GPU", lambda f: f.gpu.total_mb),
        ("capacity_mb", "MiB leases may use (total - headroom)", lambda f: f.gpu.capacity_mb),
        ("committed_mb", "MiB committed to leases", lambda f: f.committed_mb),
        ("free_mb", "MiB a new grant may use", lambda f: f.free_mb),
        ("loading", "leases loading on the GPU", lambda f: f.loading),
    )
    for field, text, get in fields:
        name = f"gpu_arbiter_gpu_{field}"
        samples = (_sample(name, get(f), gpu=str(f.gpu.id), worker=f.gpu.worker) for f in figures)
        lines += _family(name, "gauge", text, samples)
    used = (
        _sample("gpu_arbiter_gpu_used_mb", f.used_mb, gpu=str(f.gpu.id), worker=f.gpu.worker)
        for f in figures
        if f.used_mb is not None
    )
    lines += _family("gpu_arbiter_gpu_used_mb", "gauge", "MiB used, by the last probe", used)
    return lines


def _histogram(controller: Controller) -> list[str]:
    waits = controller.wait_times
    name = "gpu_arbiter_wait_seconds"
    samples, running = [], 0
    for bound, count in zip((*waits.bounds, float("inf")), waits.counts, strict=True):
        running += count
        samples.append(
            _sample(f"{name}_bucket", running, le="+Inf" if bound == float("inf") else str(bound))
        )
    samples += [_sample(f"{name}_sum", waits.total_s), _sample(f"{name}_count", running)]
    return _family(name, "histogram", "How long granted requests waited", samples)


def render(controller: Controller) -> str:
    status = controller.status()
    lines = _gpus(controller)
    lines += _family(
        "gpu_arbiter_pending",
        "gauge",
        "Pending requests by base priority",
        (
            _sample("gpu_arbiter_pending", n, priority=p)
            for p, n in status["pending_by_priority"].items()
        ),
    )
    lines += _family(
        "gpu_arbiter_leases",
        "gauge",
        "Held leases by state",
        (_sample("gpu_arbiter_leases", n, state=s) for s, n in status["leases_by_state"].items()),
    )
    lines += _family(
        "gpu_arbiter_workers",
        "gauge",
        "Workers by state",
        (_sample("gpu_arbiter_workers", n, state=s) for s, n in status["workers_by_state"].items()),
    )
    lines += _family(
        "gpu_arbiter_paused",
        "gauge",
        "1 while the arbiter is paused",
        [_sample("gpu_arbiter_paused", int(status["paused"]))],
    )
    lines += _family(
        "gpu_arbiter_scheduler_total",
        "counter",
        "Scheduler counters since this start (granted, preemptions, expired, ...)",
        (
            _sample("gpu_arbiter_scheduler_total", n, counter=c)
            for c, n in sorted(status["counters"].items())
        ),
    )
    lines += _histogram(controller)
    return "\n".join(lines) + "\n"
