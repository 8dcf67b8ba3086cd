"""Seeded generators of realistic traces.

Kinds (combine with ``+``, e.g. ``chat+batch``; ``mixed`` is all four):

chat      interactive chat sessions (priority ``interactive``, not preemptible):
          a few chat models, the popular ones asked for often, loads of 4-40 s,
          sessions of about a minute.
agents    agents' embeddings and rerankers (``normal``): small models, frequent,
          runs of 5-30 s.
imagegen  image-generation bursts (``normal``): now and then a burst of 5-20
          requests for one model a few seconds apart.
batch     fine-tunes and re-indexes (``batch``): rare, large, long (tens of
          minutes to hours), fine-tunes on 2 GPUs where workers have them. Each
          job has its own model name (``finetune-8b-3``): a job is not a model
          server, nothing reuses its memory warm.

Model sizes follow the cluster's largest GPU (24 GiB-class or 80 GiB-class
catalogs), and arrival rates are set so that, on average, each kind asks for a
fixed share of the cluster's memory-time (chat 20 %, agents 3 % (at most 400
requests an hour), image bursts 5 %, fine-tunes 30 %, re-indexes 8 %): every
cluster is busy, none hopelessly overloaded.
The same (kind, seed, cluster, hours) always gives the same trace.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..core import Constraints, InvalidInput
from .cluster import Cluster
from .trace import TraceRequest

__all__ = ["KINDS", "generate"]

_G = 1024


@dataclass(frozen=True, slots=True)
class _Model:
    name: str
    vram_mb: int
    load_s: float
    weight: float = 1.0
    gpus: int = 1


_Catalog = dict[str, list[_Model]]


def _catalog(cluster: Cluster) -> _Catalog:
    big = cluster.largest_gpu_mb >= 64 * _G
    pair = cluster.most_gpus_per_worker >= 2
    catalog = _big() if big else _small(pair)
    return {
        part: [m for m in models if m.gpus <= cluster.most_gpus_per_worker]
        for part, models in catalog.items()
    }


def _big() -> dict[str, list[_Model]]:
    return {
        "chat": [
            _Model("chat-8b", 17 * _G, 10, 0.45),
            _Model("chat-32b", 40 * _G, 25, 0.35),
            _Model("chat-70b", 75 * _G, 40, 0.20),
        ],
        "agents": [
            _Model("embed-small", 1 * _G, 2, 0.4),
            _Model("embed-large", 3 * _G, 4, 0.3),
            _Model("rerank", 2 * _G, 3, 0.3),
        ],
        "imagegen": [_Model("sdxl", 12 * _G, 12, 0.5), _Model("flux", 34 * _G, 25, 0.5)],
        "finetune": [
            _Model("finetune-8b", 60 * _G, 40, 0.5),
            _Model("finetune-70b", 76 * _G, 90, 0.5, gpus=4),
        ],
        "reindex": [_Model("reindex", 12 * _G, 20)],
    }


def _small(pair: bool) -> dict[str, list[_Model]]:
    return {
        "chat": [
            _Model("chat-3b", 5 * _G, 4, 0.3),
            _Model("chat-8b", 10 * _G, 8, 0.5),
            _Model("chat-14b", 16 * _G, 14, 0.2),
        ],
        "agents": [
            _Model("embed-small", 1 * _G, 2, 0.4),
            _Model("embed-large", 5 * _G // 2, 4, 0.3),
            _Model("rerank", 2 * _G, 3, 0.3),
        ],
        "imagegen": [_Model("sdxl", 10 * _G, 12, 0.6), _Model("flux-schnell", 16 * _G, 20, 0.4)],
        "finetune": [_Model("finetune-8b", 20 * _G, 45, 0.6)]
        + ([_Model("finetune-14b", 20 * _G, 60, 0.4, gpus=2)] if pair else []),
        "reindex": [_Model("reindex", 6 * _G, 20)],
    }


def _pick(rng: random.Random, models: list[_Model]) -> _Model:
    return rng.choices(models, weights=[m.weight for m in models])[0]


def _poisson(rng: random.Random, per_hour: float, hours: float) -> list[float]:
    times: list[float] = []
    t = 0.0
    while per_hour > 0:
        t += rng.expovariate(per_hour / 3600)
        if t >= hours * 3600:
            return times
        times.append(t)
    return times


def _request(
    model: _Model, at: float, run_s: float, priority: str, holder: str, **extra: object
) -> TraceRequest:
    return TraceRequest(
        arrival_s=round(at, 3),
        model=model.name,
        vram_mb=model.vram_mb,
        run_s=round(max(1.0, run_s), 3),
        gpus=model.gpus,
        priority={"interactive": 800, "normal": 500, "batch": 100}[priority],
        preemptible=priority != "interactive",
        load_s=model.load_s,
        holder=holder,
        constraints=extra.get("constraints", Constraints()),  # type: ignore[arg-type]
        raw_constraints=extra.get("raw", {}),  # type: ignore[arg-type]
    )


def _rate(share: float, capacity_gib: float, models: list[_Model], busy_s: float) -> float:
    """Arrivals per hour that keep ``share`` of the capacity busy with these models, each
    holding its memory for its load plus ``busy_s`` on average."""
    total = sum(m.weight for m in models)
    gib_s = sum(m.weight * m.vram_mb / _G * m.gpus * (m.load_s + busy_s) for m in models)
    return share * capacity_gib * 3600 / (gib_s / total)


def _chat(rng: random.Random, c: _Catalog, capacity_gib: float, hours: float) -> list[TraceRequest]:
    rate = _rate(0.2, capacity_gib, c["chat"], 60)
    return [
        _request(_pick(rng, c["chat"]), t, rng.expovariate(1 / 60), "interactive", "chat")
        for t in _poisson(rng, rate, hours)
    ]


def _agents(
    rng: random.Random, c: _Catalog, capacity_gib: float, hours: float
) -> list[TraceRequest]:
    rate = min(400.0, _rate(0.03, capacity_gib, c["agents"], 17.5))
    return [
        _request(_pick(rng, c["agents"]), t, rng.uniform(5, 30), "normal", "agents")
        for t in _poisson(rng, rate, hours)
    ]


def _imagegen(
    rng: random.Random, c: _Catalog, capacity_gib: float, hours: float
) -> list[TraceRequest]:
    out = []
    rate = _rate(0.05, capacity_gib, c["imagegen"], 12.5 * 16.5)  # a burst: ~12 images
    for start in _poisson(rng, rate, hours):
        model, t = _pick(rng, c["imagegen"]), start
        for _ in range(rng.randint(5, 20)):
            out.append(_request(model, t, rng.uniform(8, 25), "normal", "imagegen"))
            t += rng.uniform(1, 6)
    return out


def _job(model: _Model, number: int) -> _Model:
    """A batch job's own weights: no other request ever reuses them warm."""
    return replace(model, name=f"{model.name}-{number}")


