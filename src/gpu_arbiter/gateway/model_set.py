"""A gateway's model set as a value: what a change of it does (:func:`diff`), the two
sources merged into one set (:func:`merge`), and the listener settings a reload cannot
change (:func:`listener_changes`). Pure: no I/O, no clock; ``live.py`` applies them.

A model's keys fall in three kinds (:data:`SERVER_KEYS`, :data:`LEASE_KEYS`, the rest):

- what the server runs (``command``, ``model_file``, ``file``, ``vram``, ``gpus``, ``engine``,
  ``env``, ``ctx``, ``ready``): its replicas are replaced, one at a time;
- what its lease was granted at (``priority``, ``preemptible``): kept by the leases held
  (the controller has no verb to change a granted lease's priority), taken by the next
  lease asked for (a new replica, or a queued one asked again): see ``live.py``;
- anything else (``keep_alive``, ``aliases``, ``replicas``, ``max_parallel``, the
  timeouts, ``pinned``...): applied in place, the same server process kept.

The merge: the gateway's own file wins over the catalogue on a name or an alias they
share; each such clash is kept as a :class:`Conflict`, which the gateway reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from .config import GatewayConfig
from .servers.config import ModelConfig

__all__ = [
    "IN_PLACE_KEYS",
    "LEASE_KEYS",
    "SERVER_KEYS",
    "Conflict",
    "Diff",
    "Merged",
    "diff",
    "listener_changes",
    "merge",
    "names_of",
]

SERVER_KEYS = frozenset(
    {
        "command",
        "model_file",
        "file",
        "vram",
        "gpus",
        "engine",
        "env",
        "ctx",
        "ready",
        "ollama_serve",
    }
)
"""A change to one of these replaces the model's replicas (the attribute names of
:class:`ModelConfig`; ``ollama_serve``: a model moved between Ollama entries)."""
LEASE_KEYS = frozenset({"priority", "preemptible"})
"""Kept by the leases held, taken by the next lease asked for."""
IN_PLACE_KEYS = frozenset(
    f.name for f in fields(ModelConfig) if f.name not in SERVER_KEYS | LEASE_KEYS | {"name"}
)
"""Applied to the running model: its server processes stay."""


@dataclass(frozen=True, slots=True)
class Diff:
    """What a new model set does to the one that runs, each a sorted tuple of names:
    ``added`` (served at once), ``removed`` (no new requests; the replicas end after
    their requests in flight), ``replaced`` (a server key changed: replicas replaced one
    at a time), ``in_place`` (other keys changed: the processes kept), ``unchanged``."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()
    in_place: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.replaced or self.in_place)

    def as_json(self) -> dict[str, list[str]]:
        return {
            "added": list(self.added),
            "removed": list(self.removed),
            "replaced": list(self.replaced),
            "in_place": list(self.in_place),
        }

    def describe(self) -> str:
        """One line: ``added embed; removed chat; replaced code; in place: small``."""
        parts = [
            f"{label} {', '.join(names)}"
            for label, names in (
                ("added", self.added),
                ("removed", self.removed),
                ("replaced", self.replaced),
                ("in place:", self.in_place),
            )
            if names
        ]
        return "; ".join(parts) or "no model changed"


def changed_keys(old: ModelConfig, new: ModelConfig) -> frozenset[str]:
    """The attributes of ``old`` and ``new`` that differ (``name`` aside)."""
    return frozenset(
        f.name
        for f in fields(ModelConfig)
        if f.name != "name" and getattr(old, f.name) != getattr(new, f.name)
    )


def diff(old: Mapping[str, ModelConfig], new: Mapping[str, ModelConfig]) -> Diff:
    """What replacing model set ``old`` by ``new`` does, model by model (keyed by name)."""
    replaced, in_place, unchanged = [], [], []
    for name in sorted(set(old) & set(new)):
        keys = changed_keys(old[name], new[name])
        if keys & SERVER_KEYS:
            replaced.append(name)
        elif keys:
            in_place.append(name)
        else:
            unchanged.append(name)
    return Diff(
        added=tuple(sorted(set(new) - set(old))),
        removed=tuple(sorted(set(old) - set(new))),
        replaced=tuple(replaced),
        in_place=tuple(in_place),
        unchanged=tuple(unchanged),
    )


@dataclass(frozen=True, slots=True)
class Conflict:
    """A name (or alias) that both sources declare: ``model`` as ``kept`` declares it
    won over ``over``'s (a source's words: ``own file``, ``catalogue revision 3``)."""

    model: str
    kept: str
    over: str

    def as_json(self) -> dict[str, str]:
        return {"model": self.model, "kept": self.kept, "over": self.over}


@dataclass(frozen=True, slots=True)
class Merged:
    models: Mapping[str, ModelConfig]
    conflicts: tuple[Conflict, ...] = ()


OWN_FILE = "own file"


def names_of(model: ModelConfig) -> tuple[str, ...]:
    """What routes to ``model``: its name and its aliases."""
    return (model.name, *model.aliases)


def merge(
    own: Mapping[str, ModelConfig], catalogue: Mapping[str, ModelConfig], source: str
) -> Merged:
    """The gateway's own models and the catalogue's (``source``: its words, such as
    ``catalogue revision 3``) as one set in which a name or an alias routes to one model
    only: a catalogue model that shares one with an own model (or with a catalogue model
    kept before it, by name) is left out, and named in a :class:`Conflict`."""
    models = dict(own)
    taken = {alias: OWN_FILE for model in own.values() for alias in names_of(model)}
    conflicts = []
    for name in sorted(catalogue):
        model = catalogue[name]
        clash = next((taken[n] for n in names_of(model) if n in taken), None)
        if clash is not None:
            conflicts.append(Conflict(name, clash, source))
            continue
        models[name] = model
        taken.update(dict.fromkeys(names_of(model), source))
    return Merged(models, tuple(conflicts))


_NOT_LISTENER = frozenset({"models"})
_KEY_OF = {
    "keys": "api_keys",
    "header_timeout_s": "header_timeout",
    "affinity": "prefix_affinity",
    "liveness": "peer_check",
    "tls": "tls_cert",
}


def listener_changes(old: GatewayConfig, new: GatewayConfig) -> tuple[str, ...]:
    """The ``[gateway]`` settings that differ (as ``gateway.KEY``): a running gateway
    keeps those it started with (its port, keys, TLS...) until it is restarted."""
    found = []
    for f in fields(GatewayConfig):
        if f.name in _NOT_LISTENER:
            continue
        if getattr(old, f.name) != getattr(new, f.name):
            found.append(f"gateway.{_KEY_OF.get(f.name, f.name)}")
    return tuple(sorted(found))
