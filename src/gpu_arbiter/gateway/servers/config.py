"""One model's settings: :class:`ModelConfig`, a ``[models.NAME]`` table of
``models.toml`` (or one Ollama model of it) as ``gateway/config.py`` parses and checks
it; that module's opening comment lists the keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelConfig", "ModelFile"]


@dataclass(frozen=True, slots=True)
class ModelFile:
    """One model file: its name in ``models_dir``, its size in bytes, its SHA-256 (lower
    case hex) and where it may be downloaded from when no peer has it (None: peers only)."""

    name: str
    size: int
    sha256: str
    url: str | None = None

    def describe(self) -> dict[str, Any]:
        """As a gateway reports the files it holds: name, size, sha256."""
        return {"name": self.name, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model: how to start its server and what lease it needs."""

    name: str
    command: tuple[str, ...]  # ``{port}`` is replaced by the port the gateway picks
    vram: int | None  # MiB per GPU; None: estimated from the model file ("auto")
    priority: int = 500
    keep_alive_s: float = 300.0
    ready: str | None = None  # None: /health, then /v1/models where /health is a 404
    max_parallel: int = 4
    replicas: int = 1  # at most, in the whole cluster where other gateways declare it too
    replicas_min: int = 1  # those beyond are marked idle as soon as nothing is in flight
    aliases: tuple[str, ...] = ()
    ctx: int | None = None
    model_file: str | None = None
    file: ModelFile | None = None  # a file in models_dir the command names as ``{file}``
    gpus: int = 1
    queue_timeout_s: float = 300.0
    load_timeout_s: float = 300.0
    grace_s: float = 10.0
    idle_after_s: float = 0.5
    ttl_s: float = 30.0
    preemptible: bool | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    pinned: bool = False  # at start; pin and unpin change it while the gateway runs
    min_resident_s: float = 0.0  # after ready, before the lease may be marked idle
    swap_after_s: float = 30.0  # busy while another model waits this long: marked idle
    engine: str = "generic"  # a name of engines.ENGINE_NAMES
    sleep_after_s: float | None = None  # None: never asleep (stopped after keep_alive)
    sleep_level: int = 1  # vLLM's
    ollama_serve: str | None = None  # an Ollama model: the entry whose serve holds it
