"""Choosing a probe: by name, or by detecting what this host has."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ...core.errors import InvalidInput
from ._fake import FakeProbe
from ._nvidia_smi import NvidiaSmiProbe
from ._nvml import NvmlProbe
from ._rocm_smi import RocmSmiProbe
from ._snapshot import Probe, ProbeUnavailable

__all__ = ["PROBE_NAMES", "detect", "open_probe"]

PROBE_NAMES = ("nvml", "nvidia-smi", "rocm-smi", "fake:SPEC")
_log = logging.getLogger(__name__)


async def open_probe(name: str, *, nvml: Any = None, path: str | None = None) -> Probe:
    """The probe called ``name``: ``nvml``, ``nvidia-smi``, ``rocm-smi``, or ``fake:SPEC``
    (SPEC as for ``--simulate``, or a path ending in ``.toml``/``.json``).

    Raises :class:`ProbeUnavailable` when it cannot run here, and
    :class:`~gpu_arbiter.core.errors.InvalidInput` for an unknown name or a bad spec.
    """
    if name == "nvml":
        return await NvmlProbe.open(nvml)
    if name == "nvidia-smi":
        return NvidiaSmiProbe.open(path=path)
    if name == "rocm-smi":
        return RocmSmiProbe.open(path=path)
    if name.startswith("fake:"):
        spec = name.removeprefix("fake:")
        if spec.endswith((".toml", ".json")):
            return FakeProbe.from_file(spec)
        return FakeProbe.from_spec(spec)
    raise InvalidInput("probe", f"{name!r} is not one of {', '.join(PROBE_NAMES)}")


async def detect(
    *, nvml: Any = None, path: str | None = None, skipped: list[str] | None = None
) -> Probe | None:
    """The first probe that works here and sees a GPU: NVML, then ``nvidia-smi`` on
    ``path`` (default ``$PATH``), then ``rocm-smi``; ``None`` when none does (the caller
    then runs on the fake probe and says so). Why each was passed over is appended to
    ``skipped`` and logged."""
    candidates: list[tuple[str, Callable[[], Awaitable[Probe]]]] = [
        ("nvml", lambda: NvmlProbe.open(nvml)),
        ("nvidia-smi", lambda: _ready(NvidiaSmiProbe.open(path=path))),
        ("rocm-smi", lambda: _ready(RocmSmiProbe.open(path=path))),
    ]
    for name, opener in candidates:
        try:
            probe = await opener()
        except ProbeUnavailable as err:
            _skip(skipped, str(err))
            continue
        snapshot = await probe.snapshot()
        if snapshot.gpus or snapshot.failures:
            return probe
        await probe.aclose()
        _skip(skipped, f"{name}: no GPU found" + "".join(f"; {e}" for e in snapshot.errors))
    return None


async def _ready(probe: Probe) -> Probe:
    return probe


def _skip(skipped: list[str] | None, reason: str) -> None:
    _log.info("probe skipped: %s", reason)
    if skipped is not None:
        skipped.append(reason)
