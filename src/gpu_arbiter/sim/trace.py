"""Traces: what arrives when. One JSON object per line::

    {"arrival_s": 12.5, "model": "chat-8b", "vram_mb": "10G", "gpus": 1,
     "priority": "interactive", "preemptible": false, "load_s": 8, "run_s": 60,
     "holder": "chat", "constraints": {"min_compute_capability": "8.0"}}

Required: ``arrival_s`` (seconds from the start, >= 0, non-decreasing is not
needed: the loader sorts), ``model``, ``vram_mb`` (a size as everywhere:
``10G``, ``512M`` or MiB), ``run_s`` (> 0). Optional: ``gpus`` (1),
``priority`` (``normal``), ``preemptible`` (true below ``interactive``),
``load_s`` (0), ``holder`` (""), ``constraints`` (as in a request). Blank lines
and lines starting with ``#`` are skipped. Every error names the line and the
field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import Constraints, InvalidInput, Request

__all__ = ["TraceError", "TraceRequest", "dump_trace", "load_trace", "parse_trace"]

_FIELDS = {
    "arrival_s",
    "model",
    "vram_mb",
    "gpus",
    "priority",
    "preemptible",
    "load_s",
    "run_s",
    "holder",
    "constraints",
}
_MAX_SECONDS = 366 * 86400


class TraceError(InvalidInput):
    """A trace line failed validation: ``line`` and ``field`` say where."""

    def __init__(self, line: int, field: str, reason: str) -> None:
        super().__init__(f"line {line}: {field}", reason)
        self.line = line


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: a model to load and run for ``run_s`` seconds."""

    arrival_s: float
    model: str
    vram_mb: int
    run_s: float
    gpus: int = 1
    priority: int = 500
    preemptible: bool = True
    load_s: float = 0.0
    holder: str = ""
    constraints: Constraints = field(default_factory=Constraints)
    raw_constraints: Mapping[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "arrival_s": round(self.arrival_s, 3),
            "model": self.model,
            "vram_mb": self.vram_mb,
            "gpus": self.gpus,
            "priority": self.priority,
            "preemptible": self.preemptible,
            "load_s": round(self.load_s, 3),
            "run_s": round(self.run_s, 3),
            "holder": self.holder,
        }
        if self.raw_constraints:
            out["constraints"] = dict(self.raw_constraints)
        return out


def _seconds(line: int, name: str, value: Any, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(line, name, f"must be a number of seconds, not {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise TraceError(
            line, name, "must be a finite number of seconds " + ("> 0" if positive else ">= 0")
        )
    if value > _MAX_SECONDS:
        raise TraceError(line, name, "must be at most a year")
    return float(value)


def _request(line: int, obj: Mapping[str, Any]) -> TraceRequest:
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise TraceError(line, unknown[0], f"unknown field (known: {', '.join(sorted(_FIELDS))})")
    for name in ("arrival_s", "model", "vram_mb", "run_s"):
        if name not in obj:
            raise TraceError(line, name, "is required")
    model = obj["model"]
    if not isinstance(model, str) or not 0 < len(model) <= 128:
        raise TraceError(line, "model", "must be text of 1..128 chars")
    raw_constraints = obj.get("constraints") or {}
    if not isinstance(raw_constraints, Mapping):
        raise TraceError(line, "constraints", "must be an object")
    try:
        constraints = Constraints.build(**raw_constraints)
        request = Request.build(
            model,
            vram_mb=obj["vram_mb"],
            gpus=obj.get("gpus", 1),
            priority=obj.get("priority", "normal"),
            preemptible=obj.get("preemptible"),
            holder=obj.get("holder", ""),
            constraints=constraints,
        )
    except InvalidInput as exc:
        raise TraceError(line, exc.field, exc.reason) from None
    except TypeError:
        raise TraceError(line, "constraints", "has an unknown key") from None
    return TraceRequest(
        arrival_s=_seconds(line, "arrival_s", obj["arrival_s"], positive=False),
        model=model,
        vram_mb=request.vram_mb,
        run_s=_seconds(line, "run_s", obj["run_s"], positive=True),
        gpus=request.gpus,
        priority=request.priority,
        preemptible=request.preemptible,
        load_s=_seconds(line, "load_s", obj.get("load_s", 0), positive=False),
        holder=request.holder,
        constraints=constraints,
        raw_constraints=dict(raw_constraints),
    )


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """Parses JSON lines into requests sorted by arrival (stable: ties keep file order)."""
    requests = []
    for number, text in enumerate(lines, start=1):
        text = text.strip()
        if not text or text.startswith("#"):
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(number, "json", f"not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(number, "json", "must be a JSON object")
        requests.append(_request(number, obj))
    if not requests:
        raise InvalidInput("trace", "has no requests")
    return sorted(requests, key=lambda r: r.arrival_s)


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Reads a JSON-lines trace file; errors name the line and the field."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput("trace", f"cannot read {str(path)!r}: {exc}") from None
    return parse_trace(text.splitlines())


def dump_trace(requests: Iterable[TraceRequest]) -> str:
    """The JSON-lines text of a trace (what :func:`load_trace` reads back)."""
    return "".join(json.dumps(r.as_json(), sort_keys=True) + "\n" for r in requests)
