"""Simulated clusters, written as a short spec.

Syntax (sizes as everywhere: ``24G``, ``80G``, ``16384``)::

    GROUP[+GROUP...]
    GROUP  = [Ww:]NxSIZE[@ARCH]      W workers (default 1), each with N GPUs of SIZE

    1x24G                     one worker with one 24 GiB GPU
    4w:2x24G                  four workers with two 24 GiB GPUs each
    2w:1x24G+2w:2x24G         two workers with one GPU and two with two
    2w:8x80G@sm_90            two workers with eight 80 GiB GPUs (architecture sm_90)

Named presets: ``single`` (``1x24G``), ``medium`` (``2w:1x24G+2w:2x24G``: four
workers with 1-2 x 24 GiB) and ``large`` (``2w:8x80G``). The architecture
defaults to ``sm_89`` up to 48 GiB and ``sm_90`` above. Workers are named
``w1``, ``w2`` ... in order; GPUs are declared by hand (no headroom, no probe).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..core import Gpu, GpuId, InvalidInput, Worker, parse_mb

__all__ = ["PRESETS", "Cluster", "parse_cluster"]

PRESETS = {
    "single": "1x24G",
    "medium": "2w:1x24G+2w:2x24G",
    "large": "2w:8x80G",
}
_GROUP = re.compile(r"^(?:(\d+)w:)?(\d+)x([0-9.]+[a-zA-Z]*)(?:@([a-z0-9_]+))?$")
_MAX_GPUS = 4096


@dataclass(frozen=True, slots=True)
class Cluster:
    spec: str
    workers: tuple[tuple[Worker, tuple[Gpu, ...]], ...]

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return tuple(gpu for _, gpus in self.workers for gpu in gpus)

    def capacity_mb(self) -> dict[GpuId, int]:
        return {gpu.id: gpu.capacity_mb for gpu in self.gpus}

    @property
    def total_mb(self) -> int:
        return sum(gpu.capacity_mb for gpu in self.gpus)

    @property
    def largest_gpu_mb(self) -> int:
        return max(gpu.capacity_mb for gpu in self.gpus)

    @property
    def most_gpus_per_worker(self) -> int:
        return max(len(gpus) for _, gpus in self.workers)


def parse_cluster(spec: str) -> Cluster:
    """A preset name or a spec (see the module docstring); errors name ``cluster``."""
    text = PRESETS.get(spec.strip().lower(), spec.strip())
    workers: list[tuple[Worker, tuple[Gpu, ...]]] = []
    for group in text.split("+"):
        match = _GROUP.match(group.strip())
        if match is None:
            names = ", ".join(PRESETS)
            raise InvalidInput(
                "cluster",
                f"{group!r} is not [Ww:]NxSIZE[@ARCH] such as 4w:2x24G (or one of {names})",
            )
        count = int(match.group(1) or 1)
        per_worker = int(match.group(2))
        size_mb = parse_mb(match.group(3), "cluster")
        if count < 1 or per_worker < 1 or size_mb < 1:
            raise InvalidInput("cluster", f"{group!r}: counts and sizes must be >= 1")
        arch = match.group(4) or ("sm_89" if size_mb <= 48 * 1024 else "sm_90")
        for _ in range(count):
            name = f"w{len(workers) + 1}"
            gpus = tuple(
                Gpu(index=i, total_mb=size_mb, arch=arch, worker=name, model=f"sim-{size_mb}")
                for i in range(per_worker)
            )
            workers.append((Worker(name), gpus))
            if sum(len(g) for _, g in workers) > _MAX_GPUS:
                raise InvalidInput("cluster", f"at most {_MAX_GPUS} GPUs")
    return Cluster(spec=text, workers=tuple(workers))
