"""The shared store: PostgreSQL through asyncpg, for several controllers on one database.

The :class:`~.base.Store` protocol is synchronous (a change is committed inside one
synchronous step of the controller, like SQLite's blocking commit), while asyncpg is
asynchronous. So the store owns a private event loop in a daemon thread: each public
method submits a coroutine to it and waits for the answer, at most ``timeout_s``. The
controller's own loop never shares a loop with the connection pool or the leadership
renewals. Every database failure, cut connection or timeout is a :class:`StoreError`
whose message never contains the password of the DSN.

Schema: the tables of the SQLite store (documents as JSON text, see :mod:`.codec`),
and ``leadership``, created by the versioned :data:`MIGRATIONS` at open: the missing
ones are applied in one transaction under an advisory lock, so controllers starting
together do not race; a database newer than this code is refused.

Leadership: one row (``epoch``, ``holder``, ``url``, ``expires_at``, ``commits``).
Every time comparison uses the database's clock, never a controller's::

    standby --try_lead (term lapsed: epoch + 1)--> leader --step_down--> standby
                                                     |
                 renewal finds the epoch moved on, or the database unreachable
                 until the term would have expired --> standby (on_lost())

A leader renews its term every ``ttl_s / 3``. :meth:`PostgresStore.commit` is one
statement (one round trip) that counts the commit against the leader's epoch *and* an
unexpired term and writes the batch only if they hold, so a deposed or partitioned
leader can never commit anything (it gets :class:`Fenced`); the row stays locked until
the commit ends, so a standby takes over only after the last commit of the old term is
durable. Commits use a connection of their own, beside the pool of the reads, the
renewals and the tokens; pooled connections skip asyncpg's reset query on release
(another round trip): the store keeps no session state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import asyncpg

from .base import Fenced, StoreError
from .codec import (
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

__all__ = ["MIGRATIONS", "Leader", "PostgresStore"]

log = logging.getLogger(__name__)
T = TypeVar("T")

MIGRATIONS: tuple[str, ...] = (
    # 1: the tables of the SQLite store, and the leadership row.
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value BIGINT NOT NULL);
    CREATE TABLE workers (name TEXT PRIMARY KEY, doc TEXT NOT NULL);
    CREATE TABLE leases (
        id TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        final BOOLEAN NOT NULL,
        owner TEXT NOT NULL,
        idempotency_key TEXT,
        doc TEXT NOT NULL
    );
    CREATE INDEX leases_live ON leases (id) WHERE NOT final;
    CREATE INDEX leases_key ON leases (owner, idempotency_key);
    CREATE TABLE events (seq BIGINT PRIMARY KEY, doc TEXT NOT NULL);
    CREATE TABLE tokens (
        digest TEXT PRIMARY KEY,
        id TEXT NOT NULL,
        role TEXT NOT NULL,
        worker TEXT,
        created_at DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE operations (id TEXT PRIMARY KEY, running BOOLEAN NOT NULL, doc TEXT NOT NULL);
    CREATE TABLE leadership (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        epoch BIGINT NOT NULL,
        holder TEXT,
        url TEXT,
        expires_at TIMESTAMPTZ NOT NULL,
        commits BIGINT NOT NULL
    );
    INSERT INTO leadership (id, epoch, holder, url, expires_at, commits)
        VALUES (1, 0, NULL, NULL, '-infinity', 0);
    """,
    # 2: leases are written in document format 1 (``codec.DOCUMENT_FORMAT``: fields at
    # their defaults left out). The tables do not change; the version does, so that a
    # controller older than the format refuses the database rather than fail on a lease.
    """
    COMMENT ON TABLE leases IS 'documents: gpu-arbiter document format 1';
    """,
    # 3: which token holds each gateway name, so that a restarted or new leader still
    # refuses a name to another token.
    """
    CREATE TABLE gateway_names (
        name TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        worker TEXT,
        taken_at DOUBLE PRECISION NOT NULL
    );
    """,
    # 4: every revision of the cluster's catalogue, so that a new leader serves the
    # catalogue the old one stored.
    """
    CREATE TABLE catalogue (
        revision BIGINT PRIMARY KEY,
        sha256 TEXT NOT NULL,
        applied_at DOUBLE PRECISION NOT NULL,
        applied_by TEXT NOT NULL,
        file TEXT NOT NULL,
        text TEXT NOT NULL
    );
    """,
)
"""The schema, one SQL script per version (version ``i + 1`` is ``MIGRATIONS[i]``).
Append only: a released migration never changes. A new document format
(``codec.DOCUMENT_FORMAT``) is a new migration too."""

