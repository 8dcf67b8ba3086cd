"""The asleep tier of a replica: between warm and stopped, for engines that sleep.

::

    warm --idle sleep_after--> asleep --a request waits--> waking --granted, woken--> warm
      ^                         |  ^                           |
      +---- the server did -----+  +--- nobody waits any more -+
            not sleep

    asleep, waking --keep_alive, revoked, reclaimed, the server exited...--> stopping

Asleep, the engine has given its memory back while its process and port stay; the lease
shrinks to what the probe shows the process still holds once that figure stops falling
(never below it: I2 keeps the rest counted until the probe shows it free, I4). Waking
asks for the difference again: a second lease (``extra``) on the very GPUs the process
lives on, through the queue and the load gate like any load, then wakes the engine (no
cold start). Asleep again, that second lease is released and the first shrinks again.

The tier belongs to one replica (what it uses of it: :class:`~.interfaces.Sleeper`) and
runs inside its keep-warm task: it has no task of its own but the watcher of the second
lease, in the replica's group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ...client import ApiError, ControllerUnreachable
from ..base.clock import sleep_or
from .engines import SleepKind, settled_mb
from .interfaces import Sleeper
from .lease import Lease
from .states import ReplicaState

__all__ = ["SleepTier"]

log = logging.getLogger("gpu_arbiter.gateway")
SLEEP_CHECKS = 20  # an engine that sleeps by itself is asked this often whether it does,
SLEEP_CHECK_S = 0.25  # this far apart
FALLS_MIN_MB = 64  # a figure below this has nothing to fall from while the server sleeps


class SleepTier:
    def __init__(self, replica: Sleeper) -> None:
        self.replica = replica
        self.extra: Lease | None = None  # awake after a sleep: the lease of what it took back
        self.extra_watch: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()  # a request waits for this sleeping replica

    def sleep_at(self, since: float) -> float | None:
        """When a replica quiet since ``since`` falls asleep (None: its engine does not
        sleep, or it is asleep already)."""
        after = self.replica.model.driver.sleep_after_s
        return None if after is None or self.replica.asleep else since + after

    async def fall_asleep(self, arrivals: int) -> None:
        """Idle ``sleep_after``: the engine gives its memory back, the process stays. What
        it keeps is measured by the probe once its figure stops falling; the lease
        shrinks to that (never below what the probe shows: I2 keeps the rest counted
        until it is free) and the lease of what a wake took back is released."""
        r = self.replica
        if r.arrivals != arrivals or r.in_flight or r.ending is not None:
            return
        before = await r.used_mb()
        r.move(ReplicaState.ASLEEP)
        if not await self._engine_sleeps():
            log.info("model %s replica %d: the server did not sleep", r.model.name, r.number)
            r.move(ReplicaState.WARM)
            return
        kept = await self._kept_mb(before)
        await self.drop_extra()
        held = r.holding.vram_mb
        if kept is not None and kept < held:
            with contextlib.suppress(ApiError, ControllerUnreachable):
                r.lease = Lease.of(await r.parts.leases.shrink(r.holding.id, max(1, kept)))
        r.model.metrics.sleeps.labels(r.model.name).inc()
        log.info(
            "model %s replica %d: asleep, its lease %d MiB (it kept %s MiB)",
            r.model.name, r.number, r.holding.vram_mb, kept,
        )  # fmt: skip

    async def _kept_mb(self, before: int | None) -> int | None:
        """What the sleeping server keeps, once the probe's figure stopped falling; None
        when the probe cannot say, or a request wants it awake before it is measured (its
        lease then keeps its size: nothing was shown free)."""
        r = self.replica
        falls_from = before if before is not None and before > FALLS_MIN_MB else None
        measuring = asyncio.ensure_future(
            settled_mb(r.used_mb, r.parts.clock, falls_from=falls_from)
        )
        if await sleep_or(measuring, self.wake) or not measuring.done():
            measuring.cancel()
            return None
        return measuring.result()

    async def _engine_sleeps(self) -> bool:
        """Asks the engine to sleep; one that sleeps by itself (llama.cpp, after the
        same idle time) is asked whether it does, for a few seconds."""
        r = self.replica
        driver, clock = r.model.driver, r.parts.clock
        if driver.sleeps is not SleepKind.ITSELF:
            return await driver.sleep(r.port)
        for _ in range(SLEEP_CHECKS):
            if await driver.is_sleeping(r.port) is True:
                return True
            if await sleep_or(clock.sleep(SLEEP_CHECK_S), r.ended):
                return False
        return False

    async def wake_up(self) -> str | None:
        """A request waits: the memory given back is asked for again (a lease of the
        difference on the very GPUs the process lives on, through the queue and the load
        gate like any load), then the engine wakes. Given up when nobody waits any more.
        Returns why the server failed to wake (the replica then stops), else None."""
        r = self.replica
        self.wake.clear()
        if not r.asleep:
            return None
        started = r.parts.clock.now()
        r.move(ReplicaState.WAKING)
        need = r.model.vram_mb - r.holding.vram_mb
        if need > 0:
            # no longer a cache while it wakes: the arbiter must not reclaim what it kept
            # to make room for its own wake (no other replica of it starts meanwhile)
            await r.mark_busy()
            if not await self._take_back(need):
                if r.ending is None:
                    r.move(ReplicaState.ASLEEP)
                    await r.mark_idle(r.arrivals)  # a cache again
                return None
        if not await r.model.driver.wake(r.port):
            return f"the server did not wake{r.tail()}"
        if self.extra is not None:
            with contextlib.suppress(ApiError, ControllerUnreachable):
                self.extra = Lease.of(await r.parts.leases.ready(self.extra.id))
        woke_s = r.parts.clock.now() - started
        r.model.metrics.wakes.labels(r.model.name).inc()
        r.model.metrics.wake_seconds.labels(r.model.name).observe(woke_s)
        log.info("model %s replica %d: awake in %.2fs", r.model.name, r.number, woke_s)
        r.quiet_since = r.parts.clock.now()
        r.move(ReplicaState.WARM)
        return None

    async def _take_back(self, need_mb: int) -> bool:
        """A granted lease of ``need_mb`` on the replica's GPUs (False: not granted, or
        nobody waits for it any more; a pending one is then released). It names the
        sleeping lease as one never to preempt: a caller above that lease's priority would
        otherwise have the arbiter revoke the very process it wakes."""
        r = self.replica
        asked = r.model.lease_request(r.number)
        request = {
            **asked, "vram_mb": need_mb, "holder": f"{asked['holder']} wake"[:256],
            "constraints": {"gpu_ids": list(r.holding.gpus), "never_preempt": [r.holding.id]},
        }  # fmt: skip
        try:
            extra = self.extra = Lease.of(await r.parts.leases.create_lease(**request))
        except (ApiError, ControllerUnreachable) as error:
            log.info("model %s: the wake's lease was refused: %s", r.model.name, error)
            return False
        while extra.pending and r.ending is None:
            if not r.model.waiting:
                break
            r.pending_reason = extra.pending_text()
            waiting = asyncio.ensure_future(
                r.parts.leases.lease(extra.id, wait_s=30.0, state="pending")
            )
            r.activity.clear()
            if await sleep_or(waiting, r.activity):
                waiting.cancel()
                continue
            with contextlib.suppress(ControllerUnreachable):
                extra = self.extra = Lease.of(waiting.result())
        if extra.held and r.ending is None:
            assert r.group is not None
            self.extra_watch = r.group.create_task(r.watch(extra=True))
            return True
        await self.drop_extra()
        return False

    async def drop_extra(self) -> None:
        """Releases the lease a wake took back (its watcher first: the release is ours)."""
        if self.extra_watch is not None:
            self.extra_watch.cancel()
            self.extra_watch = None
        if self.extra is not None:
            await self.replica.release(self.extra.id)
        self.extra = None
