"""``models.toml``: the model servers a gateway starts on demand.

::

    [gateway]                      # optional
    host = "127.0.0.1"
    port = 8080
    worker = "box-1"               # default: the one agent on this host

    [models.chat]
    command = "llama-server -m /models/qwen.gguf -c 8192 --port {port}"
    vram = "auto"                  # or "6G": auto = estimated from the model file
    priority = "interactive"
    keep_alive = "5m"              # idle this long -> stopped and released
    ready = "/health"              # 2xx here = loaded (default: /health, else /v1/models)
    max_parallel = 4               # requests in flight per replica
    replicas = 2                   # at most this many replicas (each its own lease)
    aliases = ["gpt-4o-mini"]

Sizes, durations and priorities go through the project's parsers; every error is an
:class:`~gpu_arbiter.core.InvalidInput` whose field names the model and the key
(``models.chat.vram``) and whose reason says what is wrong.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import InvalidInput, parse_mb, parse_priority, parse_seconds
from .estimate import gpus_of

__all__ = ["GatewayConfig", "ModelConfig", "load_config", "parse_config"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}", re.ASCII)
_MODEL_KEYS = frozenset(
    {
        "command",
        "vram",
        "priority",
        "keep_alive",
        "ready",
        "max_parallel",
        "replicas",
        "aliases",
        "ctx",
        "model_file",
        "gpus",
        "queue_timeout",
        "load_timeout",
        "grace",
        "idle_after",
        "ttl",
        "preemptible",
        "env",
    }
)
_GATEWAY_KEYS = frozenset({"host", "port", "worker", "controller"})


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
    replicas: int = 1
    aliases: tuple[str, ...] = ()
    ctx: int | None = None
    model_file: str | None = None
    gpus: int = 1
    queue_timeout_s: float = 300.0
    load_timeout_s: float = 300.0
    grace_s: float = 10.0
    idle_after_s: float = 0.5
    ttl_s: float = 30.0
    preemptible: bool | None = None
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    models: Mapping[str, ModelConfig]
    host: str = "127.0.0.1"
    port: int = 8080
    worker: str | None = None
    controller: str | None = None

    def find(self, name: str) -> ModelConfig | None:
        """The model called ``name`` or having it as an alias."""
        model = self.models.get(name)
        if model is not None:
            return model
        for candidate in self.models.values():
            if name in candidate.aliases:
                return candidate
        return None


def load_config(path: str | Path) -> GatewayConfig:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise InvalidInput(str(path), f"cannot read: {error.strerror or error}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise InvalidInput(str(path), f"not valid TOML: {error}") from None
    return parse_config(data)


def parse_config(data: Mapping[str, Any]) -> GatewayConfig:
    unknown = sorted(set(data) - {"gateway", "models"})
    if unknown:
        raise InvalidInput(unknown[0], "unknown section; known: gateway, models")
    gateway = _table(data.get("gateway", {}), "gateway")
    _known(gateway, _GATEWAY_KEYS, "gateway")
    models_table = _table(data.get("models"), "models")
    if not models_table:
        raise InvalidInput("models", "no model: add a [models.NAME] table with a command")
    models = {name: _model(name, spec) for name, spec in models_table.items()}
    _check_names(models)
    port = gateway.get("port", 8080)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidInput("gateway.port", f"{port!r} is not a port 0..65535")
    return GatewayConfig(
        models=models,
        host=_text(gateway.get("host", "127.0.0.1"), "gateway.host"),
        port=port,
        worker=_optional_text(gateway.get("worker"), "gateway.worker"),
        controller=_optional_text(gateway.get("controller"), "gateway.controller"),
    )


def _model(name: str, spec: Any) -> ModelConfig:
    where = f"models.{name}"
    if not _NAME.fullmatch(name):
        raise InvalidInput(where, "a model name is letters, digits and . _ : - (64 at most)")
    spec = _table(spec, where)
    _known(spec, _MODEL_KEYS, where)
    if "command" not in spec:
        raise InvalidInput(f"{where}.command", "missing: the command that starts the server")
    values: dict[str, Any] = {"name": name, "command": _command(spec["command"], where)}
    for key, (attribute, parse) in _PARSERS.items():
        if key in spec:
            values[attribute] = _parsed(parse, spec[key], f"{where}.{key}")
    vram = spec.get("vram", "auto")
    values["vram"] = None if vram == "auto" else _parsed(_vram, vram, f"{where}.vram")
    if "gpus" not in spec:  # a tensor parallel server's command says how many it needs
        values["gpus"] = _command_gpus(values["command"], where)
    return ModelConfig(**values)


def _command_gpus(command: tuple[str, ...], where: str) -> int:
    """The GPUs of ``vllm serve M -tp 2`` (and the like): its lease's ``gpus``."""
    try:
        return gpus_of(command) or 1
    except InvalidInput as error:
        raise InvalidInput(f"{where}.command", error.reason) from None