_MIGRATION_LOCK = 0x6770_752D_6172_62  # pg_advisory_xact_lock key: "gpu-arb"

_TAKE = (
    "UPDATE leadership SET epoch = epoch + 1, holder = $1, url = $2, "
    "expires_at = clock_timestamp() + make_interval(secs => $3) "
    "WHERE id = 1 AND expires_at <= clock_timestamp() RETURNING epoch"
)
_RENEW = (
    "UPDATE leadership SET expires_at = clock_timestamp() + make_interval(secs => $2) "
    "WHERE id = 1 AND epoch = $1 RETURNING epoch"
)
_END_TERM = (
    "UPDATE leadership SET expires_at = clock_timestamp() "
    "WHERE id = 1 AND epoch = $1 AND expires_at > clock_timestamp()"
)
_COMMIT = """
WITH fence AS (
    UPDATE leadership SET commits = commits + 1
    WHERE id = 1 AND epoch = $1 AND expires_at > clock_timestamp()
    RETURNING commits
), delete_workers AS (
    DELETE FROM workers
    WHERE name = ANY($2::text[]) AND NOT name = ANY($3::text[])
        AND EXISTS (SELECT 1 FROM fence)
), put_workers AS (
    INSERT INTO workers (name, doc)
    SELECT * FROM unnest($3::text[], $4::text[]) WHERE EXISTS (SELECT 1 FROM fence)
    ON CONFLICT (name) DO UPDATE SET doc = excluded.doc
), put_leases AS (
    INSERT INTO leases (id, state, final, owner, idempotency_key, doc)
    SELECT * FROM unnest($5::text[], $6::text[], $7::boolean[], $8::text[], $9::text[],
        $10::text[])
    WHERE EXISTS (SELECT 1 FROM fence)
    ON CONFLICT (id) DO UPDATE SET state = excluded.state, final = excluded.final,
        doc = excluded.doc
), put_events AS (
    INSERT INTO events (seq, doc)
    SELECT * FROM unnest($11::bigint[], $12::text[]) WHERE EXISTS (SELECT 1 FROM fence)
), trim_events AS (
    DELETE FROM events
    WHERE $13::bigint IS NOT NULL AND seq <= $13 AND EXISTS (SELECT 1 FROM fence)
), put_meta AS (
    INSERT INTO meta (key, value)
    SELECT * FROM unnest($14::text[], $15::bigint[]) WHERE EXISTS (SELECT 1 FROM fence)
    ON CONFLICT (key) DO UPDATE SET value = excluded.value
), put_operations AS (
    INSERT INTO operations (id, running, doc)
    SELECT * FROM unnest($16::text[], $17::boolean[], $18::text[])
    WHERE EXISTS (SELECT 1 FROM fence)
    ON CONFLICT (id) DO UPDATE SET running = excluded.running, doc = excluded.doc
), delete_names AS (
    DELETE FROM gateway_names
    WHERE name = ANY($19::text[]) AND EXISTS (SELECT 1 FROM fence)
), put_names AS (
    INSERT INTO gateway_names (name, owner, worker, taken_at)
    SELECT * FROM unnest($20::text[], $21::text[], $22::text[], $23::float8[])
    WHERE EXISTS (SELECT 1 FROM fence)
    ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, worker = excluded.worker,
        taken_at = excluded.taken_at
), put_catalogue AS (
    INSERT INTO catalogue (revision, sha256, applied_at, applied_by, file, text)
    SELECT * FROM unnest($24::bigint[], $25::text[], $26::float8[], $27::text[], $28::text[],
        $29::text[])
    WHERE EXISTS (SELECT 1 FROM fence)
)
SELECT commits FROM fence
"""
"""One commit, one statement (so one round trip, atomic on its own): ``fence`` counts
the commit against the leader's epoch and an unexpired term and locks the leadership
row until the statement commits; every write happens only if it matched, so a fenced
leader writes nothing and gets no row. The sub-statements see one snapshot, so a
worker both removed and written in one batch is not deleted but written (what the
SQLite store's delete-then-upsert leaves). ``$13``: trim the events up to this seq
(NULL: not this time, and the test of it, on a parameter alone, is planned as a one-time
filter, so the table is not scanned); the trim does not see the events the same
statement inserts. A gateway name is either deleted (``$19``) or written, never both in
one batch. A catalogue revision is only ever inserted: one already stored fails the
whole statement (its primary key), and nothing of it is written."""

