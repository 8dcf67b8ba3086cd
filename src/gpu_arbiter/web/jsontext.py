"""JSON as the project's HTTP listeners write it: strict (RFC 8259), whatever the value.

Python's ``json`` writes ``NaN`` and ``Infinity``, which JSON does not have and other
languages' parsers refuse; with ``allow_nan=False`` (Starlette's ``JSONResponse``) it
raises instead, and the answer becomes a 500. Every figure an answer carries is finite
at its source (the core's reasons say None where a time does not exist: no TTL, never
giving way). :func:`dumps` is the guard behind that, at the edge: a number that is not
finite is written as ``null`` and logged as an error naming where it was, so a bug
costs one figure, never the answer.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

__all__ = ["dumps", "non_finite"]

log = logging.getLogger("gpu_arbiter.web")


def dumps(value: Any, *, what: str = "an answer", ensure_ascii: bool = False) -> str:
    """``value`` as compact strict JSON (non-ASCII text as it is, or escaped with
    ``ensure_ascii``). A float that is not finite is written as ``null``, with one error
    logged naming ``what`` and each place (``reason.blocker.until (-inf)``). Anything else
    JSON cannot write raises, as ``json.dumps`` does."""
    try:
        return _strict(value, ensure_ascii)
    except ValueError as error:
        if "Out of range float" not in str(error):
            raise  # not a number: a circular reference
        places: list[str] = []
        cleaned = non_finite(value, places)
        log.error(
            "%s held numbers JSON cannot carry, written as null: %s (a bug: please report it)",
            what,
            ", ".join(places),
        )
        return _strict(cleaned, ensure_ascii)


def non_finite(value: Any, places: list[str], where: str = "") -> Any:
    """``value`` with every float that is not finite replaced by None, each one's place
    appended to ``places`` (dotted keys, ``[i]`` for list items)."""
    if isinstance(value, float) and not math.isfinite(value):
        places.append(f"{where or '(the value)'} ({value})")
        return None
    if isinstance(value, dict):
        return {
            k: non_finite(v, places, f"{where}.{k}" if where else str(k)) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [non_finite(v, places, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _strict(value: Any, ensure_ascii: bool) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, allow_nan=False, separators=(",", ":"))
