"""The storage interface of the controller.

A store keeps what was acknowledged: worker records, lease records (live and
final), counters (``next_token``, ``next_seq``, ``paused``), the bounded event
history, the token digests, which token holds each gateway name, and every revision of
the cluster's catalogue.
:meth:`Store.commit` writes one :class:`Batch` in one transaction: when it returns, the
change is durable; when it raises, none of it was written.

Errors::

    StoreError          the store could not read or write
    └── Fenced          a write by a controller that no longer leads (shared stores)
"""

from __future__ import annotations

from typing import Protocol

from .records import Batch, Event, LeaseRecord, OperationRecord, Snapshot, TokenRecord

__all__ = ["Fenced", "Store", "StoreError"]


class StoreError(Exception):
    """The store could not read or write (disk full, database locked, ...)."""


class Fenced(StoreError):
    """A write refused because its controller no longer leads the shared store: its
    term (epoch) is over, or it never led. Nothing of the write was stored."""


class Store(Protocol):
    def load(self) -> Snapshot:
        """Workers, live leases (pending and held), counters, running operations, gateway
        names and the catalogue's revisions, as last committed."""
        ...

    def commit(self, batch: Batch) -> None:
        """Writes ``batch`` in one transaction, durably, or raises :class:`StoreError`."""
        ...

    def lease(self, lease_id: str) -> LeaseRecord | None: ...

    def lease_by_key(self, owner: str | None, idempotency_key: str) -> LeaseRecord | None:
        """The record created by ``owner`` with this idempotency key, in any state."""
        ...

    def events_after(self, seq: int, limit: int) -> list[Event]:
        """Retained events with a sequence number above ``seq``, oldest first."""
        ...

    def operation(self, operation_id: str) -> OperationRecord | None:
        """An operation record (an update), running or ended."""
        ...

    def prune(self, ended_before: float, limit: int) -> int:
        """Forgets at most ``limit`` final leases that ended before ``ended_before`` (their
        idempotency keys with them); returns how many. Live leases are never pruned."""
        ...

    def put_token(self, token: TokenRecord) -> None: ...

    def token(self, digest: str) -> TokenRecord | None: ...

    def tokens(self) -> list[TokenRecord]:
        """Every token record, oldest first."""
        ...

    def revoke_token(self, token_id: str) -> bool:
        """Deletes the token ``token_id``; False if there is none."""
        ...

    def close(self) -> None: ...
