"""The ``nvidia-smi`` fallback probe: CSV queries, parsed by pure functions.

``nvidia-smi --query-gpu=...`` prints one line per GPU, fields separated by ``, ``.
Names are not quoted, so a line is split from both ends: the name is whatever lies
between the uuid and the last four fields. A field nvidia-smi cannot give reads
``[N/A]`` or ``[Not Supported]``; a field it failed to read carries the error in
brackets (``[GPU is lost]``, ``[Unknown Error]``). A GPU it cannot open at all
prints a line of prose ("Unable to determine the device handle for GPU ...").
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ._snapshot import GpuFailure, GpuReading, KnownGpus, ProbeSnapshot, ProbeUnavailable
from ._tool import ToolError, find_tool, run_tool

__all__ = [
    "APPS_FIELDS",
    "GPU_FIELDS",
    "NvidiaSmiProbe",
    "ParsedGpus",
    "nvidia_smi_snapshot",
    "parse_compute_apps",
    "parse_query_gpu",
]

GPU_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "compute_cap",
    "driver_version",
)
APPS_FIELDS = ("gpu_uuid", "pid", "used_memory")
_CSV = "--format=csv,noheader,nounits"
_UNAVAILABLE = frozenset({"[n/a]", "[not supported]", "n/a", ""})
_CAPABILITY = re.compile(r"(\d{1,2})\.(\d)")
_NO_PROCESSES = "no running processes found"


@dataclass(frozen=True, slots=True)
class ParsedGpus:
    """What one ``--query-gpu`` output says: readings, per-GPU failures, other messages."""

    readings: tuple[GpuReading, ...]
    failures: tuple[GpuFailure, ...]
    errors: tuple[str, ...]


class _FieldError(Exception):
    """A GPU line whose fields say the GPU could not be read."""


def _value(field: str, text: str) -> str | None:
    """A field's text; ``None`` when not available; :class:`_FieldError` for an error."""
    if text.lower() in _UNAVAILABLE:
        return None
    if text.startswith("[") and text.endswith("]"):
        raise _FieldError(f"{field}: {text}")
    return text


def _mb(field: str, text: str) -> int:
    value = _value(field, text)
    if value is None or not value.isdigit():
        raise _FieldError(f"{field} is {text or 'empty'}, not a number of MiB")
    return int(value)


def _arch(text: str) -> str:
    match = _CAPABILITY.fullmatch(text)
    return f"sm_{match.group(1)}{match.group(2)}" if match else ""


def _gpu_line(index: int, line: str) -> GpuReading:
    """One GPU line; fields are checked in column order, the first error fails the GPU."""
    raw = line.split(",")
    parts = [part.strip() for part in raw]
    uuid = _value("uuid", parts[1]) or ""
    name = _value("name", ",".join(raw[2:-4]).strip()) or ""
    total, used = _mb("memory.total", parts[-4]), _mb("memory.used", parts[-3])
    capability = _value("compute_cap", parts[-2]) or ""
    return GpuReading(
        index=index,
        total_mb=total,
        used_mb=used,
        uuid=uuid,
        model=name,
        vendor="nvidia",
        arch=_arch(capability),
        driver_version=_value("driver_version", parts[-1]) or "",
    )


def parse_query_gpu(text: str) -> ParsedGpus:
    """Parses ``nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader,nounits``."""
    readings: list[GpuReading] = []
    failures: list[GpuFailure] = []
    errors: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        parts = [part.strip() for part in line.split(",")]
        if len(parts) < len(GPU_FIELDS) or not parts[0].isdigit():
            errors.append(f"nvidia-smi: {line}")
            continue
        index = int(parts[0])
        try:
            readings.append(_gpu_line(index, line))
        except _FieldError as err:
            uuid = parts[1] if parts[1].startswith("GPU-") else ""
            failures.append(GpuFailure(index, f"nvidia-smi: {err}", uuid))
    return ParsedGpus(tuple(readings), tuple(failures), tuple(errors))


