"""A running gateway's model set, changed without a restart: :class:`LiveModels`.

Two sources make the set: the gateway's own file (``[models.*]`` of its models.toml:
:meth:`LiveModels.set_own`, at a reload) and the cluster's catalogue
(:meth:`LiveModels.set_catalogue`). They are merged (``model_set.merge``: the own file
wins a name or alias both declare; each clash is kept in :attr:`LiveModels.conflicts`,
which the gateway reports to the controller), and the merged set goes through the one
entry point, :meth:`LiveModels.apply`, whoever asked:

1. everything is checked before anything changes: names and aliases route to one model;
   each model to start (added, or replaced) has a lease size (``vram = "auto"``: an
   estimate that can be made) and a program that is there; an Ollama entry is not
   changed (one ``ollama serve`` holds its models: it changes at a restart); each new
   model's server can be made. A set that fails a check changes nothing: the
   :class:`~gpu_arbiter.core.InvalidInput` names the field and the reason.
2. then, model by model (``model_set.diff``): an **added** one is served at once (its
   life started in the gateway's task group of the models' lives, its names routed); a
   **removed** one takes no new request (404 naming what removed it:
   :attr:`LiveModels.removed`), its replicas end after their requests in flight, their
   leases released, its life ends (``ModelServer.retire``); a change to **what the
   server runs** replaces its replicas one at a time, a new one ready beside each that
   serves before that one drains (``ModelServer.replace``); any **other** change applies
   in place, the same processes kept (``ModelServer.update``).
3. the controller is told with the next report, at once (``Reporter.models_changed``).

A change of **priority** (or ``preemptible``) applies to the next lease asked for: a
new replica, or a queued one (asked again when the priority rose, as for a caller
above it). The leases held keep the priority they were granted at until their replica
ends. Replacing a held lease by a new request at the new priority was not chosen: for
the time both are held, one server's memory would be committed twice on a GPU that may
have no room for it, so the new request would preempt or reclaim other work (I5 allows
a raised priority to preempt strictly lower preemptible leases) to get memory that the
old lease frees moments later. Keeping the lease keeps the arbiter's ledger what the
GPU holds; the model's report shows the old priority in its replicas (``priority``)
and in ``preemptible_by`` until then.

A change to the ``[gateway]`` table's own settings (its host, port, keys, TLS...)
cannot apply to a listener that runs: a reload applies the models and names those
settings in its answer (``not_applied``) and its log line; they apply at the next start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core import InvalidInput
from .base.metrics import GatewayMetrics
from .model_set import Conflict, Diff, diff, merge, names_of
from .profile import Affinity
from .servers.config import ModelConfig
from .servers.interfaces import FileKeeper, Parts
from .servers.model import Grower, ModelServer
from .servers.ollama import OllamaModelServer

__all__ = ["LiveModels", "Outcome", "catalogue_source"]

log = logging.getLogger("gpu_arbiter.gateway")

SizeOf = Callable[[ModelConfig], int]
"""A model's lease size in MiB per GPU (``vram``, else its estimate); raises
:class:`InvalidInput` naming the field when it cannot be made."""
Place = Callable[[Mapping[str, ModelConfig]], dict[str, ModelConfig]]
"""The models with each ``{file}`` their file's path on this host (``files/wiring.placed``)."""
ProgramOf = Callable[[ModelConfig], "str | None"]
"""Why a model's program cannot be run, or None (``programs.missing_program``)."""


