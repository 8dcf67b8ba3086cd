"""Ended leases are kept for a while (``GET /v1/leases/{id}``, idempotent replays), then
forgotten: the store would otherwise grow with every lease, forever.

:func:`prune_ended` runs in the app's lifespan. While its controller leads, it forgets
the leases that ended more than ``retention_s`` ago, at start and then every quarter of
the retention (at least every second, at most every hour), a bounded batch at a time so
that the loop keeps answering. An idempotency key of a forgotten lease is forgotten with
it: the same key sent again makes a new request. The event history is bounded apart
(the store keeps the latest events only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from ..controller import Controller
from ..store import StoreError

__all__ = ["PRUNE_BATCH", "prune_ended", "prune_interval_s"]

log = logging.getLogger(__name__)

PRUNE_BATCH = 500
"""Leases forgotten in one step of the loop (one short transaction)."""


def prune_interval_s(retention_s: float) -> float:
    return min(max(retention_s / 4, 1.0), 3600.0)


async def prune_ended(
    controller: Controller,
    retention_s: float,
    stop: asyncio.Event,
    clock: Callable[[], float] = time.time,
) -> None:
    """Until ``stop``; ``retention_s`` 0 keeps ended leases forever."""
    if retention_s <= 0:
        return
    gate = controller.gate
    while not stop.is_set():
        if gate.started and not gate.standby and gate.broken is None:
            await _prune(controller, clock() - retention_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), prune_interval_s(retention_s))


async def _prune(controller: Controller, ended_before: float) -> None:
    removed = 0
    try:
        while True:
            batch = controller.store.prune(ended_before, PRUNE_BATCH)
            removed += batch
            if batch < PRUNE_BATCH:
                break
            await asyncio.sleep(0)  # requests go in between batches
    except StoreError as error:
        log.warning("cannot forget old leases now: %s", error)
    if removed:
        log.info("forgot %d leases that ended before the retention period", removed)
