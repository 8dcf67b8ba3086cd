"""Checks of human input, for the values of :mod:`.model` to build themselves from.

Each check takes what a client sent (any type: JSON, CLI arguments, Python calls) and
returns it in the form a value holds, or raises :class:`~.errors.InvalidInput` naming
the field and the reason; it changes nothing else. The limits here bound everything a
request may carry (free text, metadata, lists of names), so that no input grows the
core's state without bound.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from .errors import InvalidInput
from .units import PRIORITY_NAMES, is_ascii_number, parse_mb, parse_priority

__all__ = [
    "MAX_GPUS_PER_REQUEST",
    "MAX_METADATA_BYTES",
    "MAX_METADATA_DEPTH",
    "MAX_METADATA_KEYS",
    "MAX_NEVER_PREEMPT",
    "MAX_TEXT",
    "MAX_WORKER_NAMES",
    "check_gpus",
    "check_metadata",
    "check_seconds",
    "check_text",
    "checked_scalars",
    "compute_capability",
    "gpu_id_parts",
    "is_arch",
    "json_value_problem",
    "parse_archs",
    "parse_capability",
    "parse_gpu_ids",
    "parse_labels",
    "parse_lease_ids",
    "parse_worker_names",
    "validate_worker_name",
]

_WORKER_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_ARCH = re.compile(r"^(sm_\d{2,3}|gfx[0-9a-f]{3,4}|[a-z][a-z0-9_]{0,31})$", re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_LEASE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$", re.ASCII)  # as the routes take them
MAX_TEXT = 256
MAX_METADATA_KEYS = 32
MAX_METADATA_BYTES = 4096
MAX_METADATA_DEPTH = 8
MAX_GPUS_PER_REQUEST = 64
MAX_NEVER_PREEMPT = 16
MAX_WORKER_NAMES = 64  # constraints.workers, constraints.prefer_workers


# ---------------------------------------------------------------- text and JSON


def json_value_problem(value: Any, max_depth: int) -> tuple[str, str] | None:
    """Where ``value`` is not strict JSON, and why: ``(path, reason)``, or None when it is.

    Strict JSON: objects with text keys, lists, text, finite numbers, booleans, null,
    nested at most ``max_depth`` deep. The walk stops at the first problem, so it is
    bounded by the depth whatever the value (no recursion error on a deep one)."""
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        path, item, depth = stack.pop()
        if isinstance(item, dict | list) and depth >= max_depth:
            return path, f"nested deeper than {max_depth} levels"
        if isinstance(item, dict):
            for key, inner in item.items():
                if not isinstance(key, str):
                    return path, f"has a key that is not text ({type(key).__name__})"
                if not _encodable(key):  # named by its parent: the key cannot be written
                    return path, "has a key holding a lone surrogate: not valid Unicode text"
                stack.append((f"{path}.{key}" if path else key, inner, depth + 1))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", inner, depth + 1) for i, inner in enumerate(item))
        elif isinstance(item, float) and not math.isfinite(item):
            name = "NaN" if math.isnan(item) else "Infinity" if item > 0 else "-Infinity"
            return path, f"{name} is not a JSON number (numbers must be finite)"
        elif isinstance(item, str) and not _encodable(item):
            return path, "holds a lone surrogate: not valid Unicode text"
        elif item is not None and not isinstance(item, str | int | float):
            return path, f"a {type(item).__name__} is not a JSON value"
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_text(field: str, text: Any, *, max_len: int = MAX_TEXT, min_len: int = 0) -> str:
    """Free text of ``min_len..max_len`` chars with no control characters (NUL, newline,
    escape...): what a holder, an idempotency key or a label may be."""
    if not isinstance(text, str) or not min_len <= len(text) <= max_len:
        raise InvalidInput(field, f"must be text of {min_len}..{max_len} chars")
    if _CONTROL.search(text) or not _encodable(text):
        raise InvalidInput(field, "must not contain control characters or lone surrogates")
    return text


def check_metadata(metadata: Mapping[str, Any] | None, field: str = "metadata") -> dict[str, Any]:
    """A small JSON object: at most 32 keys, 8 levels and 4 KiB encoded, strict JSON."""
    meta = dict(metadata or {})
    if len(meta) > MAX_METADATA_KEYS:
        raise InvalidInput(field, f"must have at most {MAX_METADATA_KEYS} keys")
    problem = json_value_problem(meta, MAX_METADATA_DEPTH)
    if problem is not None:
        where, reason = problem
        raise InvalidInput(f"{field}.{where}" if where else field, reason)
    try:
        size = len(json.dumps(meta, separators=(",", ":")).encode())
    except ValueError as error:  # an integer too long to write
        raise InvalidInput(field, f"cannot be written as JSON: {error}") from None
    if size > MAX_METADATA_BYTES:
        raise InvalidInput(field, f"must be at most {MAX_METADATA_BYTES} bytes as JSON")
    return meta


# ---------------------------------------------------------------- workers, GPUs, leases


def validate_worker_name(name: str, field_name: str = "worker") -> str:
    """Case-folds and checks ``[a-z0-9][a-z0-9._-]{0,62}``."""
    if not isinstance(name, str):
        raise InvalidInput(field_name, "must be a string")
    folded = name.strip().lower()
    if not _WORKER_NAME.match(folded):
        raise InvalidInput(
            field_name,
            f"{name!r} is not a worker name: 1-63 of a-z 0-9 . _ - starting with a letter or digit",
        )
    return folded


def parse_worker_names(texts: Any, field_name: str, least: int) -> tuple[str, ...]:
    """``least``..64 worker names, each checked and case-folded as ``constraints.worker``;
    sorted, each once."""
    if isinstance(texts, str) or not isinstance(texts, list | tuple):
        raise InvalidInput(field_name, "must be a list of worker names")
    if not least <= len(texts) <= MAX_WORKER_NAMES:
        raise InvalidInput(field_name, f"must name {least}..{MAX_WORKER_NAMES} workers")
    return tuple(sorted({validate_worker_name(text, field_name) for text in texts}))


def gpu_id_parts(text: str) -> tuple[str, int]:
    """``worker:index`` split exactly on the single ``:`` (never by prefix): the worker,
    checked and case-folded, and the index."""
    parts = text.split(":") if isinstance(text, str) else []
    if len(parts) != 2 or not parts[1].isdecimal() or not parts[1].isascii():
        raise InvalidInput("gpu", f"{text!r} is not WORKER:INDEX such as box-1:0")
    return validate_worker_name(parts[0]), int(parts[1])


def parse_gpu_ids(
    texts: Any, worker: str | None, workers: tuple[str, ...] = ()
) -> tuple[tuple[str, int], ...]:
    """Exact GPUs (``worker:index``, split on the single ``:``), all on one worker, as
    sorted ``(worker, index)`` pairs: a request that must land where its process already
    lives (a sleeping model server that wakes asks for its full lease again on its own
    GPUs)."""
    field_name = "constraints.gpu_ids"
    if isinstance(texts, str) or not isinstance(texts, list | tuple):
        raise InvalidInput(field_name, "must be a list of WORKER:INDEX such as box-1:0")
    if not 1 <= len(texts) <= MAX_GPUS_PER_REQUEST:
        raise InvalidInput(field_name, f"must name 1..{MAX_GPUS_PER_REQUEST} GPUs")
    try:
        ids = [gpu_id_parts(text) for text in texts]
    except InvalidInput as error:
        raise InvalidInput(field_name, error.reason) from None
    if len(set(ids)) != len(ids):
        raise InvalidInput(field_name, "names a GPU twice")
    on = sorted({on_worker for on_worker, _ in ids})
    if len(on) > 1:
        raise InvalidInput(field_name, f"must all be on one worker (got {', '.join(on)})")
    if worker is not None and on[0] != worker:
        raise InvalidInput(field_name, f"are on worker {on[0]}, not constraints.worker")
    if workers and on[0] not in workers:
        raise InvalidInput(field_name, f"are on worker {on[0]}, not one of constraints.workers")
    return tuple(sorted(ids))


def parse_lease_ids(texts: Any) -> tuple[str, ...]:
    """Leases a request must never preempt, nor reclaim while idle: a lease that grows by
    a second one (a sleeping model server that wakes asks for the difference on its own
    GPUs) names its first, which a request of a higher priority would otherwise revoke
    to make room for the very memory it wakes into."""
    field_name = "constraints.never_preempt"
    if texts is None:
        return ()
    if isinstance(texts, str) or not isinstance(texts, list | tuple):
        raise InvalidInput(field_name, "must be a list of lease ids")
    if len(texts) > MAX_NEVER_PREEMPT:
        raise InvalidInput(field_name, f"must name at most {MAX_NEVER_PREEMPT} leases")
    for text in texts:
        if not isinstance(text, str) or not _LEASE_ID.match(text):
            raise InvalidInput(field_name, f"{text!r} is not a lease id")
    return tuple(sorted(set(texts)))


# ---------------------------------------------------------------- architectures


def is_arch(text: str) -> bool:
    """An architecture such as ``sm_86`` (NVIDIA) or ``gfx1100`` (AMD), or another
    lower-case word of at most 32 chars."""
    return _ARCH.match(text) is not None


def compute_capability(arch: str) -> tuple[int, int] | None:
    """'sm_86' -> (8, 6); 'sm_100' -> (10, 0); anything else (AMD 'gfx1100') -> None."""
    if not arch.startswith("sm_") or not is_ascii_number(arch[3:]) or len(arch) < 5:
        return None
    digits = arch[3:]
    return int(digits[:-1]), int(digits[-1])


def parse_capability(value: Any) -> tuple[int, int] | None:
    """``MAJOR.MINOR`` such as ``8.0`` (text or a number), as numbers to compare; None
    for None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidInput("constraints.min_compute_capability", "must be like 8.0")
    text = str(value)
    match = re.fullmatch(r"\s*(\d{1,2})\.(\d)\s*", text, re.ASCII)
    if match is None:
        raise InvalidInput(
            "constraints.min_compute_capability", f"{text!r} is not MAJOR.MINOR such as 8.0"
        )
    return int(match.group(1)), int(match.group(2))


