"""Memory sizes, durations and priorities as people write them, parsed in one place.

All memory inside gpu-arbiter is an integer number of MiB, every duration a number
of seconds. Numbers are written with the ASCII digits 0-9 only: other scripts'
digits (``"١٢G"``), superscripts and full-width forms are refused, wherever the
text comes from (the API, the command line, a configuration file).
"""

from __future__ import annotations

import re

from .errors import InvalidInput

__all__ = [
    "PRIORITY_NAMES",
    "format_mb",
    "format_s",
    "is_ascii_number",
    "parse_mb",
    "parse_priority",
    "parse_seconds",
    "priority_name",
]

# re.ASCII: \d is 0-9 and \s plain white space, not every script's digits and spaces.
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", re.ASCII)
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", re.ASCII | re.IGNORECASE)
_INTEGER = re.compile(r"-?\d+", re.ASCII)
_SECONDS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_FACTOR_MB = {
    "": 1,
    "m": 1,
    "mb": 1,
    "mib": 1,
    "g": 1024,
    "gb": 1024,
    "gib": 1024,
    "t": 1024 * 1024,
    "tb": 1024 * 1024,
    "tib": 1024 * 1024,
}
MAX_MB = 1 << 40

PRIORITY_NAMES: dict[str, int] = {
    "batch": 100,
    "background": 300,
    "normal": 500,
    "interactive": 800,
    "critical": 1000,
}


def parse_mb(value: str | int, field: str = "vram_mb") -> int:
    """``8G``, ``8GiB``, ``512M``, ``512MiB``, ``24000`` (MiB) -> MiB.

    Units are binary (a GPU's ``8G`` is 8 GiB, as nvidia-smi counts). A fraction
    is allowed when it lands on a whole MiB (``1.5G``). Anything else raises
    :class:`InvalidInput` naming ``field``.
    """
    if isinstance(value, bool):
        raise InvalidInput(field, "must be a size such as 8G, 512M or 24000 (MiB), not a boolean")
    if isinstance(value, int):
        mb = value
    else:
        if not isinstance(value, str):
            raise InvalidInput(field, f"must be a size such as 8G, not {type(value).__name__}")
        match = _SIZE.fullmatch(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _FACTOR_MB:
            raise InvalidInput(
                field, f"{value!r} is not a size; write 8G, 8GiB, 512M, 512MiB or 24000 (MiB)"
            )
        exact = float(match.group(1)) * _FACTOR_MB[unit]
        if exact != int(exact):
            raise InvalidInput(field, f"{value!r} is not a whole number of MiB")
        mb = int(exact)
    if mb < 0:
        raise InvalidInput(field, "must not be negative")
    if mb > MAX_MB:
        raise InvalidInput(field, f"{mb} MiB is larger than any GPU")
    return mb


def parse_seconds(value: str | float, field: str) -> float:
    """``90s``, ``10m``, ``1h``, ``2d``, ``45`` or ``0.5`` (seconds) -> seconds. Anything
    else (a negative or non-finite number, another unit) raises :class:`InvalidInput`
    naming ``field``."""
    if isinstance(value, bool):
        raise InvalidInput(field, "must be a duration such as 90s or 10m, not a boolean")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            raise InvalidInput(
                field, f"{value!r} is not a duration: give a number with s, m, h or d (90s, 10m)"
            )
        seconds = float(match.group(1)) * _SECONDS[match.group(2).lower()]
    if not 0 <= seconds < float("inf"):
        raise InvalidInput(field, "must be a finite number of seconds, not negative")
    return seconds


def is_ascii_number(text: str) -> bool:
    """Whether ``text`` is an integer in ASCII digits (``"12"``, ``"-3"``; not ``"١٢"``)."""
    return _INTEGER.fullmatch(text) is not None


def format_mb(mb: int) -> str:
    """24576 -> '24.0 GiB'; 512 -> '512 MiB'."""
    if abs(mb) >= 1024:
        return f"{mb / 1024:.1f} GiB"
    return f"{mb} MiB"


def format_s(seconds: float) -> str:
    """A duration as people read it: 0.25 -> '0.2s', 25.3 -> '25s', 750 -> '12m',
    9000 -> '2.5h'."""
    if seconds < 10:
        return f"{max(seconds, 0.0):.1f}s"
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def parse_priority(value: str | int, field: str = "priority") -> int:
    """An integer 0..1000 (higher is more important) or one of the names."""
    if isinstance(value, bool):
        raise InvalidInput(field, "must be an integer 0..1000 or a name, not a boolean")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in PRIORITY_NAMES:
            return PRIORITY_NAMES[text]
        if not is_ascii_number(text):
            names = ", ".join(PRIORITY_NAMES)
            raise InvalidInput(field, f"{value!r} is not an integer 0..1000 nor one of {names}")
        value = int(text)
    if not isinstance(value, int):
        raise InvalidInput(
            field, f"must be an integer 0..1000 or a name, not {type(value).__name__}"
        )
    if not 0 <= value <= 1000:
        raise InvalidInput(field, f"{value} is outside 0..1000")
    return value


def priority_name(priority: int) -> str:
    """The name of a named priority, else the number: 800 -> 'interactive', 650 -> '650'."""
    for name, number in PRIORITY_NAMES.items():
        if number == priority:
            return name
    return str(priority)
