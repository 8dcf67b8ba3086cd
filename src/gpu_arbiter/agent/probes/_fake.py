"""The fake probe: GPUs declared by a spec or a file, for machines without GPUs.

Its used memory is the sum of

- external usage per GPU (memory of processes the arbiter does not know about),
- processes attached through :meth:`FakeProbe.attach` (by the agent that started them),
- processes reporting their own usage in a *usage directory*: a child process writes
  ``<pid>.json`` holding ``{"<gpu index>": MiB}`` (:func:`report_usage` does it
  atomically, finding the directory in the environment that
  :meth:`FakeProbe.child_env` gives), so memory appears while it "loads" and grows
  as it reports again. GPU indices are the probe's own (not renumbered by
  ``CUDA_VISIBLE_DEVICES``).

Memory of a process vanishes by itself once the process has exited (a zombie counts
as exited, as the driver frees GPU memory before the parent reaps the child).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import threading
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.errors import InvalidInput
from ...core.units import parse_mb
from ._snapshot import GpuFailure, GpuReading, KnownGpus, ProbeSnapshot

__all__ = [
    "FAKE_USAGE_DIR_ENV",
    "FakeGpu",
    "FakeProbe",
    "load_fake_file",
    "parse_fake_spec",
    "process_alive",
    "report_usage",
]

FAKE_USAGE_DIR_ENV = "GPU_ARBITER_FAKE_USAGE_DIR"
"""The environment variable through which an agent may tell its children the usage dir."""

_GROUP = re.compile(r"^(?:(\d+)\s*[xX]\s*)?(\S+)$")
_ARCH = re.compile(r"^(sm_\d{2,3}|gfx[0-9a-f]{3,4})$")
_CAPABILITY = re.compile(r"^(\d{1,2})\.(\d)$")
_MAX_GPUS = 64
_FILE_KEYS = frozenset({"count", "total", "arch", "model", "vendor", "external"})


@dataclass(frozen=True, slots=True)
class FakeGpu:
    """One declared GPU."""

    index: int
    total_mb: int
    arch: str = ""
    model: str = "Simulated GPU"
    vendor: str = "nvidia"
    external_mb: int = 0

    @property
    def uuid(self) -> str:
        return f"GPU-fake-{self.index:04d}"


def _arch(text: str, where: str) -> str:
    text = text.strip().lower()
    capability = _CAPABILITY.match(text)
    if capability:
        return f"sm_{capability.group(1)}{capability.group(2)}"
    if text and not _ARCH.match(text):
        raise InvalidInput(where, f"arch {text!r} is not like sm_86, gfx1100 or 8.6")
    return text


def _size(value: str | int, where: str) -> int:
    try:
        mb = parse_mb(value, where)
    except InvalidInput as err:
        raise InvalidInput(where, f"{value!r} is not a size such as 24G or 24576 (MiB)") from err
    if mb <= 0:
        raise InvalidInput(where, "a GPU needs more than 0 MiB")
    return mb


def _declare(
    gpus: list[FakeGpu],
    where: str,
    count: int,
    total_mb: int,
    arch: str,
    *,
    model: str = "",
    vendor: str = "",
    external_mb: int = 0,
) -> None:
    if count < 1 or len(gpus) + count > _MAX_GPUS:
        raise InvalidInput(where, f"declare 1 to {_MAX_GPUS} GPUs in all")
    if external_mb > total_mb:
        raise InvalidInput(where, "external usage is larger than the GPU")
    vendor = vendor.strip().lower() or ("amd" if arch.startswith("gfx") else "nvidia")
    model = model.strip() or "Simulated GPU"
    for _ in range(count):
        gpus.append(FakeGpu(len(gpus), total_mb, arch, model, vendor, external_mb))


def parse_fake_spec(spec: str) -> tuple[FakeGpu, ...]:
    """``N x SIZE[:ARCH[:MODEL]]`` groups separated by commas, such as
    ``2x24G:sm_86`` or ``1x80G:sm_90:H100,1x24G:gfx1100``. ``N x`` may be left out (1).
    Raises :class:`InvalidInput` (field ``simulate``) naming the faulty group."""
    gpus: list[FakeGpu] = []
    if not spec.strip():
        raise InvalidInput("simulate", "empty spec; write N x SIZE[:ARCH[:MODEL]] such as 2x24G")
    for group in spec.split(","):
        head, _, rest = group.strip().partition(":")
        arch_text, _, model = rest.partition(":")
        match = _GROUP.match(head)
        where = f"simulate {group.strip()!r}"
        if match is None:
            raise InvalidInput(where, "not N x SIZE[:ARCH[:MODEL]] such as 2x24G:sm_86")
        count = int(match.group(1) or 1)
        size = _size(match.group(2), where)
        _declare(gpus, where, count, size, _arch(arch_text, where), model=model)
    return tuple(gpus)


def load_fake_file(path: str | Path) -> tuple[FakeGpu, ...]:
    """GPUs from a ``.toml`` or ``.json`` file holding a list ``gpus`` of tables with
    ``total`` (required), ``count``, ``arch``, ``model``, ``vendor``, ``external``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except OSError as err:
        raise InvalidInput(str(path), f"cannot read: {err.strerror or err}") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise InvalidInput(str(path), f"not valid {kind}: {err}") from None
    entries = data.get("gpus") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InvalidInput(str(path), "needs a non-empty list 'gpus'")
    gpus: list[FakeGpu] = []
    for number, entry in enumerate(entries):
        _declare_entry(gpus, entry, f"{path}: gpus[{number}]")
    return tuple(gpus)