_COMMIT_GRACE_S = 2.0
"""How much longer than ``timeout_s`` a commit waits for the database's own answer."""

# What a broken or unreachable database raises (asyncpg: server errors, a closed or
# misused connection; the OS: refused, reset; asyncio: no answer in time).
_FAILURES: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)


@dataclass(frozen=True, slots=True)
class Leader:
    """Who leads: the current ``epoch`` (0: nobody ever led), its holder and URL, and
    whether its term is unexpired (by the database's clock)."""

    epoch: int
    holder: str | None
    url: str | None
    alive: bool


def _where(dsn: str) -> str:
    """The DSN without user or password, to name the database in messages."""
    try:
        parts = urlsplit(dsn)
        query = parse_qs(parts.query)
        host = parts.hostname or query.get("host", ["localhost"])[0]
        port = parts.port or query.get("port", [""])[0]
    except ValueError:
        return "the PostgreSQL database"
    return f"postgresql://{host}{f':{port}' if port else ''}{parts.path}"


def _secrets(dsn: str) -> tuple[str, ...]:
    """The passwords a DSN carries (in its user part or as ``?password=``)."""
    try:
        parts = urlsplit(dsn)
        found = [parts.password or "", *parse_qs(parts.query).get("password", [])]
    except ValueError:
        found = []
    return tuple(s for s in found if s)


