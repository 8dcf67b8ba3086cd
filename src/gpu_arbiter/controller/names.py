"""Gateway names: which token holds each name a gateway reports as, kept in the store so
that a restarted controller, or a standby that takes over, still refuses a name to
another token.

A name's life here::

    (free) --take (the first token that reports it)--> held --forget (an admin)--> (free)
                                                          \\--take (its token is gone)--/

The live reports themselves stay in the server's memory (``server/gateways.py``), which
asks this module who holds a name and tells it when one is taken or forgotten. Taking
and forgetting are changes like any other: stored in the change's transaction (fenced
on a shared store) before anyone is told, with an event each; a change that cannot be
stored leaves memory as the store holds it (the reload restores this module too).

Owns the names held. Its part of every change (a :class:`~.change.Participant`):
:meth:`GatewayNames.encode` writes the names a change took or forgot.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..core import NotFound
from ..store import Batch, GatewayNameRecord
from .change import Change, Changes, Participant

__all__ = ["GatewayNames"]


class GatewayNames(Participant):
    def __init__(self, changes: Changes) -> None:
        self._changes = changes
        self._names: dict[str, GatewayNameRecord] = {}

    def get(self, name: str) -> GatewayNameRecord | None:
        """Who holds ``name``, if anyone."""
        return self._names.get(name)

    def __len__(self) -> int:
        return len(self._names)

    def take(self, name: str, owner: str, worker: str | None) -> GatewayNameRecord:
        """``owner`` (a token id) holds ``name`` from now on, whoever held it before (the
        caller decided it may): stored, with a ``gateway.name_taken`` event, before it
        returns (or once the change's transaction is durable, with group commit)."""
        self._changes.gate.check_available()
        with self._changes.change() as change:
            before = self._names.get(name)
            record = GatewayNameRecord(name, owner, worker, change.now)
            self._names[name] = change.names[name] = record
            previous = {} if before is None else {"previous_owner": before.owner}
            change.event("gateway.name_taken", name=name, owner=owner, **previous)
        return record

    def forget(self, name: str) -> GatewayNameRecord:
        """``name`` is free again (an admin's word): stored, with a
        ``gateway.name_forgotten`` event. Raises :class:`NotFound` if nobody holds it."""
        self._changes.gate.check_available()
        before = self._names.get(name)
        if before is None:
            raise NotFound(f"no token holds the gateway name {name!r}", gateway=name)
        with self._changes.change() as change:
            del self._names[name]
            change.names[name] = None
            change.event("gateway.name_forgotten", name=name, owner=before.owner)
        return before

    # ------------------------------------------------------------------ the change

    def encode(self, change: Change, batch: Batch) -> None:
        batch.gateway_names.update(change.names)

    # ------------------------------------------------------------------ restore

    def restore(self, records: Iterable[GatewayNameRecord]) -> None:
        """The names as the store holds them (at a start, a reload, a standby's copy)."""
        self._names = {record.name: record for record in records}
