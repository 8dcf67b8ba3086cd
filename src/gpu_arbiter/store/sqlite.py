"""The embedded durable store: SQLite in WAL mode, in the state directory.

The database and its ``-wal`` and ``-shm`` files are private to their owner (0600),
whatever the umask.

Every :meth:`SqliteStore.commit` is one ``BEGIN IMMEDIATE ... COMMIT``. With
``synchronous=NORMAL`` (the default) a committed change survives the process
being killed; ``synchronous=FULL`` also survives power loss, at the cost of an
fsync per commit. The SQL is plain enough for PostgreSQL too (``ON CONFLICT``
upserts, no SQLite-only types).

Two connections: commits go through one, everything else (loads, reads, pruning,
tokens) through the other, so that :meth:`SqliteStore.commit` may run on a thread of
its own (the controller's group commit) while the event loop reads: a reader never
sees a transaction that is not committed, and the two never share one. Commits are
never concurrent with one another (their caller's rule).

The write-ahead log is copied back into the database file by a third connection on a
thread of its own (:class:`_Checkpointer`), never by a commit: SQLite's own checkpoint
runs inside the commit that crosses 1,000 pages of log and flushes the database file to
disk there, so that commit, and every change grouped into it, waited for the flush (a
commit takes about 0.03 ms here; one that checkpointed up to 180 ms). A passive
checkpoint takes no lock a commit waits for; the log is reused from its start once it
has been copied whole.

Idempotency keys are looked up in an index in memory (every stored lease's owner and
key, read at open, kept by commits and pruning): a key never used, the common case,
costs no query.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any, Literal

from .base import StoreError
from .codec import (
    DOCUMENT_FORMAT,
    dumps,
    event_from_doc,
    event_to_doc,
    lease_from_doc,
    lease_to_doc,
    operation_from_doc,
    operation_to_doc,
    worker_from_doc,
    worker_to_doc,
)
from .records import (
    Batch,
    CatalogueRevision,
    Event,
    GatewayNameRecord,
    LeaseRecord,
    OperationRecord,
    Snapshot,
    TokenRecord,
)

__all__ = ["SqliteStore"]

log = logging.getLogger("gpu_arbiter.store")

CHECKPOINT_EVERY = 256
"""Commits between two checkpoints asked of the checkpointer (SQLite's own threshold is
1,000 pages of log; a commit here writes a few)."""

LOG_LIMIT_PAGES = 16_384
"""A log this long (64 MiB of 4 KiB pages) is copied whole and emptied (``TRUNCATE``):
the log starts again from its beginning only once a checkpoint has copied all of it
before the next commit, which under a steady stream of commits may not happen for long,
and the log would grow the whole while. The writer waits for that checkpoint (a few ms,
the passive one just before having copied most), at most ``TRUNCATE_WAIT_S``."""

TRUNCATE_WAIT_S = 0.2
"""How long the emptying checkpoint waits for readers and the writer before it gives up
until the next checkpoint (the commits it held back go on then)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (name TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    final INTEGER NOT NULL,
    owner TEXT NOT NULL,
    idempotency_key TEXT,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS leases_final ON leases (final);
CREATE INDEX IF NOT EXISTS leases_key ON leases (owner, idempotency_key);
CREATE TABLE IF NOT EXISTS events (seq BIGINT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tokens (
    digest TEXT PRIMARY KEY,
    id TEXT NOT NULL,
    role TEXT NOT NULL,
    worker TEXT,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS operations (
    id TEXT PRIMARY KEY,
    running INTEGER NOT NULL,
    doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS gateway_names (
    name TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    worker TEXT,
    taken_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS catalogue (
    revision BIGINT PRIMARY KEY,
    sha256 TEXT NOT NULL,
    applied_at DOUBLE PRECISION NOT NULL,
    applied_by TEXT NOT NULL,
    file TEXT NOT NULL,
    text TEXT NOT NULL
);
"""
"""Each table is made if it is missing, so a database of an older version gains the ones
added since (``gateway_names``, ``catalogue``) at its first open by this one."""

_UPSERT_LEASE = (
    "INSERT INTO leases (id, state, final, owner, idempotency_key, doc) VALUES (?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (id) DO UPDATE SET state = excluded.state, final = excluded.final, "
    "doc = excluded.doc"
)
_UPSERT_WORKER = (
    "INSERT INTO workers (name, doc) VALUES (?, ?) "
    "ON CONFLICT (name) DO UPDATE SET doc = excluded.doc"
)
_UPSERT_OPERATION = (
    "INSERT INTO operations (id, running, doc) VALUES (?, ?, ?) "
    "ON CONFLICT (id) DO UPDATE SET running = excluded.running, doc = excluded.doc"
)
_UPSERT_NAME = (
    "INSERT INTO gateway_names (name, owner, worker, taken_at) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, worker = excluded.worker, "
    "taken_at = excluded.taken_at"
)
_INSERT_REVISION = (
    "INSERT INTO catalogue (revision, sha256, applied_at, applied_by, file, text) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)
"""A revision is written once: one already stored is an error (the primary key), and
the transaction writes nothing."""
_SELECT_REVISIONS = (
    "SELECT revision, text, sha256, applied_at, applied_by, file FROM catalogue ORDER BY revision"
)
_UPSERT_META = (
    "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = "
    "excluded.value"
)


class SqliteStore:
    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        event_history: int = 10_000,
    ) -> None:
        self.path = Path(path)
        self._event_history = event_history
        self._commits = 0
        opened: list[sqlite3.Connection] = []  # closed again if the store cannot open
        try:
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            self._db = self._connect(synchronous)
            opened.append(self._db)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._check_format()  # before the schema: a newer database is left as it is
            self._db.executescript(_SCHEMA)
            self._writer = self._connect(synchronous)
            opened.append(self._writer)
            self._writer.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer's work
            self._writer.execute(f"PRAGMA journal_size_limit={LOG_LIMIT_PAGES * 4096}")
            self._checkpointer = _Checkpointer(self.path, synchronous)
            self._keys: set[tuple[str, str]] = set(
                self._db.execute(
                    "SELECT owner, idempotency_key FROM leases WHERE idempotency_key IS NOT NULL"
                )
            )
            self._make_private()
        except BaseException as error:
            for db in opened:
                db.close()
            if isinstance(error, sqlite3.Error | OSError):
                raise StoreError(f"cannot open {self.path}: {error}") from error
            raise

    def _check_format(self) -> None:
        """Refuses a database written in a newer document format than this code reads;
        records this code's in an older one (``user_version``: this code writes its
        format from now on)."""
        (written,) = self._db.execute("PRAGMA user_version").fetchone()
        if written > DOCUMENT_FORMAT:
            raise StoreError(
                f"cannot open {self.path}: written by a newer gpu-arbiter (document format "
                f"{written}; this one reads up to {DOCUMENT_FORMAT}): upgrade gpu-arbiter"
            )
        if written < DOCUMENT_FORMAT:
            self._db.execute(f"PRAGMA user_version={DOCUMENT_FORMAT}")

    def _connect(self, synchronous: str) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
        try:
            db.execute(f"PRAGMA synchronous={synchronous}")
        except BaseException:
            db.close()
            raise
        return db

    def _make_private(self) -> None:
        """0600 for the database and the files SQLite keeps beside it (which it makes
        with the database's mode, so a database made before this was 0644 stays so)."""
        for suffix in ("", "-wal", "-shm"):
            path = self.path.with_name(self.path.name + suffix)
            if path.exists() and path.stat().st_mode & 0o077:
                path.chmod(0o600)

    def load(self) -> Snapshot:
        db = self._db
        try:
            workers = tuple(
                worker_from_doc(json.loads(doc)) for (doc,) in db.execute("SELECT doc FROM workers")
            )
            leases = tuple(
                lease_from_doc(json.loads(doc))
                for (doc,) in db.execute("SELECT doc FROM leases WHERE final = 0")
            )
            meta = {key: int(value) for key, value in db.execute("SELECT key, value FROM meta")}
            (last,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()
            operations = tuple(
                operation_from_doc(json.loads(doc))
                for (doc,) in db.execute("SELECT doc FROM operations WHERE running = 1")
            )
            names = tuple(
                GatewayNameRecord(*row)
                for row in db.execute(
                    "SELECT name, owner, worker, taken_at FROM gateway_names ORDER BY name"
                )
            )
            catalogue = tuple(CatalogueRevision(*row) for row in db.execute(_SELECT_REVISIONS))
        except sqlite3.Error as error:
            raise StoreError(f"cannot load {self.path}: {error}") from error
        return Snapshot(
            workers=workers,
            leases=leases,
            meta=meta,
            last_event_seq=int(last),
            operations=operations,
            gateway_names=names,
            catalogue=catalogue,
        )

    def commit(self, batch: Batch) -> None:
        db = self._writer
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                self._write(batch)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.Error as error:
            raise StoreError(f"cannot write {self.path}: {error}") from error
        self._checkpointer.committed()
        self._keys.update(
            (r.owner or "", r.request.idempotency_key)
            for r in batch.leases.values()
            if r.request.idempotency_key is not None
        )

    def _write(self, batch: Batch) -> None:
        db = self._writer
        if batch.removed_workers:
            db.executemany(
                "DELETE FROM workers WHERE name = ?", [(n,) for n in batch.removed_workers]
            )
        if batch.workers:
            db.executemany(
                _UPSERT_WORKER,
                [(n, dumps(worker_to_doc(w))) for n, w in batch.workers.items()],
            )
        if batch.leases:
            db.executemany(
                _UPSERT_LEASE,
                [
                    (
                        r.id,
                        str(r.state),
                        int(r.state.is_final),
                        r.owner or "",
                        r.request.idempotency_key,
                        dumps(lease_to_doc(r)),
                    )
                    for r in batch.leases.values()
                ],
            )
        if batch.events:
            db.executemany(
                "INSERT INTO events (seq, doc) VALUES (?, ?)",
                [(e.seq, dumps(event_to_doc(e))) for e in batch.events],
            )
            self._commits += 1
            if self._commits % 256 == 0:
                last = batch.events[-1].seq
                db.execute("DELETE FROM events WHERE seq <= ?", (last - self._event_history,))
        if batch.meta:
            db.executemany(_UPSERT_META, list(batch.meta.items()))
        if batch.operations:
            db.executemany(
                _UPSERT_OPERATION,
                [
                    (op.id, int(op.running), dumps(operation_to_doc(op)))
                    for op in batch.operations.values()
                ],
            )
        if batch.gateway_names:
            named = batch.gateway_names.items()
            db.executemany(
                "DELETE FROM gateway_names WHERE name = ?",
                [(name,) for name, record in named if record is None],
            )
            db.executemany(
                _UPSERT_NAME,
                [(r.name, r.owner, r.worker, r.taken_at) for _, r in named if r is not None],
            )
        if batch.catalogue:
            db.executemany(
                _INSERT_REVISION,
                [
                    (r.revision, r.sha256, r.applied_at, r.applied_by, r.file, r.text)
                    for r in batch.catalogue
                ],
            )

    def operation(self, operation_id: str) -> OperationRecord | None:
        row = self._one("SELECT doc FROM operations WHERE id = ?", (operation_id,))
        return None if row is None else operation_from_doc(json.loads(row[0]))

    def lease(self, lease_id: str) -> LeaseRecord | None:
        row = self._one("SELECT doc FROM leases WHERE id = ?", (lease_id,))
        return None if row is None else lease_from_doc(json.loads(row[0]))

    def lease_by_key(self, owner: str | None, idempotency_key: str) -> LeaseRecord | None:
        if (owner or "", idempotency_key) not in self._keys:
            return None
        row = self._one(
            "SELECT doc FROM leases WHERE owner = ? AND idempotency_key = ?",
            (owner or "", idempotency_key),
        )
        return None if row is None else lease_from_doc(json.loads(row[0]))

    def events_after(self, seq: int, limit: int) -> list[Event]:
        try:
            rows = self._db.execute(
                "SELECT doc FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (seq, limit)
            ).fetchall()
        except sqlite3.Error as error:
            raise StoreError(f"cannot read {self.path}: {error}") from error
        return [event_from_doc(json.loads(doc)) for (doc,) in rows]

    def prune(self, ended_before: float, limit: int) -> int:
        try:
            gone = self._db.execute(
                "DELETE FROM leases WHERE id IN (SELECT id FROM leases WHERE final = 1 "
                "AND json_extract(doc, '$.ended_at') < ? LIMIT ?) "
                "RETURNING owner, idempotency_key",
                (ended_before, limit),
            ).fetchall()
        except sqlite3.Error as error:
            raise StoreError(f"cannot write {self.path}: {error}") from error
        self._keys.difference_update((owner, key) for owner, key in gone if key is not None)
        return len(gone)

    def put_token(self, token: TokenRecord) -> None:
        try:
            with self._db:
                self._db.execute(
                    "INSERT INTO tokens (digest, id, role, worker, created_at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (token.digest, token.id, token.role, token.worker, token.created_at),
                )
        except sqlite3.Error as error:
            raise StoreError(f"cannot write {self.path}: {error}") from error

    def token(self, digest: str) -> TokenRecord | None:
        row = self._one(
            "SELECT id, digest, role, worker, created_at FROM tokens WHERE digest = ?", (digest,)
        )
        return None if row is None else TokenRecord(*row)

    def tokens(self) -> list[TokenRecord]:
        try:
            rows = self._db.execute(
                "SELECT id, digest, role, worker, created_at FROM tokens ORDER BY created_at, id"
            ).fetchall()
        except sqlite3.Error as error:
            raise StoreError(f"cannot read {self.path}: {error}") from error
        return [TokenRecord(*row) for row in rows]

    def revoke_token(self, token_id: str) -> bool:
        try:
            gone = self._db.execute("DELETE FROM tokens WHERE id = ?", (token_id,))
        except sqlite3.Error as error:
            raise StoreError(f"cannot write {self.path}: {error}") from error
        return gone.rowcount > 0

    def close(self) -> None:
        self._checkpointer.close()
        self._writer.close()
        self._db.close()

    def _one(self, sql: str, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        try:
            row = self._db.execute(sql, args).fetchone()
        except sqlite3.Error as error:
            raise StoreError(f"cannot read {self.path}: {error}") from error
        return None if row is None else tuple(row)


class _Checkpointer:
    """Checkpoints the write-ahead log (``PASSIVE``: as much as it can without waiting for
    a reader or a writer) every :data:`CHECKPOINT_EVERY` commits, on a connection and a
    daemon thread of its own, started at the first checkpoint asked for (a store only
    read, by a command, starts none); empties a log of :data:`LOG_LIMIT_PAGES`. A
    checkpoint that fails is logged and tried again at the next; the log stays correct
    meanwhile, only longer."""

    def __init__(self, path: Path, synchronous: str) -> None:
        self._path = path
        self._synchronous = synchronous
        self._commits = 0
        self._wanted = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def committed(self) -> None:
        self._commits += 1
        if self._commits % CHECKPOINT_EVERY:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sqlite-checkpoint", daemon=True)
            self._thread.start()
        self._wanted.set()

    def _run(self) -> None:
        db: sqlite3.Connection | None = None
        try:
            while True:
                self._wanted.wait()
                self._wanted.clear()
                if self._closed:
                    return
                try:
                    if db is None:
                        db = sqlite3.connect(
                            self._path, isolation_level=None, timeout=TRUNCATE_WAIT_S
                        )
                        db.execute(f"PRAGMA synchronous={self._synchronous}")
                    _, pages, _ = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    if pages >= LOG_LIMIT_PAGES:
                        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                except sqlite3.Error as error:
                    log.warning("checkpoint of %s failed: %s", self._path, error)
        finally:
            if db is not None:
                db.close()

    def close(self) -> None:
        self._closed = True
        self._wanted.set()
        if self._thread is not None:
            self._thread.join()
