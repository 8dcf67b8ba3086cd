"""A gateway's follower of the cluster's catalogue: each new revision the controller
stores, read and cut to the share its worker may run.

::

    loop:  GET /v1/catalogue?after=N&wait=S   (a long-poll, through the ArbiterClient)
             no newer revision by the wait's end  -> ask again
             revision M > N: parse it             -> unreadable: logged, skipped (N = M)
             GET /v1/workers/{worker}             -> its labels and GPUs
             vram = "auto": estimated here        -> no estimate: left out (why logged)
             share(catalogue, worker, ...)        -> on_revision(M, models); N = M
           the controller unreachable, or refusing -> back off (doubling, bounded), again

The client fails over between the controllers it was given (a standby that takes over
answers from its copy, which has every revision the leader stored), so a take-over is
one failed call at most, and the next long-poll asks the new leader. The controller
checked every revision before it stored it: one this gateway cannot read (a newer
version's keys) is logged and skipped, never handed over. A worker the controller does
not know yet (its agent has not registered) is asked again after a back-off: its GPUs
decide its share.

A ``vram = "auto"`` model whose estimate cannot be made on this host (its model file is
not here) is left out of this host's share, with why (:attr:`CatalogueFollower.left_out`,
logged once per revision): its lease's size is unknown here, so this gateway could not
start it; the rest of the revision is handed over all the same, and the hosts that hold
the file serve it.

The follower starts no task of its own: its owner runs :meth:`CatalogueFollower.run`
(in its task group) and cancels it to stop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from ..core import ArbiterError, Gpu, InvalidInput
from .base.clock import Clock
from .catalogue import CatalogueError, parse_catalogue, share
from .servers.config import ModelConfig, ModelFile
from .servers.estimate import estimate_vram

__all__ = [
    "BACKOFF_S",
    "WAIT_S",
    "CatalogueFollower",
    "CatalogueSource",
    "OnRevision",
    "estimate_here",
]

log = logging.getLogger("gpu_arbiter.gateway")

WAIT_S = 30.0
"""How long one long-poll waits for a newer revision."""
BACKOFF_S = (0.5, 30.0)
"""The first back-off after a failure, and the longest (it doubles in between)."""
Json = dict[str, Any]
OnRevision = Callable[[int, Mapping[str, ModelConfig]], Awaitable[None] | None]
"""Called with each new revision and the models this worker may run of it."""


class CatalogueSource(Protocol):
    """What the follower asks the controller (:class:`~gpu_arbiter.client.ArbiterClient`
    answers it; a test's fake too)."""

    async def catalogue_after(self, revision: int, wait_s: float) -> Json | None: ...

    async def worker(self, name: str) -> Json: ...


def estimate_here(model: ModelConfig) -> int | str:
    """MiB per GPU that a ``vram = "auto"`` model needs, estimated from its model file on
    this host; where it cannot be (no file here), why not. Reads files: run it off the
    event loop (the follower does)."""
    try:
        found = estimate_vram(
            model.command, model_file=model.model_file, ctx=model.ctx, gpus=model.gpus
        )
    except InvalidInput as error:
        return f'vram = "auto" cannot be estimated on this host: {error.reason}'
    return found.total_mb


class CatalogueFollower:
    """Follows the catalogue for ``worker`` (this gateway's), calling ``on_revision``
    with each new revision's share; see the module. ``estimate``: a ``vram = "auto"``
    model's MiB per GPU on this host, or why it cannot be made (run on a thread; such a
    model is then left out); default: none made, every such model assumed to fit."""

    def __init__(
        self,
        client: CatalogueSource,
        worker: str,
        on_revision: OnRevision,
        *,
        clock: Clock,
        estimate: Callable[[ModelConfig], int | str] | None = None,
        wait_s: float = WAIT_S,
        backoff_s: tuple[float, float] = BACKOFF_S,
    ) -> None:
        self._client = client
        self.worker = worker
        self._on_revision = on_revision
        self._clock = clock
        self._estimate = estimate
        self.wait_s = wait_s
        self._backoff_s = backoff_s
        self.revision = 0
        """The last revision handed over, or skipped (0: none yet)."""
        self.failures = 0
        """Calls that failed in a row (0 once one succeeds)."""
        self.left_out: dict[str, str] = {}
        """The last revision's models left out of this host's share, and why."""
        self.files: tuple[ModelFile, ...] = ()
        """The model files the last revision's models name, whichever hosts may run them:
        a host that holds one serves it to its peers (set before ``on_revision``)."""

    async def run(self) -> None:
        """Follows until cancelled. An exception of ``on_revision`` ends it (its owner's
        to see); a failure to reach the controller never does."""
        while True:
            try:
                await self.step()
            except ArbiterError as error:
                self.failures += 1
                delay = self.backoff()
                log.warning("catalogue: cannot follow it (%s); asking again in %.1fs", error, delay)
                await self._clock.sleep(delay)
            else:
                self.failures = 0

    def backoff(self) -> float:
        """The pause after :attr:`failures` failures in a row."""
        first, longest = self._backoff_s
        return float(min(longest, first * 2.0 ** max(0, self.failures - 1)))

    async def step(self) -> None:
        """One long-poll, and the share of a newer revision handed over (or skipped).
        Raises what the controller's client raises."""
        found = await self._client.catalogue_after(self.revision, self.wait_s)
        if found is None or int(found["revision"]) <= self.revision:
            return  # none yet, or none newer by the wait's end
        revision = int(found["revision"])
        try:
            catalogue = parse_catalogue(str(found["text"]), str(found.get("file") or ""))
        except CatalogueError as error:
            log.error("catalogue revision %d skipped: this gateway cannot read it: %s",
                      revision, error)  # fmt: skip
            self.revision = revision
            return
        named = {m.file.name: m.file for m in catalogue.models.values() if m.file is not None}
        self.files = tuple(named.values())
        worker = await self._client.worker(self.worker)
        estimates, left_out = await self._estimates(catalogue.models)
        models = share(catalogue, self.worker, _labels(worker), _gpus(worker), estimates)
        self.left_out = {name: left_out[name] for name in sorted(left_out.keys() & models.keys())}
        for name, why in self.left_out.items():
            log.warning("catalogue revision %d: %s left out here: %s", revision, name, why)
        models = {name: model for name, model in models.items() if name not in self.left_out}
        self.revision = revision
        answer = self._on_revision(revision, models)
        if inspect.isawaitable(answer):
            await answer

    async def _estimates(
        self, models: Mapping[str, ModelConfig]
    ) -> tuple[dict[str, int], dict[str, str]]:
        """The ``vram = "auto"`` models' estimates on this host, and why for those that
        have none."""
        estimate = self._estimate
        auto = [model for model in models.values() if model.vram is None]
        if estimate is None or not auto:
            return {}, {}
        found = await asyncio.to_thread(lambda: {m.name: estimate(m) for m in auto})
        sizes = {name: mb for name, mb in found.items() if isinstance(mb, int)}
        return sizes, {name: why for name, why in found.items() if isinstance(why, str)}


def _labels(worker: Json) -> dict[str, str]:
    labels = worker.get("labels") or {}
    return {str(k): str(v) for k, v in labels.items()}


def _gpus(worker: Json) -> list[Gpu]:
    """A worker's GPUs as ``GET /v1/workers/{name}`` shows them."""
    return [_gpu(str(worker["name"]), gpu) for gpu in worker.get("gpus") or ()]


def _gpu(worker: str, gpu: Json) -> Gpu:
    return Gpu(
        index=int(gpu["index"]),
        total_mb=int(gpu["total_mb"]),
        arch=str(gpu.get("arch") or ""),
        worker=worker,
        vendor=str(gpu.get("vendor") or "nvidia"),
        model=str(gpu.get("model") or ""),
        uuid=str(gpu.get("uuid") or ""),
        headroom_mb=int(gpu.get("headroom_mb") or 0),
    )