def catalogue_source(revision: int) -> str:
    """The catalogue's words as a source: ``catalogue revision 3``."""
    return f"catalogue revision {revision}"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a change did: the :class:`Diff`, the name clashes of the merged sources and
    the ``[gateway]`` settings it could not apply (a reload's), and the models whose
    own change raised (``failed``: a bug, named with why; the rest was made)."""

    diff: Diff
    conflicts: tuple[Conflict, ...] = ()
    not_applied: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)  # model -> why (a bug's)

    def as_json(self) -> dict[str, Any]:
        found: dict[str, Any] = self.diff.as_json()
        found["conflicts"] = [c.as_json() for c in self.conflicts]
        found["not_applied"] = list(self.not_applied)
        found["failed"] = dict(self.failed)
        return found

    def describe(self) -> str:
        text = self.diff.describe()
        for name, why in self.failed.items():
            text += f"; {name}: its change failed ({why})"
        if self.not_applied:
            keys = ", ".join(self.not_applied)
            text += f"; not applied until a restart: {keys} (the listener's)"
        for conflict in self.conflicts:
            text += f"; {conflict.model}: {conflict.kept} kept over {conflict.over}"
        return text


class LiveModels:
    """The models a gateway serves, shared by name (``models``) and by name or alias
    (``routes``) with its app, its cluster and its reporter, which read them; only this
    object changes them, and only in place (the dicts are the same objects)."""

    def __init__(
        self,
        models: dict[str, ModelServer],
        *,
        parts: Parts,
        metrics: GatewayMetrics,
        worker: str | None,
        size_of: SizeOf,
        program_of: ProgramOf = lambda model: None,
        asker: Mapping[str, str] | None = None,
        affinity: Affinity | None = None,
        files: FileKeeper | None = None,
        place: Place = dict,
    ) -> None:
        self.models = models
        self.routes: dict[str, str] = {}
        self.removed: dict[str, str] = {}  # a name or alias removed -> what removed it
        self.parts = parts
        self.metrics = metrics
        self.worker = worker
        self.size_of = size_of
        self.program_of = program_of
        self.asker: Mapping[str, str] = asker or {}
        self.affinity = affinity
        self.files = files
        self.place = place
        self.cluster: Grower | None = None
        self.changed: Callable[[], None] = lambda: None  # the reporter's, once it runs
        self.own: Mapping[str, ModelConfig] = {m.name: m.config for m in models.values()}
        self.catalogue: Mapping[str, ModelConfig] = {}
        self.catalogue_revision: int | None = None
        self.left_out: dict[str, str] = {}  # the catalogue's models not served here: why
        self.conflicts: tuple[Conflict, ...] = ()
        self._lives: asyncio.TaskGroup | None = None
        self._unstarted: list[ModelServer] = []  # added before run: started by it
        self._stopping = asyncio.Event()
        self._applying = asyncio.Lock()
        for model in models.values():
            self._join(model)
        self._route()

    # ------------------------------------------------------------------ life

    async def run(self) -> None:
        """The models' lives, for the gateway's: one task group owns them (each model its
        replicas', each Ollama serve its own tasks), those added later too; it ends once
        :meth:`shutdown` was called and every model's life has ended."""
        models = [*self.models.values(), *self._unstarted]
        self._unstarted.clear()
        serves = {m.serve.entry: m.serve for m in models if isinstance(m, OllamaModelServer)}
        async with asyncio.TaskGroup() as lives:
            for serve in serves.values():  # first: its models' replicas start it
                lives.create_task(serve.run())
            for model in models:
                lives.create_task(model.run())
            self._lives = lives
            try:
                await self._stopping.wait()
            finally:
                self._lives = None

    def shutdown(self) -> None:
        """Every model stops (``ModelServer.shutdown``); :meth:`run` returns once each
        has ended. Nothing is added after."""
        self._stopping.set()
        for model in self.models.values():
            model.shutdown()

    def grace_s(self) -> float:
        """The longest grace of the models served."""
        return max((m.config.grace_s for m in self.models.values()), default=10.0)

    # ------------------------------------------------------------------ sources

    def configs(self) -> dict[str, ModelConfig]:
        """The running set, each model's config."""
        return {name: model.config for name, model in self.models.items()}

    async def set_own(self, models: Mapping[str, ModelConfig], source: str) -> Outcome:
        """The gateway's own file changed (``source``: words such as 'the reload of
        models.toml at 12:03:04'): merged with the catalogue, applied."""
        async with self._applying:  # merged with the sources as the last change left them
            merged = merge(models, self.catalogue, self._catalogue_source())
            outcome = await self._apply(merged.models, f"by {source}", merged.conflicts)
            self.own = dict(models)
            return outcome

    async def set_catalogue(
        self,
        models: Mapping[str, ModelConfig],
        revision: int,
        left_out: Mapping[str, str] | None = None,
    ) -> Outcome:
        """The cluster's catalogue at ``revision``: merged with the own file (which wins
        a name or alias both declare), applied. ``left_out``: the models of this host's
        share it cannot serve, and why (kept in :attr:`left_out`, which the gateway
        reports; those the own file serves aside)."""
        source = catalogue_source(revision)
        async with self._applying:
            merged = merge(self.own, models, source)
            outcome = await self._apply(merged.models, f"by {source}", merged.conflicts)
            self.catalogue, self.catalogue_revision = dict(models), revision
            self.left_out = {n: why for n, why in (left_out or {}).items() if n not in self.own}
            return outcome

    def _catalogue_source(self) -> str:
        revision = self.catalogue_revision
        return "the catalogue" if revision is None else catalogue_source(revision)

    # ------------------------------------------------------------------ the entry point

    async def apply(
        self,
        models: Mapping[str, ModelConfig],
        why: str,
        conflicts: tuple[Conflict, ...] = (),
    ) -> Outcome:
        """Makes ``models`` the running set (``why``: words after 'removed', such as 'by
        catalogue revision 7'); raises :class:`InvalidInput` (field, reason), with
        nothing changed, when a check fails (the module's docstring). One change at a
        time: a second waits for the first to be made."""
        async with self._applying:
            return await self._apply(models, why, conflicts)

    async def _apply(
        self, models: Mapping[str, ModelConfig], why: str, conflicts: tuple[Conflict, ...]
    ) -> Outcome:
        if self._stopping.is_set():
            raise InvalidInput("models", "the gateway is stopping")
        models = self.place(models)
        change = diff(self.configs(), models)
        sizes, built = self._checked(models, change)
        failed: dict[str, str] = {}
        pins = self._commit(models, change, sizes, built, why, failed)
        self.conflicts = conflicts
        for model, pinned in pins:
            await model.pin() if pinned else model.unpin()
        self.changed()  # said by the caller, once (serve.py: a reload's or a revision's line)
        return Outcome(change, conflicts, failed=failed)

    def _checked(
        self, models: Mapping[str, ModelConfig], change: Diff
    ) -> tuple[dict[str, int], dict[str, ModelServer]]:
        """Every check, before anything changes: the lease sizes of the models to start,
        and the servers of those added."""
        _check_names(models)
        current = self.configs()
        for name in (*change.added, *change.removed, *change.replaced, *change.in_place):
            config = models.get(name) or current[name]
            entry = config.ollama_serve or (current.get(name) or config).ollama_serve
            if entry is not None:
                raise InvalidInput(
                    f"models.{entry}",
                    "an Ollama entry (one ollama serve for its models) changes only at a "
                    "restart of the gateway",
                )
        sizes: dict[str, int] = {}
        for name in (*change.added, *change.replaced):
            sizes[name] = self._size(models[name])
            why = self.program_of(models[name])
            if why is not None:
                raise InvalidInput(f"models.{name}.command", why)
        built = {name: self._build(models[name], sizes[name]) for name in change.added}
        return sizes, built

    def _size(self, model: ModelConfig) -> int:
        try:
            return self.size_of(model)
        except InvalidInput:
            raise
        except Exception as error:  # an estimate that could not read its file...
            why = f"cannot be estimated: {error.__class__.__name__}: {error}"
            raise InvalidInput(f"models.{model.name}.vram", why) from error

    def _build(self, config: ModelConfig, vram_mb: int) -> ModelServer:
        try:
            return ModelServer(
                config, parts=self.parts, metrics=self.metrics, worker=self.worker,
                vram_mb=vram_mb,
            )  # fmt: skip
        except Exception as error:
            why = f"cannot be served: {error.__class__.__name__}: {error}"
            raise InvalidInput(f"models.{config.name}", why) from error

    def _commit(
        self,
        models: Mapping[str, ModelConfig],
        change: Diff,
        sizes: Mapping[str, int],
        built: Mapping[str, ModelServer],
        why: str,
        failed: dict[str, str],
    ) -> list[tuple[ModelServer, bool]]:
        """The checked change, made: nothing here refuses. The models whose pin the
        config changed, to pin or unpin (an await: the caller's). A model whose own
        change raises (a bug) is named in ``failed`` with why; the set, its routes and
        the other models' changes are made all the same."""
        gone = {n for name in change.removed for n in names_of(self.models[name].config)}
        for name in change.removed:
            _guarded(failed, name, self.models.pop(name).retire, why)
        pins = []
        for name in change.in_place:
            model = self.models[name]
            if models[name].pinned != model.config.pinned:
                pins.append((model, models[name].pinned))
            _guarded(failed, name, model.update, models[name])
        for name in change.replaced:
            _guarded(failed, name, self.models[name].replace, models[name], sizes[name], why)
        for name in change.added:
            model = built[name]
            self._join(model)
            self.models[name] = model
            if self._lives is None:
                self._unstarted.append(model)
            else:
                self._lives.create_task(model.run())
        self._route()
        for name in gone - set(self.routes):
            self.removed[name] = why
        for name in self.routes:
            self.removed.pop(name, None)
        return pins

    def _join(self, model: ModelServer) -> None:
        """A model joins the set: the gateway's own links."""
        model.neighbours = self.models  # collation: a busy model yields to one that waits
        model.asker = self.asker
        model.affinity = self.affinity
        model.cluster = self.cluster
        model.files = self.files  # its model file copied before its lease is asked for

    def _route(self) -> None:
        """``routes`` from the models (in place: its readers hold this dict)."""
        routes = {alias: m.name for m in self.models.values() for alias in m.config.aliases}
        routes.update({name: name for name in self.models})
        self.routes.clear()
        self.routes.update(routes)

    def set_cluster(self, cluster: Grower) -> None:
        """The gateway's cluster, once it has one: each model (and each added) grows
        through it."""
        self.cluster = cluster
        for model in self.models.values():
            model.cluster = cluster


def _check_names(models: Mapping[str, ModelConfig]) -> None:
    """A name or alias routes to one model only (``config._check_names``'s rule, for a
    set from any source)."""
    owner: dict[str, str] = {}
    for name in sorted(models):
        model = models[name]
        if model.name != name:
            raise InvalidInput(f"models.{name}", f"its config names {model.name!r}")
        for alias in names_of(model):
            if owner.get(alias, name) != name:
                raise InvalidInput(
                    f"models.{name}.aliases", f"{alias!r} already names {owner[alias]}"
                )
            owner[alias] = name


def _guarded(failed: dict[str, str], name: str, change: Callable[..., None], *args: Any) -> None:
    """``change(*args)``, one model's; an exception it raises (a bug) is logged and kept
    in ``failed``: the other models' changes are made all the same."""
    try:
        change(*args)
    except Exception as error:
        log.exception("model %s: its change failed", name)
        failed[name] = f"{error.__class__.__name__}: {error}"
