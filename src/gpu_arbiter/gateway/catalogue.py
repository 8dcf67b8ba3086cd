"""The cluster's catalogue: the models declared once, at the controller, and where each
may run. Pure: text in, values out, no I/O.

::

    [models.chat]                  # the keys of a gateway's [models.NAME] (config.py)
    command = "llama-server -m /models/qwen.gguf -c 8192 --port {port}"
    vram = "6G"
    hosts = ["box-1", "box-3"]     # these workers only (default: any)
    labels = { zone = "a" }        # every one must match the worker's (its agent's)
    vendor = "nvidia"              # its GPUs: vendor, a model glob ("*A100*"), exact
    gpu_model = "*A100*"           #   architectures, a least compute capability;
    gpu_arch = ["sm_80", "sm_90"]  #   each as a lease's constraints say it
    min_compute_capability = "8.0"

A catalogue has no ``[gateway]`` table: how a gateway listens, its keys and its token
stay in each host's own ``models.toml``. By default a model may run on every worker
that has enough GPUs (its ``gpus``) of at least its ``vram`` each; for ``vram =
"auto"`` the estimate made on that host is used where it has one (the model file is
readable there), else the model is assumed to fit here (the follower leaves such a
model out of its host's share, with why: ``follower.py``).

:func:`parse_catalogue` refuses a catalogue whole at its first error, a
:class:`CatalogueError` naming the file, the line and the field (``catalogue.toml:14:
models.chat.vram: '6X' is not a size; ...``). TOML itself gives no positions for the
values it read, so the line is found in the text: the ``[models.NAME]`` table's
header, then the ``key =`` line under it (a syntax error carries its own line).
:func:`share` is the part of a catalogue one worker may run.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import Constraints, Gpu, InvalidInput, format_mb, priority_name, validate_worker_name
from ..core.filters import mismatch
from .config import parse_models
from .servers.config import ModelConfig

__all__ = [
    "PLACEMENT_KEYS",
    "Catalogue",
    "CatalogueError",
    "Entry",
    "describe",
    "line_of",
    "parse_catalogue",
    "share",
]

PLACEMENT_KEYS = frozenset(
    {"hosts", "labels", "vendor", "gpu_model", "gpu_arch", "min_compute_capability"}
)
"""The keys of a catalogue's model table that say where it may run (not the model's)."""
MAX_HOSTS = 64


class CatalogueError(InvalidInput):
    """A catalogue refused: ``file``, ``line`` (None where no line says it), ``field``
    and ``reason``; the message is ``FILE:LINE: FIELD: REASON``."""

    def __init__(self, file: str, line: int | None, field: str, reason: str) -> None:
        super().__init__(field, reason)
        where = file if line is None else f"{file}:{line}"
        self.message = f"{where}: {field}: {reason}"
        self.args = (self.message,)
        self.file = file
        self.line = line
        self.details.update(file=file, line=line)


@dataclass(frozen=True, slots=True)
class Entry:
    """One model of the catalogue and where it may run: ``hosts`` (worker names; empty:
    any) and ``constraints`` on the worker's labels and GPUs (vendor, model, arch,
    compute capability; never a worker: that is ``hosts``)."""

    model: ModelConfig
    hosts: tuple[str, ...] = ()
    constraints: Constraints = field(default_factory=Constraints)


@dataclass(frozen=True, slots=True)
class Catalogue:
    """The models of a catalogue, by name (an Ollama entry's models each by its own)."""

    entries: Mapping[str, Entry]

    @property
    def models(self) -> dict[str, ModelConfig]:
        return {name: entry.model for name, entry in self.entries.items()}


# ---------------------------------------------------------------- parsing


def parse_catalogue(text: str, file: str = "catalogue.toml") -> Catalogue:
    """``text`` (the file ``file``'s) as a catalogue, or :class:`CatalogueError`."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise _syntax_error(file, str(error)) from None
    try:
        return _catalogue(data)
    except InvalidInput as error:
        names = _table_names(data)
        raise CatalogueError(file, line_of(text, _path(error.field, names)), error.field,
                             error.reason) from None  # fmt: skip


def _catalogue(data: Mapping[str, Any]) -> Catalogue:
    if "gateway" in data:
        raise InvalidInput(
            "gateway", "not in a catalogue: a gateway's own settings stay in its models.toml"
        )
    unknown = sorted(set(data) - {"models"})
    if unknown:
        raise InvalidInput(unknown[0], "unknown section; a catalogue has [models.NAME] tables")
    table = data.get("models", {})
    if not isinstance(table, dict):
        raise InvalidInput("models", "must be a table of [models.NAME] tables")
    models = parse_models(table, also=PLACEMENT_KEYS)
    placements = {name: _placement(name, spec) for name, spec in table.items()}
    return Catalogue(
        {
            name: Entry(model, *placements[model.ollama_serve or name])
            for name, model in models.items()
        }
    )


def _placement(name: str, spec: Mapping[str, Any]) -> tuple[tuple[str, ...], Constraints]:
    """Where the models of table ``name`` may run: its hosts, and its constraints."""
    where = f"models.{name}"
    hosts = _hosts(spec["hosts"], f"{where}.hosts") if "hosts" in spec else ()
    labels = spec.get("labels")
    if labels is not None and (
        not isinstance(labels, dict)
        or not all(isinstance(v, str) and v for v in labels.values())
        or len(labels) > 32
    ):
        raise InvalidInput(f"{where}.labels", 'must be a table of text, such as { zone = "a" }')
    for key in ("vendor", "gpu_model"):
        if key in spec and (not isinstance(spec[key], str) or not spec[key].strip()):
            raise InvalidInput(f"{where}.{key}", "must be a non-empty string")
    try:
        constraints = Constraints.build(
            vendor=spec.get("vendor"),
            min_compute_capability=spec.get("min_compute_capability"),
            gpu_arch=spec.get("gpu_arch"),
            gpu_model=spec.get("gpu_model"),
            labels=labels,
        )
    except InvalidInput as error:
        raise InvalidInput(f"{where}.{error.field.removeprefix('constraints.')}",
                           error.reason) from None  # fmt: skip
    return hosts, constraints


def _hosts(value: Any, where: str) -> tuple[str, ...]:
    """A non-empty list of worker names, each once."""
    if not isinstance(value, list):
        raise InvalidInput(where, 'must be a list of worker names, such as ["box-1"]')
    if not value:
        raise InvalidInput(where, "names no worker: leave hosts out for any worker")
    if len(value) > MAX_HOSTS:
        raise InvalidInput(where, f"names more than {MAX_HOSTS} workers")
    names = [validate_worker_name(host, where) for host in value]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise InvalidInput(where, f"names {twice[0]} twice")
    return tuple(names)


_SYNTAX_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")
_SYNTAX_END = re.compile(r"\s*\(at end of document\)$")


def _syntax_error(file: str, message: str) -> CatalogueError:
    """tomllib's message (``Invalid value (at line 3, column 7)``) as a CatalogueError."""
    found = _SYNTAX_AT.search(message)
    if found is not None:
        reason = f"{message[: found.start()]} (column {found.group(2)})"
        return CatalogueError(file, int(found.group(1)), "toml", reason)
    ended = _SYNTAX_END.search(message)
    if ended is not None:
        return CatalogueError(file, None, "toml", f"{message[: ended.start()]} at its end")
    return CatalogueError(file, None, "toml", message)


# ---------------------------------------------------------------- where a field is


def _table_names(data: Mapping[str, Any]) -> list[str]:
    models = data.get("models")
    return list(models) if isinstance(models, dict) else []


def _path(field: str, names: Sequence[str]) -> tuple[str, ...]:
    """An error's field (``models.qwen2.5.vram``) as key parts (``models``,
    ``qwen2.5``, ``vram``): a model's name may hold dots, so it is found among the
    table's names (the longest that fits)."""
    for name in sorted(names, key=len, reverse=True):
        prefix = f"models.{name}"
        if field == prefix or field.startswith(prefix + "."):
            rest = field[len(prefix) + 1 :]
            return ("models", name, *(_keys(rest) if rest else ()))
    return _keys(field)


_KEY = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_KEY_PATH = rf"{_KEY}(?:\s*\.\s*{_KEY})*"
_HEADER = re.compile(rf"\s*\[\[?\s*({_KEY_PATH})\s*\]\]?\s*(?:#.*)?$")
_ASSIGN = re.compile(rf"\s*({_KEY_PATH})\s*=")
_ONE_KEY = re.compile(_KEY)


def _keys(text: str) -> tuple[str, ...]:
    """A dotted key path's keys, unquoted."""
    return tuple(_unquote(key) for key in _ONE_KEY.findall(text))


def _unquote(key: str) -> str:
    if key[:1] == '"':
        return re.sub(r"\\(.)", r"\1", key[1:-1])
    if key[:1] == "'":
        return key[1:-1]
    return key


def line_of(text: str, path: Sequence[str]) -> int | None:
    """The line (from 1) of the key ``path`` in TOML ``text``: the line that sets it, else
    the nearest line that sets or opens a table above it (the ``[models.NAME]`` header of
    a key that is missing); None when no line does. Lines inside multi-line strings are
    not read as keys."""
    wanted = tuple(path)
    table: tuple[str, ...] = ()
    best: tuple[int, int] | None = None  # (how many keys match, line)
    in_string: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if in_string is not None:
            if line.count(in_string) % 2:
                in_string = None
            continue
        header = _HEADER.match(line)
        if header is not None:
            table = _keys(header.group(1))
            found = table
        else:
            assign = _ASSIGN.match(line)
            if assign is None:
                continue
            found = (*table, *_keys(assign.group(1)))
            in_string = _opens_string(line[assign.end() :])
        if wanted[: len(found)] == found and (best is None or len(found) > best[0]):
            best = (len(found), number)
    return None if best is None else best[1]


def _opens_string(value: str) -> str | None:
    """The quotes of a multi-line string that ``value`` opens and does not close."""
    for quotes in ('"""', "'''"):
        if value.count(quotes) % 2:
            return quotes
    return None


# ---------------------------------------------------------------- one worker's share


def share(
    catalogue: Catalogue,
    worker: str,
    labels: Mapping[str, str],
    gpus: Sequence[Gpu],
    estimates: Mapping[str, int] | None = None,
) -> dict[str, ModelConfig]:
    """The catalogue's models that ``worker`` (with ``labels``, as its agent registered
    it, and ``gpus``) may run, by name: those whose ``hosts`` name it (or that name none)
    and that enough of its GPUs match (the model's ``gpus`` of them, each matching its
    constraints with a capacity of at least its ``vram``). ``estimates``: MiB per GPU of
    the ``vram = "auto"`` models this host estimated; one without is assumed to fit."""
    name = validate_worker_name(worker, "worker")
    estimated = estimates or {}
    return {
        model: entry.model
        for model, entry in catalogue.entries.items()
        if _may_run(entry, name, labels, gpus, estimated.get(model))
    }


def _may_run(
    entry: Entry, worker: str, labels: Mapping[str, str], gpus: Sequence[Gpu], estimate: int | None
) -> bool:
    if entry.hosts and worker not in entry.hosts:
        return False
    model = entry.model
    need_mb = model.vram if model.vram is not None else (estimate or 0)
    fitting = sum(1 for gpu in gpus if mismatch(gpu, labels, entry.constraints, need_mb) is None)
    return fitting >= model.gpus


# ---------------------------------------------------------------- for readers


def describe(catalogue: Catalogue) -> dict[str, dict[str, Any]]:
    """Each model as JSON for readers of the catalogue (``GET /v1/catalogue``): what it
    runs, its lease's shape, and where it may run."""
    return {name: _described(entry) for name, entry in sorted(catalogue.entries.items())}


def _described(entry: Entry) -> dict[str, Any]:
    model, c = entry.model, entry.constraints
    cc = c.min_compute_capability
    return {
        "command": list(model.command),
        "vram_mb": model.vram,
        "vram": "auto" if model.vram is None else format_mb(model.vram),
        "gpus": model.gpus,
        "priority": priority_name(model.priority),
        "replicas": model.replicas,
        "aliases": list(model.aliases),
        "engine": model.engine,
        "ollama_serve": model.ollama_serve,
        "hosts": list(entry.hosts),
        "labels": dict(c.labels),
        "vendor": c.vendor,
        "gpu_model": c.gpu_model,
        "gpu_arch": list(c.gpu_arch),
        "min_compute_capability": None if cc is None else f"{cc[0]}.{cc[1]}",
    }