def _parsed(parse: Callable[[Any, str], Any], value: Any, where: str) -> Any:
    try:
        return parse(value, where)
    except InvalidInput as error:
        raise InvalidInput(where, error.reason) from None


def _command(value: Any, where: str) -> tuple[str, ...]:
    where = f"{where}.command"
    if isinstance(value, str):
        try:
            parts = shlex.split(value)
        except ValueError as error:
            raise InvalidInput(where, f"cannot be split into words: {error}") from None
    elif isinstance(value, list) and all(isinstance(part, str) for part in value):
        parts = list(value)
    else:
        raise InvalidInput(where, "must be a string or a list of strings")
    if not parts:
        raise InvalidInput(where, "is empty")
    if not any("{port}" in part for part in parts):
        raise InvalidInput(where, "must contain {port}: the gateway picks the server's port")
    return tuple(parts)


def _vram(value: Any, where: str) -> int:
    mb = parse_mb(value, where)
    if mb <= 0:
        raise InvalidInput(where, 'must be more than 0, or "auto"')
    return mb


def _seconds(value: Any, where: str) -> float:
    return parse_seconds(value, where)


def _positive_seconds(value: Any, where: str) -> float:
    seconds = parse_seconds(value, where)
    if seconds <= 0:
        raise InvalidInput(where, "must be more than 0 seconds")
    return seconds


def _int_between(low: int, high: int) -> Callable[[Any, str], int]:
    def parse(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidInput(where, f"{value!r} is not an integer {low}..{high}")
        return value

    return parse


def _ready(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise InvalidInput(where, f"{value!r} is not a path such as /health")
    return value


def _aliases(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(a, str) and a for a in value):
        raise InvalidInput(where, "must be a list of names")
    for alias in value:
        if len(alias) > 128 or not alias.isprintable():
            raise InvalidInput(where, f"{alias!r} is not a name (printable, 128 at most)")
    return tuple(value)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(where, f"{value!r} is not true or false")
    return value


def _env(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise InvalidInput(where, "must be a table of strings")
    return dict(value)


def _model_file(value: Any, where: str) -> str:
    return _text(value, where)


_PARSERS: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    "priority": ("priority", parse_priority),
    "keep_alive": ("keep_alive_s", _seconds),
    "ready": ("ready", _ready),
    "max_parallel": ("max_parallel", _int_between(1, 4096)),
    "replicas": ("replicas", _int_between(1, 64)),
    "aliases": ("aliases", _aliases),
    "ctx": ("ctx", _int_between(1, 1 << 24)),
    "model_file": ("model_file", _model_file),
    "gpus": ("gpus", _int_between(1, 64)),
    "queue_timeout": ("queue_timeout_s", _positive_seconds),
    "load_timeout": ("load_timeout_s", _positive_seconds),
    "grace": ("grace_s", _seconds),
    "idle_after": ("idle_after_s", _seconds),
    "ttl": ("ttl_s", _positive_seconds),
    "preemptible": ("preemptible", _bool),
    "env": ("env", _env),
}


def _check_names(models: Mapping[str, ModelConfig]) -> None:
    """A name or alias routes to one model only."""
    owner: dict[str, str] = {name: name for name in models}
    for model in models.values():
        for alias in model.aliases:
            if alias in owner and owner[alias] != model.name:
                raise InvalidInput(
                    f"models.{model.name}.aliases", f"{alias!r} already names {owner[alias]}"
                )
            owner[alias] = model.name


def _table(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(where, "must be a table")
    return value


def _known(table: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise InvalidInput(
            f"{where}.{unknown[0]}", "unknown key; known: " + ", ".join(sorted(known))
        )


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(where, "must be a non-empty string")
    return value.strip()


def _optional_text(value: Any, where: str) -> str | None:
    return None if value is None else _text(value, where)
