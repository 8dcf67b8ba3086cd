"""Shared by the controller tests: a fake clock and a store that fails on demand."""

from __future__ import annotations

from collections.abc import Callable

from gpu_arbiter.store import Batch, MemoryStore, Snapshot, StoreError


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
