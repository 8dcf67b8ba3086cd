"""``models.toml``: the model servers a gateway starts on demand.

::

    [gateway]                      # optional (a file of this table alone serves
                                   # only the models the cluster's catalogue gives it)
    host = "127.0.0.1"
    port = 8080
    worker = "box-1"               # default: the one agent on this host
    name = "box-1-8080"            # as the controller lists it (default: host-port)
    url = "https://box-1.example:8080"  # how the other gateways reach it (default: its
                                   # address, or this host's name on every interface)
    token_file = "gateway.token"   # its gateway token (mode 0600; relative: to this file)
    api_keys = ["..."]             # Authorization: Bearer KEY (required beyond loopback)
    api_key_file = "keys.txt"      # one key a line, # comments (relative: to this file)
    allowed_hosts = ["gpu.example"]  # Host names besides loopback names and addresses
    max_connections = 1000         # open connections to the port
    max_header_bytes = 65536       # request line + headers (431 beyond)
    max_headers = 100              # (431 beyond)
    header_timeout = "10s"         # to send the headers (408 beyond)
    max_body_bytes = "64M"         # one request's body (413 beyond)
    max_buffered_bytes = "256M"    # bodies held in memory at once, all requests (503)
    tls_cert = "box-1.pem"         # serve HTTPS (relative: to this file; reloaded when
    tls_key = "box-1-key.pem"      #   changed); a client certificate is checked against
    tls_client_ca = "ca.pem"       #   tls_client_ca where one is presented (SDKs: none)
    prefix_affinity = false        # true: a conversation's requests go where its prefix
                                   # went last while it has a free slot (default: off)
    prefix_chars = 1024            # how much of a chat's first messages (or a prompt)
                                   # names its prefix (16..1048576; with prefix_affinity)
    peer_check = "1s"              # how often each other gateway's /healthz is asked
    peer_timeout = "3s"            # unanswered this long: routed around (a freeze)
    peer_cut = "5s"                # still silent this long more: requests relayed to
                                   # it end with a 504 naming it (cluster/liveness.py)
    models_dir = "/var/lib/models" # model files (``file``; default: models/ in the state dir)
    disk_budget = "200G"           # model files beyond it that no replica uses are removed,
                                   # least recently used first (files/store.py)
    catalogue = true               # serve this worker's share of the cluster's catalogue
                                   # (follower.py); false: this file's models only

    [[gateway.keys]]               # a key with a name (beside or instead of api_keys)
    key = "..."
    name = "chat-ui"
    role = "user"                  # or "admin": also /admin/ (unload, pin, unpin)
    priority = "batch"             # its requests' class (default: the model's priority)

    [models.chat]
    command = "llama-server -m /models/qwen.gguf -c 8192 --port {port}"
                                   # or, with file: "llama-server -m {file} --port {port}"
    file = { name = "qwen.gguf", size = 4_100_000_000, sha256 = "...", url = "https://..." }
                                   # a file copied from a peer that holds it (else from its
                                   # url) before the lease is asked for (files/spec.py)
    vram = "auto"                  # or "6G": auto = estimated from the model file
    priority = "interactive"
    keep_alive = "5m"              # idle this long -> stopped and released
    ready = "/health"              # 2xx here = loaded (default: /health, else /v1/models)
    max_parallel = 4               # requests in flight per replica
    replicas = 2                   # at most this many replicas (each its own lease), or
                                   # { min = 1, max = 3 }: beyond min, marked idle (the
                                   # arbiter's to reclaim first) whenever nothing is in flight
    aliases = ["gpt-4o-mini"]
    pinned = false                 # true: never idle, never stopped for keep_alive
    min_resident = "0s"            # ready this long before its lease may be marked idle
    engine = "llama.cpp"           # llama.cpp, vllm, sglang, comfyui, ollama, generic
                                   # (default: read from the command, else generic)
    sleep_after = "1m"             # idle this long -> asleep, the process kept (engines
                                   # that can sleep; default: never)
    sleep_level = 1                # vLLM's: 1 weights to host memory, 2 weights dropped

    [models.local]                 # Ollama: one `ollama serve`, a model of the gateway
    command = ["env", "OLLAMA_HOST=127.0.0.1:{port}", "ollama", "serve"]
    [models.local.ollama_models]   # per Ollama model (routed by its Ollama name), each
    "llama3.2:3b" = "3G"           # with its own lease of this size (shrunk to its
    "qwen3:8b" = "6G"              # size_vram once loaded); the keys above apply to each

Sizes, durations and priorities go through the project's parsers; every error is an
:class:`~gpu_arbiter.core.InvalidInput` whose field names the model and the key
(``models.chat.vram``) and whose reason says what is wrong. API keys never appear in
an error (a duplicate is named by where it is).
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..core import InvalidInput, parse_mb, parse_priority, parse_seconds, validate_worker_name
from ..tls import ServerTls, server_context
from .cluster.liveness import LivenessSettings
from .files.spec import parse_bytes, parse_model_file
from .profile import Affinity
from .requests.access import ROLES, ApiKey
from .requests.bodies import MAX_BODY_BYTES, MAX_BUFFERED_BYTES
from .servers.config import ModelConfig
from .servers.engines import ENGINE_NAMES, can_sleep, detect_engine, engine_named
from .servers.estimate import gpus_of

__all__ = ["GatewayConfig", "load_config", "parse_config", "parse_models"]

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
        "file",
        "gpus",
        "queue_timeout",
        "load_timeout",
        "grace",
        "idle_after",
        "ttl",
        "preemptible",
        "env",
        "pinned",
        "min_resident",
        "swap_after",
        "engine",
        "sleep_after",
        "sleep_level",
        "ollama_models",
    }
)
_NOT_PER_OLLAMA_MODEL = {
    "vram": "each Ollama model's lease size is in ollama_models",
    "replicas": "one ollama serve holds one copy of a model",
    "aliases": "Ollama is sent the name the request gives: route by the Ollama name",
}
_PORT_KEYS = frozenset(
    {
        "api_keys",
        "api_key_file",
        "keys",
        "allowed_hosts",
        "max_connections",
        "max_header_bytes",
        "max_headers",
        "header_timeout",
        "max_body_bytes",
        "max_buffered_bytes",
    }
)
_ROUTING_KEYS = frozenset({"prefix_affinity", "prefix_chars"})
_LIVENESS_KEYS = frozenset({"peer_check", "peer_timeout", "peer_cut"})
_TLS_KEYS = ("tls_cert", "tls_key", "tls_client_ca")
_FILES_KEYS = frozenset({"models_dir", "disk_budget"})
_GATEWAY_KEYS = (
    frozenset({"host", "port", "worker", "controller", "name", "url", "token_file", *_TLS_KEYS})
    | _FILES_KEYS
    | {"catalogue"}
    | _PORT_KEYS
    | _ROUTING_KEYS
    | _LIVENESS_KEYS
)
PREFIX_CHARS = (16, 1 << 20)
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    models: Mapping[str, ModelConfig]
    host: str = "127.0.0.1"
    port: int = 8080
    worker: str | None = None
    name: str | None = None  # to the controller; None: this host's name and the port
    url: str | None = None  # how the other gateways reach it; None: where it listens
    controller: str | None = None
    token_file: Path | None = None  # the controller token's file (read at the start)
    keys: tuple[ApiKey, ...] = ()  # none: no auth (loopback only)
    allowed_hosts: tuple[str, ...] = ()
    max_connections: int = 1000
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    max_body_bytes: int = MAX_BODY_BYTES
    max_buffered_bytes: int = MAX_BUFFERED_BYTES
    affinity: Affinity | None = None  # prefix affinity (None: off)
    liveness: LivenessSettings = field(default_factory=LivenessSettings)  # of the peers
    tls: ServerTls | None = None  # the listener's (None: plain HTTP)
    models_dir: Path | None = None  # the model files' (None: models/ in the state dir)
    disk_budget: int | None = None  # bytes of model files kept at most (None: no bound)
    catalogue: bool = True  # follows the cluster's catalogue (its worker's share)

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
    return parse_config(data, base=path.parent)


def parse_config(data: Mapping[str, Any], base: Path | None = None) -> GatewayConfig:
    """``base``: the directory a relative ``api_key_file`` or ``token_file`` is in (the
    config file's)."""
    unknown = sorted(set(data) - {"gateway", "models"})
    if unknown:
        raise InvalidInput(unknown[0], "unknown section; known: gateway, models")
    gateway = _table(data.get("gateway", {}), "gateway")
    _known(gateway, _GATEWAY_KEYS, "gateway")
    models = parse_models(_table(data.get("models"), "models"))  # none: the catalogue's only
    port = gateway.get("port", 8080)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidInput("gateway.port", f"{port!r} is not a port 0..65535")
    return GatewayConfig(
        models=models,
        host=_text(gateway.get("host", "127.0.0.1"), "gateway.host"),
        port=port,
        worker=_optional_text(gateway.get("worker"), "gateway.worker"),
        name=_gateway_name(gateway.get("name")),
        controller=_optional_text(gateway.get("controller"), "gateway.controller"),
        url=_advertised(gateway.get("url"), "tls_cert" in gateway),
        token_file=_token_file(gateway.get("token_file"), base or Path()),
        affinity=_affinity(gateway),
        liveness=_liveness(gateway),
        tls=_tls(gateway, base or Path()),
        **_files_settings(gateway, base or Path()),
        catalogue=_flag(gateway.get("catalogue", True), "gateway.catalogue"),
        **_port_settings(gateway, base or Path()),
    )


def parse_models(
    table: Mapping[str, Any], *, also: frozenset[str] = frozenset()
) -> dict[str, ModelConfig]:
    """The ``[models.NAME]`` tables (``table``: the ``models`` table), each checked, by
    name: a table is one model, or one per Ollama model its ``ollama_models`` lists. A
    name or alias routes to one model only. ``also``: keys a table may have beside a
    model's own, which are not the model's (a catalogue's placement keys: its caller
    reads them). The one parser of model tables: a gateway's ``models.toml`` and the
    cluster's catalogue (``catalogue.py``) both use it."""
    models: dict[str, ModelConfig] = {}
    for name, spec in table.items():
        for model in _entry(name, spec, also):
            if model.name in models:
                where = _where(model)
                raise InvalidInput(where, f"{model.name!r} already names a model")
            models[model.name] = model
    _check_names(models)
    _check_files(models)
    return models


def _tls(gateway: Mapping[str, Any], base: Path) -> ServerTls | None:
    """``tls_cert``, ``tls_key`` (both or neither) and ``tls_client_ca``, each loaded once
    here so that a file that cannot be is named before anything starts. A client's
    certificate is checked where one is presented (a peer's), never required: the
    OpenAI SDKs that call a gateway have none."""
    paths = {k: base / _text(gateway[k], f"gateway.{k}") for k in _TLS_KEYS if k in gateway}
    if not paths:
        return None
    for one, other in (("tls_cert", "tls_key"), ("tls_key", "tls_cert")):
        if one in paths and other not in paths:
            raise InvalidInput(f"gateway.{other}", f"needed with gateway.{one}")
    if "tls_cert" not in paths:
        raise InvalidInput("gateway.tls_client_ca", "needs tls_cert and tls_key (TLS to serve)")
    fields = ("gateway.tls_cert", "gateway.tls_key", "gateway.tls_client_ca")
    tls = ServerTls(
        paths["tls_cert"], paths["tls_key"], paths.get("tls_client_ca"),
        client_cert_required=False, fields=fields,
    )  # fmt: skip
    server_context(tls)
    return tls


def _flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(field, f"must be true or false, not {value!r}")
    return value


def _token_file(value: Any, base: Path) -> Path | None:
    """``token_file``: the path of the gateway's controller token (relative: to the
    config file's directory); read, and its mode checked, when the gateway starts."""
    return None if value is None else base / _text(value, "gateway.token_file")


def _affinity(gateway: Mapping[str, Any]) -> Affinity | None:
    """``prefix_affinity`` and ``prefix_chars``: prefix affinity, or None (off)."""
    on = gateway.get("prefix_affinity", False)
    if not isinstance(on, bool):
        raise InvalidInput("gateway.prefix_affinity", f"must be true or false, not {on!r}")
    if "prefix_chars" not in gateway:
        return Affinity() if on else None
    chars = gateway["prefix_chars"]
    low, high = PREFIX_CHARS
    if isinstance(chars, bool) or not isinstance(chars, int) or not low <= chars <= high:
        raise InvalidInput(
            "gateway.prefix_chars", f"must be a whole number of characters {low}..{high}"
        )
    if not on:
        raise InvalidInput("gateway.prefix_chars", "only with prefix_affinity = true")
    return Affinity(chars)


def _liveness(gateway: Mapping[str, Any]) -> LivenessSettings:
    """``peer_check``, ``peer_timeout`` and ``peer_cut``: the liveness check of the other
    gateways; an ask is answered or timed out before the next (timeout at least check)."""
    found = {}
    seconds = _seconds_between(0.1, 3600)
    for key in ("peer_check", "peer_timeout", "peer_cut"):
        if key in gateway:
            found[f"{key[5:]}_s"] = _parsed(seconds, gateway[key], f"gateway.{key}")
    settings = LivenessSettings(**found)
    if settings.timeout_s < settings.check_s:
        raise InvalidInput(
            "gateway.peer_timeout",
            f"must be at least peer_check ({settings.check_s:g}s): one ask at a time",
        )
    return settings


def _port_settings(gateway: Mapping[str, Any], base: Path) -> dict[str, Any]:
    """The keys of the gateway's port: its bounds, API keys and host names."""
    found: dict[str, Any] = {}
    for key, (attribute, parse) in _PORT_PARSERS.items():
        if key in gateway:
            found[attribute] = _parsed(parse, gateway[key], f"gateway.{key}")
    body = found.get("max_body_bytes", MAX_BODY_BYTES)
    if found.get("max_buffered_bytes", MAX_BUFFERED_BYTES) < body:
        raise InvalidInput(
            "gateway.max_buffered_bytes",
            f"must be at least max_body_bytes ({body} bytes): else such a body never fits",
        )
    found["keys"] = _api_keys(gateway, base)
    return found


def _api_keys(gateway: Mapping[str, Any], base: Path) -> tuple[ApiKey, ...]:
    """``api_keys``, ``[[gateway.keys]]`` and ``api_key_file``'s keys, each once."""
    keys: list[tuple[str, ApiKey]] = []
    listed = gateway.get("api_keys", [])
    if not isinstance(listed, list):
        raise InvalidInput("gateway.api_keys", "must be a list of keys")
    for i, value in enumerate(listed):
        where = f"gateway.api_keys[{i}]"
        keys.append((where, ApiKey(where, _api_key(value, where))))
    tables = gateway.get("keys", [])
    if not isinstance(tables, list):
        raise InvalidInput("gateway.keys", "must be [[gateway.keys]] tables (key, name)")
    keys += [_key_table(i, table) for i, table in enumerate(tables)]
    if "api_key_file" in gateway:
        keys += _key_file(gateway["api_key_file"], base)
    seen: dict[str, str] = {}
    for where, key in keys:
        if key.key in seen:
            raise InvalidInput(where, f"the same key as {seen[key.key]}")
        seen[key.key] = where
    return tuple(key for _, key in keys)


def _key_table(i: int, table: Any) -> tuple[str, ApiKey]:
    where = f"gateway.keys[{i}]"
    table = _table(table, where)
    _known(table, frozenset({"key", "name", "role", "priority"}), where)
    if "key" not in table:
        raise InvalidInput(f"{where}.key", "missing")
    name = _text(table.get("name", where), f"{where}.name")
    role = table.get("role", "user")
    if role not in ROLES:
        raise InvalidInput(f"{where}.role", f"{role!r} is not a role: admin or user")
    priority = table.get("priority")
    if priority is not None:
        priority = _parsed(parse_priority, priority, f"{where}.priority")
    return where, ApiKey(name, _api_key(table["key"], f"{where}.key"), role, priority)


def _key_file(value: Any, base: Path) -> list[tuple[str, ApiKey]]:
    path = base / _text(value, "gateway.api_key_file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        why = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise InvalidInput("gateway.api_key_file", f"cannot read {path}: {why}") from None
    found = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if text and not text.startswith("#"):
            where = f"{path}:{number}"
            found.append((where, ApiKey(where, _api_key(text, where))))
    if not found:
        raise InvalidInput("gateway.api_key_file", f"{path} holds no key")
    return found


def _api_key(value: Any, where: str) -> str:
    """A key: 8 to 4096 printable ASCII characters, no space (it goes in a header)."""
    if not isinstance(value, str):
        raise InvalidInput(where, "must be a string")
    if not 8 <= len(value) <= 4096 or not all("!" <= c <= "~" for c in value):
        raise InvalidInput(where, "must be 8 to 4096 printable ASCII characters, no space")
    return value


def _bytes_between(low: int, high: int) -> Callable[[Any, str], int]:
    """A size in bytes: an integer, or ``"64M"``/``"1G"`` (binary units)."""

    def parse(value: Any, where: str) -> int:
        size = value if isinstance(value, int) and not isinstance(value, bool) else None
        if size is None:
            size = parse_mb(value, where) * MIB
        if not low <= size <= high:
            raise InvalidInput(where, f"must be between {low} and {high} bytes, not {size}")
        return size

    return parse


def _seconds_between(low: float, high: float) -> Callable[[Any, str], float]:
    def parse(value: Any, where: str) -> float:
        seconds = parse_seconds(value, where)
        if not low <= seconds <= high:
            raise InvalidInput(where, f"must be between {low:g} and {high:g} seconds")
        return seconds

    return parse


def _hosts(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(h, str) and h.strip() for h in value):
        raise InvalidInput(where, 'must be a list of host names ("*": any)')
    return tuple(h.strip() for h in value)


def _entry(name: str, spec: Any, also: frozenset[str]) -> list[ModelConfig]:
    """The models of one ``[models.NAME]`` table: itself, or the Ollama models its
    ``ollama serve`` holds (``ollama_models``)."""
    model = _model(name, spec, also)
    table = spec.get("ollama_models") if isinstance(spec, dict) else None
    where = f"models.{name}.ollama_models"
    if model.engine != "ollama":
        if table is not None:
            engine = model.engine
            raise InvalidInput(where, f'only an engine = "ollama" entry has them, not {engine}')
        return [model]
    if not isinstance(table, dict) or not table:
        raise InvalidInput(
            where, 'missing: a table of the Ollama models it serves and each one\'s lease size '
            '("llama3.2:3b" = "3G")',
        )  # fmt: skip
    for key, why in _NOT_PER_OLLAMA_MODEL.items():
        if key in spec:
            raise InvalidInput(f"models.{name}.{key}", f"not for an Ollama entry: {why}")
    return [_ollama_model(model, ollama, size) for ollama, size in table.items()]


def _ollama_model(entry: ModelConfig, name: str, size: Any) -> ModelConfig:
    where = f'models.{entry.name}.ollama_models."{name}"'
    if not _NAME.fullmatch(name):
        raise InvalidInput(
            where, "an Ollama model the gateway routes is named with letters, digits and "
            ". _ : - (64 at most)",
        )  # fmt: skip
    if size == "auto":
        raise InvalidInput(where, 'must be a size such as "3G": an Ollama model has no file here')
    vram = _parsed(_vram, size, where)
    return replace(entry, name=name, vram=vram, ollama_serve=entry.name)


def _where(model: ModelConfig) -> str:
    """Where ``model`` is in the config."""
    if model.ollama_serve is None:
        return f"models.{model.name}"
    return f'models.{model.ollama_serve}.ollama_models."{model.name}"'


def _model(name: str, spec: Any, also: frozenset[str]) -> ModelConfig:
    where = f"models.{name}"
    if not _NAME.fullmatch(name):
        raise InvalidInput(where, "a model name is letters, digits and . _ : - (64 at most)")
    spec = _table(spec, where)
    _known(spec, _MODEL_KEYS | also, where)
    if "command" not in spec:
        raise InvalidInput(f"{where}.command", "missing: the command that starts the server")
    values: dict[str, Any] = {"name": name, "command": _command(spec["command"], where)}
    for key, (attribute, parse) in _PARSERS.items():
        if key in spec:
            values[attribute] = _parsed(parse, spec[key], f"{where}.{key}")
    if "file" in spec:  # its errors name the file's own key (models.NAME.file.sha256)
        values["file"] = parse_model_file(spec["file"], f"{where}.file")
    if isinstance(values.get("replicas"), tuple):
        values["replicas_min"], values["replicas"] = values["replicas"]
    vram = spec.get("vram", "auto")
    values["vram"] = None if vram == "auto" else _parsed(_vram, vram, f"{where}.vram")
    if "gpus" not in spec:  # a tensor parallel server's command says how many it needs
        values["gpus"] = _command_gpus(values["command"], where)
    _engine_keys(spec, values, where)
    return ModelConfig(**values)


def _engine_keys(spec: Mapping[str, Any], values: dict[str, Any], where: str) -> None:
    """``engine`` (else the command's), and the sleep keys that engine allows."""
    if "engine" in spec:
        engine_named(spec["engine"], f"{where}.engine")
        values["engine"] = spec["engine"]
    else:
        values["engine"] = detect_engine(values["command"])
    engine = values["engine"]
    sleep_after = values.get("sleep_after_s")
    if sleep_after is not None and not can_sleep(engine):
        sleepers = ", ".join(name for name in ENGINE_NAMES if can_sleep(name))
        raise InvalidInput(
            f"{where}.sleep_after", f"engine {engine} cannot sleep (those that can: {sleepers})"
        )
    keep_alive = values.get("keep_alive_s", 300.0)
    if sleep_after is not None and sleep_after >= keep_alive:
        raise InvalidInput(
            f"{where}.sleep_after",
            f"must be shorter than keep_alive ({keep_alive:g}s): it would stop before it sleeps",
        )
    if "sleep_level" in spec and engine != "vllm":
        raise InvalidInput(f"{where}.sleep_level", f"only vllm has sleep levels, not {engine}")
    if "sleep_level" in spec and sleep_after is None:
        raise InvalidInput(f"{where}.sleep_level", "has no effect without sleep_after")


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


def _replicas(value: Any, where: str) -> int | tuple[int, int]:
    """``N`` (at most N) or ``{ min = 1, max = 3 }``."""
    if not isinstance(value, Mapping):
        return _int_between(1, 64)(value, where)
    unknown = set(value) - {"min", "max"}
    if unknown:
        raise InvalidInput(where, f"takes min and max, not {', '.join(sorted(unknown))}")
    low = _int_between(1, 64)(value.get("min", 1), f"{where}.min")
    high = _int_between(1, 64)(value.get("max", low), f"{where}.max")
    if high < low:
        raise InvalidInput(f"{where}.max", f"{high} is below min ({low})")
    return (low, high)


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
    "replicas": ("replicas", _replicas),
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
    "pinned": ("pinned", _bool),
    "min_resident": ("min_resident_s", _seconds),
    "swap_after": ("swap_after_s", _positive_seconds),
    "sleep_after": ("sleep_after_s", _positive_seconds),
    "sleep_level": ("sleep_level", _int_between(1, 2)),
}


_PORT_PARSERS: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    "allowed_hosts": ("allowed_hosts", _hosts),
    "max_connections": ("max_connections", _int_between(1, 1 << 20)),
    "max_header_bytes": ("max_header_bytes", _bytes_between(1024, 1 << 24)),
    "max_headers": ("max_headers", _int_between(8, 10_000)),
    "header_timeout": ("header_timeout_s", _seconds_between(0.1, 3600)),
    "max_body_bytes": ("max_body_bytes", _bytes_between(1024, 1 << 40)),
    "max_buffered_bytes": ("max_buffered_bytes", _bytes_between(1024, 1 << 42)),
}


