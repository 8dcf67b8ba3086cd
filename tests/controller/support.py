"""Shared by the controller tests: a fake clock, a store that fails on demand, and
requests built as the server's route builds them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpu_arbiter.controller.leases import Leases
from gpu_arbiter.core import Constraints, Request
from gpu_arbiter.store import Batch, MemoryStore, Snapshot, StoreError


def request(
    vram_mb: int | str, constraints: Mapping[str, Any] | None = None, **fields: Any
) -> Request:
    """A new request for ``controller.leases.submit``, with a new lease id."""
    built = Constraints.build(**(constraints or {}))
    return Request.build(Leases.new_id(), vram_mb=vram_mb, constraints=built, **fields)


class Clock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FailingStore(MemoryStore):
    """A memory store that fails on demand: every commit while ``fail`` is set, the
    ``fail_at``-th commit only (counted in ``commits``), and every load while
    ``fail_loads`` is set. A failure raises ``error()`` (a :class:`StoreError` unless
    told otherwise: any exception, even a ``BaseException``); nothing of it is written."""

    fail = False
    fail_at: int | None = None
    fail_loads = False
    commits = 0

    def __init__(self, error: Callable[[], BaseException] | None = None) -> None:
        super().__init__()
        self.error = error or (lambda: StoreError("disk full"))

    def commit(self, batch: Batch) -> None:
        self.commits += 1
        if self.fail or self.commits == self.fail_at:
            raise self.error()
        super().commit(batch)

    def load(self) -> Snapshot:
        if self.fail_loads:
            raise StoreError("cannot read: the disk is gone")
        return super().load()
