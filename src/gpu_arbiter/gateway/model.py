"""A model's replicas, and how a request gets a slot on one of them.

A request takes a slot on the accepting replica with the fewest requests in flight
below ``max_parallel``. When there is none, it waits (up to ``queue_timeout``); a new
replica (a new lease) is asked for when the requests waiting outnumber the slots of
the replicas already on their way, up to ``replicas``. A replica that failed (its
server exited, or was not ready in time) makes the model back off before it starts
another: 1 s, doubling per failure in a row up to 60 s, so that a broken server never
holds the GPU's load gate in a loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ..agent.supervisor import ProcessSupervisor
from ..client import ArbiterClient
from .config import ModelConfig
from .metrics import GatewayMetrics
from .replica import Replica

__all__ = ["ModelServer", "Refused"]

log = logging.getLogger("gpu_arbiter.gateway")
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
MEASURE_S = 2.0


class Refused(Exception):
    """No replica for the request: ``status`` (502, 503), ``reason``, ``retry_after_s``."""

    def __init__(self, status: int, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s


class ModelServer:
    def __init__(
        self,
        config: ModelConfig,
        *,
        client: ArbiterClient,
        supervisor: ProcessSupervisor,
        metrics: GatewayMetrics,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        worker: str | None,
        vram_mb: int,
    ) -> None:
        self.config = config
        self.name = config.name
        self.client = client
        self.supervisor = supervisor
        self.metrics = metrics
        self.spawn = spawn
        self.worker = worker
        self.vram_mb = vram_mb
        self.replicas: list[Replica] = []
        self.waiting = 0
        self.failures = 0
        self.failed_at = 0.0
        self.failure: str | None = None
        self._changed = asyncio.Event()
        self._numbers = 0

    # ------------------------------------------------------------------ requests

    async def acquire(self) -> tuple[Replica, float]:
        """A replica with a slot taken for the caller, and the seconds it queued.
        Raises :class:`Refused` (503 after ``queue_timeout``, 502 when its start failed)."""
        started = time.monotonic()
        deadline = started + self.config.queue_timeout_s
        failures_before = self.failures
        self.waiting += 1
        try:
            while True:
                replica = self._free_replica()
                if replica is not None:
                    if await replica.enter():
                        return replica, time.monotonic() - started
                    continue
                if self.failures > failures_before and not self._live():
                    raise Refused(502, f"model {self.name}: {self.failure}")
                self._refuse_while_backing_off()
                self._start_if_needed()
                changed = self._changed
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Refused(503, self._queue_timeout_reason(), self.config.queue_timeout_s)
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except TimeoutError:
                    continue
        finally:
            self.waiting -= 1
            if self.waiting == 0:
                for replica in self.replicas:
                    replica.cancel_if_queued()

    def _free_replica(self) -> Replica | None:
        best: Replica | None = None
        for replica in self.replicas:
            room = replica.accepting and replica.in_flight < self.config.max_parallel
            if room and (best is None or replica.in_flight < best.in_flight):
                best = replica
        return best

    def _live(self) -> list[Replica]:
        return [r for r in self.replicas if r.live and r.ending is None]

    def _refuse_while_backing_off(self) -> None:
        wait_s = self.backoff_left_s()
        if wait_s > 0 and not self._live():
            raise Refused(
                503, f"model {self.name}: {self.failure}; next start in {wait_s:.1f}s", wait_s
            )

    def backoff_left_s(self) -> float:
        if not self.failures:
            return 0.0
        backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** (self.failures - 1))
        return max(0.0, self.failed_at + backoff - time.monotonic())

    def _start_if_needed(self) -> None:
        holding = [r for r in self.replicas if r.live]  # a stopping one still holds memory
        coming = [r for r in self._live() if r.state in ("queued", "loading")]
        slots = len(coming) * self.config.max_parallel
        if self.waiting > slots and len(holding) < self.config.replicas:
            self._numbers += 1
            replica = Replica(self, self._numbers)
            self.replicas.append(replica)
            self.metrics.cold_starts.labels(self.name).inc()
            self.spawn(replica.run())

    def _queue_timeout_reason(self) -> str:
        queued = [r.pending_reason for r in self.replicas if r.state == "queued"]
        why = queued[0] if queued else self.state()
        return f"model {self.name} not ready after {self.config.queue_timeout_s:g}s: {why}"

    # ------------------------------------------------------------------ replicas

    def lease_request(self, number: int) -> dict[str, Any]:
        config = self.config
        host = socket.gethostname()[:100]
        return {
            "vram_mb": self.vram_mb,
            "gpus": config.gpus,
            "priority": config.priority,
            "preemptible": config.preemptible,
            "constraints": {"worker": self.worker} if self.worker else {},
            "holder": f"gateway {self.name} #{number}@{host}"[:256],
            "metadata": {"model": self.name, "replica": number, "gateway": host},
            "ttl_s": config.ttl_s,
            "load_timeout_s": config.load_timeout_s,
        }

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def loaded(self, replica: Replica, load_s: float) -> None:
        self.failures = 0
        self.metrics.load_seconds.labels(self.name).observe(load_s)
        log.info(
            "model %s replica %d: ready in %.1fs (lease %s)",
            self.name, replica.number, load_s, replica.lease.get("id"),
        )  # fmt: skip
        if self.config.vram is None:
            self.spawn(self._measure(replica))

    async def _measure(self, replica: Replica) -> None:
        """After a load, every ``MEASURE_S`` while the replica serves (and once more when
        it stops: see :meth:`measure`)."""
        while replica.live and replica.ending is None:
            await self.measure(replica)
            await asyncio.sleep(MEASURE_S)

    async def measure(self, replica: Replica) -> None:
        """The replica's memory as the agent's probe last saw it replaces the size asked
        for when it is higher (``vram = "auto"`` only: a given size is the user's)."""
        if self.config.vram is not None:
            return
        used = await replica.used_mb()
        if used is not None and used > self.vram_mb:
            log.info("model %s: measured %d MiB, above %d MiB", self.name, used, self.vram_mb)
            self.vram_mb = used

    def ended(self, replica: Replica) -> None:
        assert replica.ending is not None
        kind, reason = replica.ending.kind, replica.ending.reason
        if kind == "failed":
            self.failures += 1
            self.failed_at = time.monotonic()
            self.failure = reason
        if kind != "cancelled":
            self.metrics.stops.labels(self.name, kind).inc()
        log.info("model %s replica %d: stopped (%s: %s)", self.name, replica.number, kind, reason)
        self.replicas.remove(replica)
        self.notify()

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    # ------------------------------------------------------------------ state

    def state(self) -> str:
        """cold, queued, loading, warm, busy (or backoff): the most advanced replica's."""
        states = {r.state for r in self.replicas}
        for state in ("busy", "warm", "loading", "queued", "stopping"):
            if state in states:
                return state
        return "backoff" if self.backoff_left_s() > 0 else "cold"

    def describe(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "id": self.name,
            "object": "model",
            "owned_by": "gpu-arbiter",
            "state": self.state(),
            "aliases": list(self.config.aliases),
            "vram_mb": self.vram_mb,
            "replicas": [
                {
                    "state": r.state,
                    "in_flight": r.in_flight,
                    "lease": r.lease.get("id"),
                    "gpus": r.lease.get("gpus"),
                }
                for r in self.replicas
            ],
        }
        queued = [r.pending_reason for r in self.replicas if r.state == "queued"]
        if queued:
            found["pending_reason"] = queued[0]
        if self.failure and self.backoff_left_s() > 0:
            found["failure"] = self.failure
        return found
