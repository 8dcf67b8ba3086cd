"""A replica's model file put in place before its lease is asked for.

The order, and why: a replica of a model with a ``file`` that this host lacks first
copies it (from a peer gateway whose report says it holds the file, routable ones
first, then from the file's ``url``), and only then asks the arbiter for its lease.
A copy takes minutes (4 GiB at 80 MB/s is almost a minute; from a URL, often more),
and GPU memory reserved meanwhile would be memory nobody else may use and nobody
uses: the lease is asked for once the file is here, checked against its sha256, so
the time between grant and ready is the load alone. The replica stays ``queued``
meanwhile; a caller who waits reads ``copying chat's file to box-4: 1.2 of 4.1 GiB,
80 MB/s`` in the wait messages (``requests/waits.py``). A copy refused (no headroom,
corrupt bytes, no source) ends the replica as a failed start, with the reason: the
caller is told it (502), and the model backs off as for any failed start. A copy cut
(the peer stopped, the caller gave up) keeps its ``.part``: the next start resumes it.

Where the load goes: a cluster's cold load is placed by the arbiter, which weighs
memory, not files; the controller makes the load's lease prefer the hosts whose gateway
reports holding the model's file (each model reports its file's name, each gateway the
files it holds: ``server/cluster.py``, ``prefer_workers``), so that when several fit,
one that needs no copy is taken, and only when none of those fits does a host copy
first. What remains: a load granted on a host that lacks the file (none that holds it
fit) is adopted with its lease already held, and copies while it holds it; and a
request that names its host (``chat@gw-3``) or a model only one host declares copies
there, as asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol
from urllib.parse import quote

from ...core import InvalidInput
from ..base.race import sleep_or
from ..servers.estimate import estimate_vram
from ..servers.states import Ending, EndKind
from .fetch import Source
from .spec import ModelFile
from .store import FileRefused, FileStore, Progress, format_progress

if TYPE_CHECKING:
    from ..servers.model import ModelServer
    from ..servers.replica import Replica


class Holders(Protocol):
    """The cluster as a copy sees it: which peers hold a file (``cluster/cluster.py``),
    once its first view came (``seen``)."""

    @property
    def seen(self) -> asyncio.Event: ...

    def holders(self, name: str, size: int, sha256: str) -> Sequence[Peer]: ...


class Peer(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...


__all__ = ["FileStep", "Holders", "sources_of"]

log = logging.getLogger("gpu_arbiter.gateway")
PROGRESS_S = 0.5
"""A waiting caller is told a copy's progress at most this often."""
FIRST_VIEW_S = 10.0
"""A copy asked for before the cluster's first view came waits this long at most for
it: which peers hold the file is in it."""


def sources_of(file: ModelFile, cluster: Holders | None) -> list[Source]:
    """Where ``file`` may be copied from, in order: each peer that holds it (routable
    first), then its ``url``."""
    found = []
    if cluster is not None:
        for peer in cluster.holders(file.name, file.size, file.sha256):
            url = f"{peer.url.rstrip('/')}/files/{quote(file.name)}"
            found.append(Source(url, peer=peer.name))
    if file.url is not None:
        found.append(Source(file.url))
    return found


class FileStep:
    """The gateway's model files: its ``store``, the ``cluster`` (its peers, when it is
    in one), the ``host`` a waiting caller reads the copy goes to, and the models
    ``estimated`` from their file already (``vram = "auto"``)."""

    def __init__(
        self,
        store: FileStore,
        cluster: Callable[[], Holders | None],
        host: str,
        estimated: set[str] | None = None,
    ) -> None:
        self.store = store
        self.cluster = cluster
        self.host = host
        self.estimated = estimated or set()  # vram = "auto" models estimated from their file

    def kept(self, model: ModelServer) -> AbstractContextManager[None]:
        """While a replica of ``model`` lives, its file is in use: never evicted."""
        file = model.config.file
        return contextlib.nullcontext() if file is None else self.store.using(file.name)

    async def ready(self, model: ModelServer, replica: Replica) -> bool:
        """``model``'s file is here, verified (copied first if not); False when the
        replica ended meanwhile, or the copy was refused (the replica ended, saying why)."""
        file = model.config.file
        if file is None:
            return True
        if not self.store.holds(file) and not await self._copied(model, replica, file):
            return False
        if model.config.vram is None and model.name not in self.estimated:
            return self._estimated(model, replica)
        return replica.ending is None

    async def _copied(self, model: ModelServer, replica: Replica, file: ModelFile) -> bool:
        told = [-PROGRESS_S]

        def progress(now: Progress) -> None:
            if model.clock.now() - told[0] >= PROGRESS_S or now.done == now.size:
                told[0] = model.clock.now()
                model.copying = format_progress(now, model.name, self.host)
                replica.pending_reason = model.copying
                model.notify()

        cluster = self.cluster()
        if cluster is not None and not cluster.seen.is_set():  # a gateway just started
            await sleep_or(model.clock.sleep(FIRST_VIEW_S), cluster.seen)
        sources = sources_of(file, cluster)
        model.copying = f"copying {model.name}'s file to {self.host}: starting"
        copy = asyncio.ensure_future(self.store.ensure(file, sources, progress))
        try:
            if await sleep_or(copy, replica.ended):
                copy.cancel()
                with contextlib.suppress(asyncio.CancelledError, FileRefused):
                    await copy
                return False
            copy.result()
        except FileRefused as refused:
            replica.stop(Ending(EndKind.FAILED, f"model file not in place: {refused.reason}"))
            return False
        finally:
            copy.cancel()
            model.copying = None
            replica.pending_reason = "waiting for a lease"
            model.notify()
        return True

    def _estimated(self, model: ModelServer, replica: Replica) -> bool:
        """``vram = "auto"``: the estimate from the file now here."""
        config = model.config
        try:
            found = estimate_vram(
                config.command, model_file=config.model_file, ctx=config.ctx, gpus=config.gpus
            )
        except InvalidInput as error:
            why = f"vram = auto: no estimate from its file: {error.reason}"
            replica.stop(Ending(EndKind.FAILED, why))
            return False
        model.vram_mb = found.total_mb  # in place of the file's size, asked for until now
        self.estimated.add(model.name)
        log.info("model %s: %d MiB per GPU, estimated from its file", model.name, model.vram_mb)
        return True