def _declare_entry(gpus: list[FakeGpu], entry: Any, where: str) -> None:
    if not isinstance(entry, dict):
        raise InvalidInput(where, "must be a table")
    unknown = sorted(set(entry) - _FILE_KEYS)
    if unknown:
        known = ", ".join(sorted(_FILE_KEYS))
        raise InvalidInput(where, f"unknown key {unknown[0]!r}; known: {known}")
    if "total" not in entry:
        raise InvalidInput(where, "needs 'total', such as \"24G\"")
    count = entry.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidInput(where, "'count' must be an integer >= 1")
    _declare(
        gpus,
        where,
        count,
        _size(entry["total"], where),
        _arch(str(entry.get("arch", "")), where),
        model=str(entry.get("model", "")),
        vendor=str(entry.get("vendor", "")),
        external_mb=_size(entry["external"], where) if entry.get("external") else 0,
    )


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (an exited, unreaped zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            data = stat.read()
    except FileNotFoundError:
        return not os.path.isdir("/proc/self") and _signal_alive(pid)
    except OSError:
        return _signal_alive(pid)
    state = data[data.rfind(b")") + 2 :][:1]
    return state not in (b"Z", b"X")


def _signal_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def report_usage(
    used_mb: Mapping[int, int], *, usage_dir: str | Path | None = None, pid: int | None = None
) -> None:
    """Declares, from a process, its MiB per GPU index to a fake probe's usage dir
    (default: ``$GPU_ARBITER_FAKE_USAGE_DIR``, see :meth:`FakeProbe.child_env`). Each
    call replaces the previous report atomically; an empty mapping withdraws it."""
    directory = usage_dir if usage_dir is not None else os.environ.get(FAKE_USAGE_DIR_ENV)
    if not directory:
        raise InvalidInput(FAKE_USAGE_DIR_ENV, "is not set: there is no fake probe to report to")
    target = Path(directory) / f"{os.getpid() if pid is None else pid}.json"
    if not used_mb:
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
        return
    partial = target.with_suffix(".tmp")
    partial.write_text(json.dumps({str(gpu): int(mb) for gpu, mb in used_mb.items()}))
    os.replace(partial, target)


class FakeProbe:
    """GPUs declared in advance whose memory follows attached and reporting processes."""

    def __init__(
        self,
        gpus: Sequence[FakeGpu],
        *,
        label: str = "fake",
        usage_dir: str | Path | None = None,
        pid_alive: Callable[[int], bool] = process_alive,
        driver_version: str = "fake",
    ) -> None:
        if not gpus:
            raise InvalidInput("simulate", "declare at least one GPU")
        self._gpus = {gpu.index: gpu for gpu in gpus}
        self._label = label
        self._usage_dir = None if usage_dir is None else Path(usage_dir)
        self._pid_alive = pid_alive
        self._driver_version = driver_version
        self._external = {gpu.index: gpu.external_mb for gpu in gpus}
        self._attached: dict[int, dict[int, int]] = {}
        self._failed: dict[int, str] = {}
        self._state = threading.Lock()
        self._lock = asyncio.Lock()
        self._known = KnownGpus()

    @classmethod
    def from_spec(cls, spec: str, **options: Any) -> FakeProbe:
        """``FakeProbe.from_spec("2x24G:sm_86")``; see :func:`parse_fake_spec`."""
        return cls(parse_fake_spec(spec), label=f"fake:{spec.strip()}", **options)

    @classmethod
    def from_file(cls, path: str | Path, **options: Any) -> FakeProbe:
        return cls(load_fake_file(path), label=f"fake:{path}", **options)

    @property
    def name(self) -> str:
        return self._label

    @property
    def gpus(self) -> tuple[FakeGpu, ...]:
        return tuple(self._gpus.values())

    @property
    def usage_dir(self) -> Path | None:
        return self._usage_dir

    def child_env(self) -> dict[str, str]:
        """Environment for a child process so that :func:`report_usage` reaches this probe."""
        return {} if self._usage_dir is None else {FAKE_USAGE_DIR_ENV: str(self._usage_dir)}

    def _check_gpu(self, gpu_index: int) -> None:
        if gpu_index not in self._gpus:
            raise InvalidInput("gpu_index", f"no fake GPU {gpu_index}; have {sorted(self._gpus)}")

    def attach(self, pid: int, gpu_index: int, used_mb: int) -> None:
        """Process ``pid`` now uses ``used_mb`` on that GPU (replacing what it used there)."""
        self._check_gpu(gpu_index)
        if pid <= 0 or used_mb < 0:
            raise InvalidInput("attach", "pid must be > 0 and used_mb >= 0")
        with self._state:
            self._attached.setdefault(pid, {})[gpu_index] = used_mb

    def detach(self, pid: int) -> None:
        """Process ``pid`` no longer uses any GPU memory. Idempotent."""
        with self._state:
            self._attached.pop(pid, None)

    def set_external(self, gpu_index: int, used_mb: int) -> None:
        """Memory used on that GPU by processes the arbiter does not know of."""
        self._check_gpu(gpu_index)
        if used_mb < 0:
            raise InvalidInput("used_mb", "must be >= 0")
        with self._state:
            self._external[gpu_index] = used_mb

    def fail(self, gpu_index: int, error: str = "injected failure") -> None:
        """Reads of that GPU fail (it is reported stale) until :meth:`recover`."""
        self._check_gpu(gpu_index)
        with self._state:
            self._failed[gpu_index] = error

    def recover(self, gpu_index: int) -> None:
        with self._state:
            self._failed.pop(gpu_index, None)

    async def snapshot(self) -> ProbeSnapshot:
        async with self._lock:
            return await asyncio.to_thread(self._read)

    async def aclose(self) -> None:
        return None

    def _read(self) -> ProbeSnapshot:
        """Runs in a worker thread. Liveness is checked outside the state lock, so a slow
        check never holds up :meth:`attach` on the event loop's thread."""
        reported, errors = self._read_usage_dir()
        with self._state:
            attached = {pid: dict(by_gpu) for pid, by_gpu in self._attached.items()}
        dead = [pid for pid in attached if not self._pid_alive(pid)]
        with self._state:
            for pid in dead:
                self._attached.pop(pid, None)
                del attached[pid]
            external, failed = dict(self._external), dict(self._failed)
        per_gpu: dict[int, dict[int, int]] = {index: {} for index in self._gpus}
        for usage in (attached, reported):
            for pid, by_gpu in usage.items():
                for index, mb in by_gpu.items():
                    if index in per_gpu:
                        per_gpu[index][pid] = per_gpu[index].get(pid, 0) + mb
        readings = [
            self._reading(gpu, external[gpu.index], per_gpu[gpu.index])
            for gpu in self._gpus.values()
            if gpu.index not in failed
        ]
        failures = [
            GpuFailure(index, f"fake: {error}", self._gpus[index].uuid)
            for index, error in failed.items()
        ]
        return self._known.complete(self.name, readings, failures, errors)

    def _reading(self, gpu: FakeGpu, external_mb: int, processes: dict[int, int]) -> GpuReading:
        return GpuReading(
            index=gpu.index,
            total_mb=gpu.total_mb,
            used_mb=external_mb + sum(processes.values()),
            uuid=gpu.uuid,
            model=gpu.model,
            vendor=gpu.vendor,
            arch=gpu.arch,
            driver_version=self._driver_version,
            processes=dict(processes),
        )

    def _read_usage_dir(self) -> tuple[dict[int, dict[int, int]], list[str]]:
        """Reports of live processes; a dead process's report is deleted."""
        reported: dict[int, dict[int, int]] = {}
        errors: list[str] = []
        if self._usage_dir is None:
            return reported, errors
        for path in sorted(self._usage_dir.glob("*.json")):
            if not path.stem.isdigit():
                continue
            pid = int(path.stem)
            if not self._pid_alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                reported[pid] = {int(gpu): int(mb) for gpu, mb in data.items()}
            except FileNotFoundError:
                continue
            except (OSError, ValueError, AttributeError, TypeError) as err:
                errors.append(f"fake: cannot read usage report {path.name}: {err}")
        return reported, errors