def parse_compute_apps(text: str) -> tuple[dict[str, dict[int, int | None]], tuple[str, ...]]:
    """Parses ``nvidia-smi --query-compute-apps=<APPS_FIELDS> --format=csv,noheader,nounits``.

    Returns GPU uuid -> {pid: used MiB, or ``None`` where nvidia-smi says ``[N/A]``}
    (a process listed twice on one GPU is summed), and the lines it could not read.
    """
    apps: dict[str, dict[int, int | None]] = {}
    errors: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.lower().startswith(_NO_PROCESSES):
            continue
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != len(APPS_FIELDS) or not parts[1].isdigit():
            errors.append(f"nvidia-smi compute-apps: {line}")
            continue
        uuid, pid, used = parts[0], int(parts[1]), parts[2]
        mb = int(used) if used.isdigit() else None
        on_gpu = apps.setdefault(uuid, {})
        before = on_gpu.get(pid, 0)
        on_gpu[pid] = None if mb is None or before is None else before + mb
    return apps, tuple(errors)


def nvidia_smi_snapshot(
    gpu_text: str,
    apps: Mapping[str, Mapping[int, int | None]] | None,
    *,
    known: KnownGpus | None = None,
    errors: Sequence[str] = (),
) -> ProbeSnapshot:
    """A snapshot from a ``--query-gpu`` output and parsed compute apps (``None``: the
    apps query failed, so processes are unknown)."""
    parsed = parse_query_gpu(gpu_text)
    readings = [
        replace(gpu, processes=None if apps is None else dict(apps.get(gpu.uuid, {})))
        for gpu in parsed.readings
    ]
    return (known or KnownGpus()).complete(
        "nvidia-smi", readings, parsed.failures, (*parsed.errors, *errors)
    )


class NvidiaSmiProbe:
    """Runs ``nvidia-smi`` twice per snapshot (GPUs, then compute apps)."""

    def __init__(self, binary: str = "nvidia-smi", *, timeout_s: float = 10.0) -> None:
        self._binary = binary
        self._timeout_s = timeout_s
        self._known = KnownGpus()
        self._lock = asyncio.Lock()

    @classmethod
    def open(cls, *, path: str | None = None, timeout_s: float = 10.0) -> NvidiaSmiProbe:
        """The probe for the ``nvidia-smi`` on ``path`` (default ``$PATH``)."""
        binary = find_tool("nvidia-smi", path)
        if binary is None:
            raise ProbeUnavailable("nvidia-smi: not found on PATH")
        return cls(binary, timeout_s=timeout_s)

    @property
    def name(self) -> str:
        return "nvidia-smi"

    async def snapshot(self) -> ProbeSnapshot:
        async with self._lock:
            try:
                gpus = await run_tool(
                    [self._binary, "--query-gpu=" + ",".join(GPU_FIELDS), _CSV], self._timeout_s
                )
            except ToolError as err:
                return self._known.broken(self.name, str(err))
            errors: list[str] = []
            if gpus.returncode != 0:
                errors.append(f"nvidia-smi exited with {gpus.status()}")
            apps, app_errors = await self._apps()
            return nvidia_smi_snapshot(
                gpus.stdout, apps, known=self._known, errors=(*errors, *app_errors)
            )

    async def _apps(self) -> tuple[dict[str, dict[int, int | None]] | None, tuple[str, ...]]:
        try:
            result = await run_tool(
                [self._binary, "--query-compute-apps=" + ",".join(APPS_FIELDS), _CSV],
                self._timeout_s,
            )
        except ToolError as err:
            return None, (str(err),)
        if result.returncode != 0:
            return None, (f"nvidia-smi --query-compute-apps exited with {result.status()}",)
        return parse_compute_apps(result.stdout)

    async def aclose(self) -> None:
        return None