def parse_archs(value: Any) -> tuple[str, ...]:
    """One architecture or a list of them (exact strings such as ``sm_86``): sorted, each
    once; () for None."""
    if value is None:
        return ()
    if not isinstance(value, str | list | tuple | set | frozenset):
        raise InvalidInput("constraints.gpu_arch", "must be an architecture or a list of them")
    raw = [value] if isinstance(value, str) else list(value)
    for arch in raw:
        if not isinstance(arch, str) or not is_arch(arch):
            raise InvalidInput("constraints.gpu_arch", f"{arch!r} is not like sm_86")
    return tuple(sorted(set(raw)))


def parse_labels(labels: Any) -> tuple[tuple[str, str], ...]:
    """Labels a worker must carry, text to text, as sorted pairs; () for none."""
    if not labels:
        return ()
    if not isinstance(labels, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise InvalidInput("constraints.labels", "must map text to text")
    return tuple(sorted(labels.items()))


# ---------------------------------------------------------------- a request's numbers

_Scalars = tuple[int, int, bool, float | None, float | None, float]


@functools.lru_cache(maxsize=256, typed=True)  # typed: True and 1, 30 and 30.0 kept apart
def checked_scalars(
    vram_mb: Any,
    priority: Any,
    preemptible: Any,
    ttl_s: Any,
    max_wait_s: Any,
    load_timeout_s: Any,
) -> _Scalars:
    """A request's size, priority, preemptibility and times, checked (errors name the field)
    and in the form a request holds them. Pure, hence cached by ``Request.build``."""
    mb = parse_mb(vram_mb, "vram_mb")
    if mb <= 0:
        raise InvalidInput("vram_mb", "must be > 0")
    prio = parse_priority(priority)
    if preemptible is None:
        preemptible = prio < PRIORITY_NAMES["interactive"]
    elif not isinstance(preemptible, bool):
        raise InvalidInput("preemptible", "must be true or false")
    check_seconds("ttl_s", ttl_s, allow_none=True)
    check_seconds("max_wait_s", max_wait_s, allow_none=True, allow_zero=True)
    check_seconds("load_timeout_s", load_timeout_s, allow_none=False)
    return (
        mb,
        prio,
        preemptible,
        None if ttl_s is None else float(ttl_s),
        None if max_wait_s is None else float(max_wait_s),
        float(load_timeout_s),
    )


def check_gpus(gpus: Any, exact: int) -> int:
    """The request's GPU count: ``gpus`` as given, or ``exact``, the number of exact GPUs
    it asks for (0: none)."""
    if gpus is None:
        return exact or 1
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS_PER_REQUEST:
        raise InvalidInput("gpus", f"must be an integer 1..{MAX_GPUS_PER_REQUEST}")
    if exact and gpus != exact:
        raise InvalidInput(
            "gpus", f"must equal the number of constraints.gpu_ids ({exact}), or be left out"
        )
    return gpus


def check_seconds(name: str, value: Any, *, allow_none: bool, allow_zero: bool = False) -> None:
    """A number of seconds: finite, > 0 (or 0 where ``allow_zero``), at most a year."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(name, "must be a number of seconds")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise InvalidInput(name, "must be a finite number of seconds > 0")
    if value > 366 * 86400:
        raise InvalidInput(name, "must be at most a year")