class PostgresStore:
    """The :class:`~.base.Store` on PostgreSQL, with the leadership of controllers.

    ``dsn``: ``postgresql://user@host:port/database`` (a password is better kept in
    ``PGPASSWORD`` or ``~/.pgpass`` than in the URL). ``timeout_s`` bounds every call.
    ``step_down_on_close``: :meth:`close` ends a term this store leads, so that a standby
    takes over at once (a controller shutting down cleanly); otherwise the term lapses."""

    def __init__(
        self,
        dsn: str,
        *,
        event_history: int = 10_000,
        timeout_s: float = 10.0,
        pool_size: int = 4,
        step_down_on_close: bool = False,
    ) -> None:
        self._where = _where(dsn)
        self._secrets = _secrets(dsn)
        self._event_history = event_history
        self._timeout_s = timeout_s
        self._step_down_on_close = step_down_on_close
        self._event_commits = 0
        self._epoch: int | None = None
        self._on_lost: Callable[[], None] | None = None
        self._renewal: asyncio.Task[None] | None = None
        self._closed = False
        self._dsn = dsn
        self._writer: Any = None  # the connection commits use; (re)made by _writer_connection
        self._writing = asyncio.Lock()  # one statement at a time on it
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="gpu-arbiter-postgres", daemon=True
        )
        self._thread.start()
        try:
            self._pool = self._call("open", self._open(dsn, pool_size), (ValueError,))
        except BaseException:
            self._stop_loop()
            raise

    # ------------------------------------------------------------------ the Store protocol

    def load(self) -> Snapshot:
        return self._call("load", self._load())

    def commit(self, batch: Batch) -> None:
        # The database cancels a commit that runs past timeout_s (statement_timeout on
        # the writer connection) and answers: a definite failure, nothing written. Only
        # if that answer does not come either is the outcome unknown to this side.
        self._call("write", self._commit(batch), wait_s=self._timeout_s + _COMMIT_GRACE_S)

    def lease(self, lease_id: str) -> LeaseRecord | None:
        doc = self._call("read", self._fetchval("SELECT doc FROM leases WHERE id = $1", lease_id))
        return None if doc is None else lease_from_doc(json.loads(doc))

    def lease_by_key(self, owner: str | None, idempotency_key: str) -> LeaseRecord | None:
        sql = "SELECT doc FROM leases WHERE owner = $1 AND idempotency_key = $2"
        doc = self._call("read", self._fetchval(sql, owner or "", idempotency_key))
        return None if doc is None else lease_from_doc(json.loads(doc))

    def events_after(self, seq: int, limit: int) -> list[Event]:
        sql = "SELECT doc FROM events WHERE seq > $1 ORDER BY seq LIMIT $2"
        rows = self._call("read", self._fetch(sql, seq, limit))
        return [event_from_doc(json.loads(doc)) for (doc,) in rows]

    def operation(self, operation_id: str) -> OperationRecord | None:
        sql = "SELECT doc FROM operations WHERE id = $1"
        doc = self._call("read", self._fetchval(sql, operation_id))
        return None if doc is None else operation_from_doc(json.loads(doc))

    def prune(self, ended_before: float, limit: int) -> int:
        """Not fenced: what it forgets ended long ago, whoever leads."""
        sql = (
            "WITH gone AS (DELETE FROM leases WHERE id IN (SELECT id FROM leases WHERE final "
            "AND (doc::jsonb ->> 'ended_at')::float8 < $1 LIMIT $2) RETURNING 1) "
            "SELECT count(*) FROM gone"
        )
        removed: int = self._call("write", self._fetchval(sql, float(ended_before), limit))
        return removed

    def put_token(self, token: TokenRecord) -> None:
        """Not fenced: tokens only add, and any controller may issue one."""
        sql = (
            "INSERT INTO tokens (digest, id, role, worker, created_at) VALUES ($1, $2, $3, $4, $5)"
        )
        args = (token.digest, token.id, token.role, token.worker, token.created_at)
        self._call("write", self._execute(sql, *args))

    def token(self, digest: str) -> TokenRecord | None:
        sql = "SELECT id, digest, role, worker, created_at FROM tokens WHERE digest = $1"
        rows = self._call("read", self._fetch(sql, digest))
        return TokenRecord(*rows[0]) if rows else None

    def tokens(self) -> list[TokenRecord]:
        sql = "SELECT id, digest, role, worker, created_at FROM tokens ORDER BY created_at, id"
        return [TokenRecord(*row) for row in self._call("read", self._fetch(sql))]

    def revoke_token(self, token_id: str) -> bool:
        """Not fenced, as issuing one is not."""
        sql = (
            "WITH gone AS (DELETE FROM tokens WHERE id = $1 RETURNING 1) SELECT count(*) FROM gone"
        )
        removed: int = self._call("write", self._fetchval(sql, token_id))
        return removed > 0

    def close(self) -> None:
        """Closes the pool and stops the thread. A leader stops renewing; its term ends
        now with ``step_down_on_close``, else a standby takes over when it lapses."""
        if self._closed:
            return
        try:
            self._call("close", self._shutdown())
        except StoreError as error:
            log.warning("%s", error)
        finally:
            self._closed = True
            self._stop_loop()

    # ------------------------------------------------------------------ leadership

    @property
    def epoch(self) -> int | None:
        """The epoch this store leads under; None when it does not lead."""
        return self._epoch

    def try_lead(
        self,
        holder: str,
        url: str | None,
        ttl_s: float,
        on_lost: Callable[[], None] | None = None,
    ) -> int | None:
        """Takes the leadership if no term is unexpired: the epoch goes up by one, the
        term lasts ``ttl_s`` and is renewed every ``ttl_s / 3``; returns the new epoch
        (the current one if this store leads already). None: another holds it.

        Load the state after taking over: every commit of the previous term is in it.
        When the leadership is lost (the epoch moved on, a commit was fenced, or the
        database stayed unreachable until the term would have expired) the store stops
        leading and calls ``on_lost()`` once, from the store's thread."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, not {ttl_s}")
        return self._call("take the leadership of", self._try_lead(holder, url, ttl_s, on_lost))

    def step_down(self) -> None:
        """Ends this store's term now, so that a standby can take over at once."""
        self._call("end the term in", self._step_down())

    def leader(self) -> Leader:
        """Who leads now (``alive``: the term is unexpired by the database's clock)."""
        sql = (
            "SELECT epoch, holder, url, expires_at > clock_timestamp() FROM leadership WHERE id = 1"
        )
        epoch, holder, url, alive = self._call("read", self._fetch(sql))[0]
        return Leader(epoch=epoch, holder=holder, url=url, alive=alive)

    def version(self) -> int:
        """Grows by one with every committed batch: a standby reloads when it moved."""
        commits: int = self._call(
            "read", self._fetchval("SELECT commits FROM leadership WHERE id = 1")
        )
        return commits

    # ------------------------------------------------------------------ on the store's loop

    def _call(
        self,
        what: str,
        coro: Coroutine[Any, Any, T],
        failures: tuple[type[BaseException], ...] = (),
        wait_s: float | None = None,
    ) -> T:
        """Runs ``coro`` on the store's loop, at most ``wait_s`` (``timeout_s`` unless
        given); a failure is a StoreError naming ``what``."""
        if self._closed:
            coro.close()
            raise StoreError(f"cannot {what} {self._where}: the store is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("PostgresStore called from its own thread (in on_lost?)")
        timeout_s = self._timeout_s if wait_s is None else wait_s
        future = asyncio.run_coroutine_threadsafe(_within(coro, timeout_s), self._loop)
        try:
            return future.result(timeout_s + 5.0)
        except StoreError:
            raise
        except TimeoutError:
            future.cancel()
            unknown = "; whether it was written is unknown" if what == "write" else ""
            raise StoreError(
                f"cannot {what} {self._where}: no answer within {timeout_s:g} s{unknown}"
            ) from None
        except (*_FAILURES, *failures) as error:
            raise StoreError(self._scrub(f"cannot {what} {self._where}: {error}")) from error

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    async def _open(self, dsn: str, pool_size: int) -> Any:
        pool = await asyncpg.create_pool(
            dsn,
            min_size=1,
            max_size=pool_size,
            timeout=self._timeout_s,
            command_timeout=self._timeout_s,
            reset=_keep_session,
        )
        try:
            async with pool.acquire() as conn:
                await _migrate(conn)
        except BaseException:
            pool.terminate()
            raise
        return pool

    async def _shutdown(self) -> None:
        if self._step_down_on_close:
            try:
                await self._step_down()
            except _FAILURES as error:
                log.warning("cannot end the term: %s", self._scrub(str(error)))
        await self._stop_renewal()
        writer, self._writer = self._writer, None
        if writer is not None:
            try:  # after the cancel of a timed-out commit, if one is due
                await asyncio.wait_for(writer.close(), self._timeout_s / 2)
            except _FAILURES:
                writer.terminate()
        try:
            await asyncio.wait_for(self._pool.close(), self._timeout_s / 2)
        except TimeoutError:
            self._pool.terminate()

    async def _fetch(self, sql: str, *args: Any) -> list[Any]:
        rows: list[Any] = await self._pool.fetch(sql, *args)
        return rows

    async def _fetchval(self, sql: str, *args: Any) -> Any:
        return await self._pool.fetchval(sql, *args)

    async def _execute(self, sql: str, *args: Any) -> None:
        await self._pool.execute(sql, *args)

    async def _load(self) -> Snapshot:
        async with (
            self._pool.acquire() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            workers = await conn.fetch("SELECT doc FROM workers ORDER BY name")
            leases = await conn.fetch("SELECT doc FROM leases WHERE NOT final ORDER BY id")
            meta = await conn.fetch("SELECT key, value FROM meta")
            last = await conn.fetchval("SELECT COALESCE(MAX(seq), 0) FROM events")
            operations = await conn.fetch("SELECT doc FROM operations WHERE running ORDER BY id")
            names = await conn.fetch(
                "SELECT name, owner, worker, taken_at FROM gateway_names ORDER BY name"
            )
            catalogue = await conn.fetch(
                "SELECT revision, text, sha256, applied_at, applied_by, file FROM catalogue "
                "ORDER BY revision"
            )
        return Snapshot(
            workers=tuple(worker_from_doc(json.loads(doc)) for (doc,) in workers),
            leases=tuple(lease_from_doc(json.loads(doc)) for (doc,) in leases),
            meta={key: int(value) for key, value in meta},
            last_event_seq=int(last),
            operations=tuple(operation_from_doc(json.loads(doc)) for (doc,) in operations),
            gateway_names=tuple(GatewayNameRecord(*row) for row in names),
            catalogue=tuple(CatalogueRevision(*row) for row in catalogue),
        )

    async def _commit(self, batch: Batch) -> None:
        epoch = self._epoch
        if epoch is None:
            raise Fenced("not the leader (this controller does not lead)")
        args = self._commit_args(epoch, batch)
        async with self._writing:
            writer = await self._writer_connection()
            try:
                commits = await writer.fetchval(_COMMIT, *args)
            except asyncpg.QueryCanceledError as error:  # rolled back: a definite failure
                late = "statement timeout" in str(error)
                why = f"not done within {self._timeout_s:g} s" if late else str(error)
                raise StoreError(
                    f"cannot write {self._where}: {why}; the database cancelled it, "
                    "nothing of it was written"
                ) from None
            except (asyncpg.InterfaceError, asyncpg.InternalClientError, OSError):
                writer.terminate()  # a broken connection: the next commit makes a new one
                raise
        if commits is None:
            self._lose(epoch)
            raise Fenced(f"not the leader (epoch {epoch} is over)")

    async def _writer_connection(self) -> Any:
        """The connection commits use, outside the pool (no acquire or release on every
        commit): made on the first commit and again after it broke. A timed-out commit
        leaves it open: asyncpg cancels the statement and waits for that before the next.
        The database itself ends a commit that runs past ``timeout_s`` (rolled back), so
        a slow commit fails for certain instead of perhaps landing after the caller gave
        up; the caller's own wait is longer, for that answer to come back."""
        if self._writer is None or self._writer.is_closed():
            self._writer = None
            self._writer = await asyncpg.connect(
                self._dsn,
                timeout=self._timeout_s,
                server_settings={"statement_timeout": str(max(1, round(self._timeout_s * 1000)))},
            )
        return self._writer

    def _commit_args(self, epoch: int, batch: Batch) -> tuple[Any, ...]:
        """The parameters of :data:`_COMMIT` for ``batch`` (a column is an array)."""
        leases = list(batch.leases.values())
        operations = list(batch.operations.values())
        names = [r for r in batch.gateway_names.values() if r is not None]
        trim_to = None
        if batch.events:
            self._event_commits += 1
            if self._event_commits % 256 == 0:  # trim now and then, not every time
                trim_to = batch.events[-1].seq - self._event_history
        return (
            epoch,
            list(batch.removed_workers),
            list(batch.workers),
            [dumps(worker_to_doc(w)) for w in batch.workers.values()],
            [r.id for r in leases],
            [str(r.state) for r in leases],
            [r.state.is_final for r in leases],
            [r.owner or "" for r in leases],
            [r.request.idempotency_key for r in leases],
            [dumps(lease_to_doc(r)) for r in leases],
            [e.seq for e in batch.events],
            [dumps(event_to_doc(e)) for e in batch.events],
            trim_to,
            list(batch.meta),
            list(batch.meta.values()),
            [op.id for op in operations],
            [op.running for op in operations],
            [dumps(operation_to_doc(op)) for op in operations],
            [name for name, record in batch.gateway_names.items() if record is None],
            [r.name for r in names],
            [r.owner for r in names],
            [r.worker for r in names],
            [r.taken_at for r in names],
            [r.revision for r in batch.catalogue],
            [r.sha256 for r in batch.catalogue],
            [r.applied_at for r in batch.catalogue],
            [r.applied_by for r in batch.catalogue],
            [r.file for r in batch.catalogue],
            [r.text for r in batch.catalogue],
        )

    async def _try_lead(
        self, holder: str, url: str | None, ttl_s: float, on_lost: Callable[[], None] | None
    ) -> int | None:
        if self._epoch is not None:
            return self._epoch
        asked_at = time.monotonic()  # the term ends ttl_s after the database's now, later
        epoch: int | None = await self._pool.fetchval(_TAKE, holder, url, float(ttl_s))
        if epoch is None:
            return None
        self._epoch, self._on_lost = epoch, on_lost
        self._renewal = self._loop.create_task(self._renew(epoch, ttl_s, asked_at + ttl_s))
        log.info("leading %s as %s under epoch %d", self._where, holder, epoch)
        return epoch

    async def _renew(self, epoch: int, ttl_s: float, valid_until: float) -> None:
        """Renews the term every ttl_s / 3 until the epoch moves on or the term would
        have expired without the database answering. ``valid_until``: the monotonic
        time by which the term surely still runs (measured from before the ask)."""
        interval = ttl_s / 3
        delay = interval
        while True:
            await asyncio.sleep(delay)
            asked_at = time.monotonic()
            try:
                async with asyncio.timeout(valid_until - asked_at):
                    renewed = await self._pool.fetchval(_RENEW, epoch, float(ttl_s))
            except _FAILURES as error:
                if time.monotonic() >= valid_until:
                    log.error("leadership of epoch %d lost: %s", epoch, self._scrub(str(error)))
                    self._lose(epoch)
                    return
                delay = min(interval, (valid_until - time.monotonic()) / 3)
                log.warning("cannot renew the term of epoch %d: %s", epoch, self._scrub(str(error)))
                continue
            if renewed is None:
                log.error("leadership of epoch %d lost: another controller took over", epoch)
                self._lose(epoch)
                return
            valid_until, delay = asked_at + ttl_s, interval

    def _lose(self, epoch: int) -> None:
        """Stops leading under ``epoch`` (on the store's loop) and says so, once."""
        if self._epoch != epoch:
            return
        on_lost, renewal = self._on_lost, self._renewal
        self._epoch = self._on_lost = self._renewal = None
        if renewal is not None and renewal is not asyncio.current_task():
            renewal.cancel()
        if on_lost is not None:
            try:
                on_lost()
            except Exception:
                log.exception("on_lost failed")

    async def _step_down(self) -> None:
        epoch = self._epoch
        if epoch is None:
            return
        self._epoch = self._on_lost = None
        await self._stop_renewal()
        await self._pool.execute(_END_TERM, epoch)
        log.info("stepped down from epoch %d", epoch)

    async def _stop_renewal(self) -> None:
        renewal, self._renewal = self._renewal, None
        if renewal is not None:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self._loop.close()


async def _within(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """``coro``, cancelled after ``timeout_s`` (TimeoutError); unlike ``asyncio.wait_for``,
    without a task of its own."""
    async with asyncio.timeout(timeout_s):
        return await coro


async def _keep_session(conn: Any) -> None:
    """A connection back in the pool needs no reset query (a round trip on every
    release): the store leaves no session state behind (no SET, LISTEN, cursor or
    session-level advisory lock), and asyncpg rolls back a transaction left open."""


async def _migrate(conn: Any) -> None:
    """Applies the migrations this database lacks, in one transaction, one opener at
    a time; refuses a database whose schema is newer than this code."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
        if await conn.fetchval("SELECT to_regclass('schema_migrations')") is None:
            await conn.execute(
                "CREATE TABLE schema_migrations "
                "(version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL)"
            )
        current = await conn.fetchval("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")
        if current > len(MIGRATIONS):
            raise StoreError(
                f"the database schema is at version {current}, newer than this gpu-arbiter "
                f"knows ({len(MIGRATIONS)}): upgrade gpu-arbiter"
            )
        for version in range(current + 1, len(MIGRATIONS) + 1):
            await conn.execute(MIGRATIONS[version - 1])
            await conn.execute(
                "INSERT INTO schema_migrations (version, applied_at) VALUES ($1, now())", version
            )
            log.info("applied schema migration %d", version)
