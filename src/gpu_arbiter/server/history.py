"""The last hour of every GPU's memory and of the queue, kept in the controller's memory.

Every ``sample_s`` seconds (default 10) one sample records, per GPU, the memory
committed to its held leases, the memory its probe saw in use, and the busy memory
(held leases not marked idle); and the pending requests per priority class. The last
:data:`SAMPLES` samples (360: an hour at the default rate) are kept in fixed rings of
64-bit integers, for at most ``max_gpus`` GPUs (default :data:`MAX_GPUS`): 360 x 3 x 8
bytes, about 8.4 KiB per GPU, 8.4 MiB for 1024. GPUs beyond the cap are counted
(``gpus_left_out``), not kept; a GPU absent for a whole window is forgotten. Nothing is
written to the store: a restarted controller starts an empty history.

Readers poll ``GET /v1/history?since=T`` at the sample rate and get the samples after
``T``: a sample is a reading, not a change of state, so it has no place in the event
history (persisted, bounded, replayed on resume) that ``/v1/events`` streams. Costs, at
the cap (1024 GPUs): a sample about 2 ms; a whole read about 7.5 MiB of JSON, 0.2 s
(once, when a dashboard opens); a read with ``since`` of one new sample about 3 ms.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..controller import Controller
from ..core import PRIORITY_NAMES

__all__ = ["MAX_GPUS", "PRIORITY_CLASSES", "SAMPLES", "GpuSample", "History", "priority_class"]

log = logging.getLogger(__name__)

SAMPLES = 360
"""Samples kept per GPU: an hour at the default rate of one every 10 s."""
MAX_GPUS = 1024
"""GPUs whose history is kept, at most (the design's target is 1,000 GPUs)."""
SAMPLE_S = 10.0
MISSING = -1
PRIORITY_CLASSES = tuple(sorted(PRIORITY_NAMES, key=PRIORITY_NAMES.__getitem__, reverse=True))
"""critical, interactive, normal, background, batch."""


def priority_class(priority: int) -> str:
    """The named class a priority falls in: the highest name at or below it (650 ->
    ``normal``; below ``batch``, ``batch``)."""
    for name in PRIORITY_CLASSES:
        if priority >= PRIORITY_NAMES[name]:
            return name
    return PRIORITY_CLASSES[-1]


@dataclass(frozen=True, slots=True)
class GpuSample:
    id: str
    total_mb: int
    committed_mb: int
    used_mb: int | None
    busy_mb: int


class _Series:
    """One GPU's rings, one slot per sample."""

    __slots__ = ("busy", "committed", "last_seen", "total_mb", "used")

    def __init__(self, size: int) -> None:
        self.total_mb = 0
        self.last_seen = 0
        self.committed = array("q", [MISSING]) * size
        self.used = array("q", [MISSING]) * size
        self.busy = array("q", [MISSING]) * size

    def put(self, slot: int, sample: GpuSample | None) -> None:
        if sample is None:
            self.committed[slot] = self.used[slot] = self.busy[slot] = MISSING
            return
        self.total_mb = sample.total_mb
        self.committed[slot] = sample.committed_mb
        self.used[slot] = MISSING if sample.used_mb is None else sample.used_mb
        self.busy[slot] = sample.busy_mb


def _values(ring: array[int], window: slice, oldest: int) -> list[int] | list[int | None]:
    """The ring's values, oldest first (from slot ``oldest`` round), in ``window``."""
    values = (ring[oldest:] + ring[:oldest])[window].tolist()
    if MISSING not in values:  # the usual case: no loop in Python
        return values
    return [None if v == MISSING else v for v in values]


class History:
    """The rings, and the sampler that fills them (:meth:`run`, in the app's lifespan)."""

    def __init__(
        self,
        *,
        sample_s: float = SAMPLE_S,
        samples: int = SAMPLES,
        max_gpus: int = MAX_GPUS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if sample_s <= 0 or samples < 1 or max_gpus < 0:
            raise ValueError("sample_s must be positive, samples and max_gpus at least 1 and 0")
        self.sample_s = float(sample_s)
        self.samples = samples
        self.max_gpus = max_gpus
        self._clock = clock
        self._count = 0  # samples recorded so far; the next goes to slot count % samples
        self._times = array("d", [0.0]) * samples
        self._gpus: dict[str, _Series] = {}
        self._queue = {name: array("q", [0]) * samples for name in PRIORITY_CLASSES}
        self._left_out = 0

    # ---------------------------------------------------------------- writing

    def record(self, gpus: Iterable[GpuSample], queue: Mapping[str, int]) -> None:
        """One sample, taken now: ``queue`` is the pending count per priority class."""
        slot = self._count % self.samples
        self._times[slot] = self._clock()
        seen: dict[str, GpuSample] = {}
        left_out = 0
        for sample in gpus:
            if sample.id in self._gpus or len(self._gpus) < self.max_gpus:
                series = self._gpus.setdefault(sample.id, _Series(self.samples))
                series.last_seen = self._count
                seen[sample.id] = sample
            else:
                left_out += 1
        for gpu_id, series in list(self._gpus.items()):
            if self._count - series.last_seen >= self.samples:
                del self._gpus[gpu_id]  # absent for a whole window
            else:
                series.put(slot, seen.get(gpu_id))
        for name, ring in self._queue.items():
            ring[slot] = queue.get(name, 0)
        self._left_out = left_out
        self._count += 1

    def sample(self, controller: Controller) -> None:
        """Records what ``controller`` holds now."""
        gpus: list[GpuSample] = []
        for worker in controller.workers.all():
            busy: Counter[str] = Counter()
            for lease in controller.workers.leases_on(worker.name):
                if not lease.idle:
                    for gpu in lease.gpus:
                        busy[str(gpu)] += lease.vram_mb
            for figures in controller.workers.gpu_figures(worker.name):
                gpu_id = str(figures.gpu.id)
                gpus.append(
                    GpuSample(
                        gpu_id,
                        figures.gpu.total_mb,
                        figures.committed_mb,
                        figures.used_mb,
                        busy[gpu_id],
                    )
                )
        queue: Counter[str] = Counter()
        for priority, count in controller.status()["pending_by_priority"].items():
            queue[priority_class(int(priority))] += count
        self.record(gpus, queue)

    async def run(self, controller: Controller, stop: asyncio.Event) -> None:
        """Samples ``controller`` now and every :attr:`sample_s` until ``stop`` (in the app's
        lifespan)."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while not stop.is_set():
            try:
                self.sample(controller)
            except Exception:  # a bug here must not end the history, nor the server
                log.exception("the history sample failed; the next one is in %gs", self.sample_s)
            due = max(due + self.sample_s, loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), due - loop.time())

    # ---------------------------------------------------------------- reading

    def read(self, since: float | None = None) -> dict[str, Any]:
        """The kept samples taken after ``since`` (all without it), oldest first, as JSON:
        ``times``, and per GPU and per priority class one value per time (``null``: the
        GPU was not there, or its probe saw nothing)."""
        oldest = self._count % self.samples if self._count > self.samples else 0
        times = (self._times[oldest:] + self._times[:oldest]).tolist()
        kept = min(self._count, self.samples)
        first = 0 if since is None else bisect.bisect_right(times, since, 0, kept)
        window = slice(first, kept)
        return {
            "sample_s": self.sample_s,
            "samples": self.samples,
            "max_gpus": self.max_gpus,
            "gpus_left_out": self._left_out,
            "times": times[window],
            "gpus": [
                {
                    "id": gpu_id,
                    "total_mb": series.total_mb,
                    "committed_mb": _values(series.committed, window, oldest),
                    "used_mb": _values(series.used, window, oldest),
                    "busy_mb": _values(series.busy, window, oldest),
                }
                for gpu_id, series in sorted(self._gpus.items())
            ],
            "queue": {
                name: (ring[oldest:] + ring[:oldest])[window].tolist()
                for name, ring in self._queue.items()
            },
        }
