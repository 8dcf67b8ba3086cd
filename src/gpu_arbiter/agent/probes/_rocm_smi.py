"""The AMD probe: ``rocm-smi ... --json``, parsed by a pure function.

rocm-smi prints one object per card, keyed ``card0``, ``card1``...; every value is a
string. Memory is in bytes (``"VRAM Total Memory (B)"``); key spelling varies across
ROCm releases (``Card series`` / ``Card Series``), so keys are matched without case.
A ``system`` object carries host-wide values such as the driver version. rocm-smi
does not list processes per GPU here, so ``processes`` is ``None``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from typing import Any

from ._snapshot import (
    GpuFailure,
    GpuReading,
    KnownGpus,
    ProbeSnapshot,
    ProbeUnavailable,
    mb_ceil,
    mb_floor,
)
from ._tool import ToolError, find_tool, run_tool

__all__ = ["ROCM_SMI_ARGS", "RocmSmiProbe", "parse_rocm_smi"]

ROCM_SMI_ARGS = (
    "--showmeminfo",
    "vram",
    "--showproductname",
    "--showid",
    "--showuniqueid",
    "--showdriverversion",
    "--json",
)
_CARD = re.compile(r"card(\d+)")
_GFX = re.compile(r"gfx[0-9a-f]{3,4}")
_TOTAL = "vram total memory (b)"
_USED = "vram total used memory (b)"


def _folded(fields: Mapping[str, Any]) -> dict[str, str]:
    return {str(key).strip().lower(): str(value).strip() for key, value in fields.items()}


def _known(fields: Mapping[str, str], *keys: str) -> str:
    """The first of ``keys`` that holds a real value ("N/A" counts as none)."""
    for key in keys:
        value = fields.get(key, "")
        if value and value.lower() not in ("n/a", "unknown"):
            return value
    return ""


def _card(index: int, fields: dict[str, str], driver: str) -> GpuReading | GpuFailure:
    uuid = _known(fields, "unique id", "guid")
    total, used = fields.get(_TOTAL, ""), fields.get(_USED, "")
    if not total.isdigit() or not used.isdigit():
        problem = f"VRAM total {total or 'missing'!s}, used {used or 'missing'!s}"
        return GpuFailure(index, f"rocm-smi: no memory reading ({problem})", uuid)
    gfx = _known(fields, "gfx version").lower()
    return GpuReading(
        index=index,
        total_mb=mb_floor(int(total)),
        used_mb=mb_ceil(int(used)),
        uuid=uuid,
        model=_known(fields, "card series", "card model", "device name"),
        vendor="amd",
        arch=gfx if _GFX.fullmatch(gfx) else "",
        driver_version=driver,
    )


def parse_rocm_smi(
    text: str, *, known: KnownGpus | None = None, errors: tuple[str, ...] = ()
) -> ProbeSnapshot:
    """A snapshot from the JSON of ``rocm-smi <ROCM_SMI_ARGS>``; text before the JSON
    (warnings some releases print) is skipped; malformed JSON is a snapshot error."""
    known = known or KnownGpus()
    start = text.find("{")
    try:
        data = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError as err:
        data, problem = None, f"rocm-smi: output is not JSON ({err.msg} at line {err.lineno})"
    else:
        problem = "rocm-smi: output holds no JSON object"
    if not isinstance(data, dict):
        return known.complete("rocm-smi", [], errors=(*errors, problem), missing_error=problem)
    system = data.get("system")
    driver = _known(_folded(system), "driver version") if isinstance(system, dict) else ""
    readings: list[GpuReading] = []
    failures: list[GpuFailure] = []
    for key, fields in data.items():
        match = _CARD.fullmatch(str(key))
        if match is None:
            continue
        index = int(match.group(1))
        if not isinstance(fields, dict):
            failures.append(GpuFailure(index, f"rocm-smi: {key} is not an object"))
            continue
        result = _card(index, _folded(fields), driver)
        if isinstance(result, GpuReading):
            readings.append(result)
        else:
            failures.append(result)
    return known.complete("rocm-smi", readings, failures, errors)


class RocmSmiProbe:
    """Runs ``rocm-smi`` once per snapshot."""

    def __init__(self, binary: str = "rocm-smi", *, timeout_s: float = 10.0) -> None:
        self._binary = binary
        self._timeout_s = timeout_s
        self._known = KnownGpus()
        self._lock = asyncio.Lock()

    @classmethod
    def open(cls, *, path: str | None = None, timeout_s: float = 10.0) -> RocmSmiProbe:
        binary = find_tool("rocm-smi", path)
        if binary is None:
            raise ProbeUnavailable("rocm-smi: not found on PATH")
        return cls(binary, timeout_s=timeout_s)

    @property
    def name(self) -> str:
        return "rocm-smi"

    async def snapshot(self) -> ProbeSnapshot:
        async with self._lock:
            try:
                result = await run_tool([self._binary, *ROCM_SMI_ARGS], self._timeout_s)
            except ToolError as err:
                return self._known.broken(self.name, str(err))
            errors: tuple[str, ...] = ()
            if result.returncode != 0:
                errors = (f"rocm-smi exited with {result.status()}",)
            return parse_rocm_smi(result.stdout, known=self._known, errors=errors)

    async def aclose(self) -> None:
        return None