def _batch(
    rng: random.Random, c: _Catalog, capacity_gib: float, hours: float
) -> list[TraceRequest]:
    needs_ampere = Constraints.build(min_compute_capability="8.0")
    out: list[TraceRequest] = []
    for t in _poisson(rng, _rate(0.3, capacity_gib, c["finetune"], 40 * 60), hours):
        out.append(
            _request(
                _job(_pick(rng, c["finetune"]), len(out)),
                t,
                rng.uniform(20, 60) * 60,
                "batch",
                "finetune",
                constraints=needs_ampere,
                raw={"min_compute_capability": "8.0"},
            )
        )
    for t in _poisson(rng, _rate(0.08, capacity_gib, c["reindex"], 20 * 60), hours):
        job = _job(c["reindex"][0], len(out))
        out.append(_request(job, t, rng.uniform(10, 30) * 60, "batch", "reindex"))
    return out


_Generator = Callable[[random.Random, _Catalog, float, float], list[TraceRequest]]
_PARTS: dict[str, _Generator] = {
    "chat": _chat,
    "agents": _agents,
    "imagegen": _imagegen,
    "batch": _batch,
}
KINDS = ("mixed", *_PARTS)


def generate(kind: str, seed: int, cluster: Cluster, hours: float = 4.0) -> list[TraceRequest]:
    """A trace of ``kind`` (a kind, or kinds joined by ``+``) over ``hours``, sorted by
    arrival. Deterministic in its arguments."""
    parts = list(_PARTS) if kind == "mixed" else kind.split("+")
    for part in parts:
        if part not in _PARTS:
            raise InvalidInput("generate", f"{part!r} is not one of {', '.join(KINDS)}")
    if not 0 < hours <= 24 * 30:
        raise InvalidInput("hours", "must be > 0 and at most 720")
    capacity_gib = cluster.total_mb / _G
    catalog = _catalog(cluster)
    trace: list[TraceRequest] = []
    for part in sorted(set(parts), key=parts.index):
        rng = random.Random(f"{seed}:{part}")
        trace.extend(_PARTS[part](rng, catalog, capacity_gib, hours))
    return sorted(trace, key=lambda r: (r.arrival_s, r.model))