def _files_settings(gateway: Mapping[str, Any], base: Path) -> dict[str, Any]:
    """``models_dir`` (relative: to the config file's directory) and ``disk_budget``."""
    found: dict[str, Any] = {}
    if "models_dir" in gateway:
        found["models_dir"] = base / _text(gateway["models_dir"], "gateway.models_dir")
    if "disk_budget" in gateway:
        found["disk_budget"] = _parsed(parse_bytes, gateway["disk_budget"], "gateway.disk_budget")
    return found


def _check_files(models: Mapping[str, ModelConfig]) -> None:
    """A command that says ``{file}`` has a ``file``; a ``file`` is not also a
    ``model_file``; two models naming one file name agree on its size and sha256."""
    named: dict[str, ModelConfig] = {}
    for model in models.values():
        where = _where(model)
        says_file = any("{file}" in part for part in model.command)
        if model.file is None:
            if says_file:
                raise InvalidInput(f"{where}.command", "says {file} but the model has no file")
            continue
        if model.model_file is not None:
            raise InvalidInput(f"{where}.model_file", "not with file: {file} is the model file")
        other = named.setdefault(model.file.name, model).file
        if other is not None and (other.size, other.sha256) != (model.file.size, model.file.sha256):
            raise InvalidInput(
                f"{where}.file.name",
                f"{model.file.name!r} is another model's file with another size or sha256",
            )


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


def _gateway_name(value: Any) -> str | None:
    """``[gateway] name``: a worker name (the controller lists the gateway by it)."""
    return None if value is None else validate_worker_name(value, "gateway.name")


def _advertised(value: Any, tls: bool) -> str | None:
    """``[gateway] url``: how the other gateways reach this one (its host name as its
    certificate names it, behind NAT or a load balancer): ``http(s)://HOST[:PORT]``,
    https exactly when it serves TLS."""
    if value is None:
        return None
    url = _text(value, "gateway.url").rstrip("/")
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise InvalidInput("gateway.url", f"{url!r} has no valid port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path:
        raise InvalidInput("gateway.url", f"{url!r} is not http(s)://HOST[:PORT]")
    if (parts.scheme == "https") != tls:
        need = "https with tls_cert" if tls else "http without tls_cert (or set tls_cert)"
        raise InvalidInput("gateway.url", f"{url!r}: must be {need}")
    return url


def _optional_text(value: Any, where: str) -> str | None:
    return None if value is None else _text(value, where)
