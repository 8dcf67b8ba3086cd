"""A store in memory: the reference for the contract tests, and a fast non-durable mode."""

from __future__ import annotations

import bisect

from .base import StoreError
from .records import (
    Batch,
    CatalogueRevision,
    Event,
    GatewayNameRecord,
    LeaseRecord,
    OperationRecord,
    Snapshot,
    TokenRecord,
    WorkerRecord,
)

__all__ = ["MemoryStore"]


class MemoryStore:
    def __init__(self, *, event_history: int = 10_000) -> None:
        self._event_history = event_history
        self._workers: dict[str, WorkerRecord] = {}
        self._leases: dict[str, LeaseRecord] = {}
        self._keys: dict[tuple[str, str], str] = {}
        self._events: list[Event] = []
        self._meta: dict[str, int] = {}
        self._tokens: dict[str, TokenRecord] = {}
        self._operations: dict[str, OperationRecord] = {}
        self._names: dict[str, GatewayNameRecord] = {}
        self._catalogue: list[CatalogueRevision] = []

    def load(self) -> Snapshot:
        live = tuple(r for r in self._leases.values() if not r.state.is_final)
        return Snapshot(
            workers=tuple(self._workers.values()),
            leases=live,
            meta=dict(self._meta),
            last_event_seq=self._events[-1].seq if self._events else 0,
            operations=tuple(op for op in self._operations.values() if op.running),
            gateway_names=tuple(record for _, record in sorted(self._names.items())),
            catalogue=tuple(self._catalogue),
        )

    def commit(self, batch: Batch) -> None:
        if batch.catalogue:  # checked before anything is written: all or nothing
            self._check_new(batch.catalogue)
        for name in batch.removed_workers:
            self._workers.pop(name, None)
        self._workers.update(batch.workers)
        for lease_id, record in batch.leases.items():
            self._leases[lease_id] = record
            if record.request.idempotency_key is not None:
                self._keys[(record.owner or "", record.request.idempotency_key)] = lease_id
        self._events.extend(batch.events)
        if len(self._events) > 2 * self._event_history:  # trim now and then, not every time
            del self._events[: len(self._events) - self._event_history]
        self._meta.update(batch.meta)
        self._operations.update(batch.operations)
        for name, named in batch.gateway_names.items():
            if named is None:
                self._names.pop(name, None)
            else:
                self._names[name] = named
        self._catalogue.extend(batch.catalogue)

    def _check_new(self, revisions: list[CatalogueRevision]) -> None:
        """A revision is written once (a unique key, as the databases' primary key)."""
        stored = {r.revision for r in self._catalogue}
        for revision in revisions:
            if revision.revision in stored:
                raise StoreError(f"catalogue revision {revision.revision} is stored already")
            stored.add(revision.revision)

    def operation(self, operation_id: str) -> OperationRecord | None:
        return self._operations.get(operation_id)

    def lease(self, lease_id: str) -> LeaseRecord | None:
        return self._leases.get(lease_id)

    def lease_by_key(self, owner: str | None, idempotency_key: str) -> LeaseRecord | None:
        lease_id = self._keys.get((owner or "", idempotency_key))
        return None if lease_id is None else self._leases.get(lease_id)

    def events_after(self, seq: int, limit: int) -> list[Event]:
        start = bisect.bisect_right(self._events, seq, key=lambda e: e.seq)
        return self._events[start : start + limit]

    def prune(self, ended_before: float, limit: int) -> int:
        old = [
            record
            for record in self._leases.values()
            if record.state.is_final
            and record.ended_at is not None
            and record.ended_at < ended_before
        ][:limit]
        for record in old:
            del self._leases[record.id]
            if record.request.idempotency_key is not None:
                self._keys.pop((record.owner or "", record.request.idempotency_key), None)
        return len(old)

    def put_token(self, token: TokenRecord) -> None:
        self._tokens[token.digest] = token

    def token(self, digest: str) -> TokenRecord | None:
        return self._tokens.get(digest)

    def tokens(self) -> list[TokenRecord]:
        return sorted(self._tokens.values(), key=lambda t: (t.created_at, t.id))

    def revoke_token(self, token_id: str) -> bool:
        digests = [digest for digest, t in self._tokens.items() if t.id == token_id]
        for digest in digests:
            del self._tokens[digest]
        return bool(digests)

    def close(self) -> None:
        pass
