"""The PostgreSQL store beyond the contract: migrations, leadership, fencing, failures."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from gpu_arbiter.core import Gpu, LeaseState, Request, WorkerStatus
from gpu_arbiter.store import (
    MIGRATIONS,
    Batch,
    Event,
    Fenced,
    GatewayNameRecord,
    Leader,
    LeaseRecord,
    OperationRecord,
    PostgresStore,
    StoreError,
    TokenRecord,
    WorkerRecord,
)
from tests.integration.conftest import wait_for
from tests.postgres import Relay, admin_sql, with_database

TTL_S = 2.0  # short enough for a quick takeover, long enough for a busy machine to renew
SECRET = "pw-Zq8-not-to-be-shown"
OpenStore = Callable[..., PostgresStore]


@pytest.fixture
def open_store(postgres_dsn: str) -> Iterator[OpenStore]:
    """``open_store(dsn=None, **options)``: a store on the test's database, closed after."""
    opened: list[PostgresStore] = []

    def make(
        dsn: str | None = None, timeout_s: float = 10.0, step_down_on_close: bool = False
    ) -> PostgresStore:
        store = PostgresStore(
            dsn or postgres_dsn, timeout_s=timeout_s, step_down_on_close=step_down_on_close
        )
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def _pending(rid: str) -> LeaseRecord:
    return LeaseRecord(request=Request.build(rid, vram_mb="1G"), state=LeaseState.PENDING)


def _batch(rid: str, next_token: int = 1) -> Batch:
    record = _pending(rid)
    return Batch(leases={record.id: record}, meta={"next_token": next_token})


def _worker(name: str, zone: str = "a") -> WorkerRecord:
    gpus = (Gpu(index=0, total_mb=24576, arch="sm_86", worker=name),)
    return WorkerRecord(name=name, status=WorkerStatus.ONLINE, gpus=gpus, labels={"zone": zone})


def _tables(dsn: str) -> dict[str, list[tuple[object, ...]]]:
    """Every row of every table the store writes (the leadership row aside)."""
    tables = {
        "workers": "SELECT name, doc FROM workers ORDER BY name",
        "leases": "SELECT id, state, final, owner, idempotency_key, doc FROM leases ORDER BY id",
        "events": "SELECT seq, doc FROM events ORDER BY seq",
        "meta": "SELECT key, value FROM meta ORDER BY key",
        "operations": "SELECT id, running, doc FROM operations ORDER BY id",
        "gateway_names": "SELECT name, owner, worker, taken_at FROM gateway_names ORDER BY name",
    }
    return {name: [tuple(row) for row in admin_sql(dsn, sql)] for name, sql in tables.items()}


def _with_password(dsn: str, password: str) -> str:
    parts = urlsplit(dsn)
    netloc = f"{parts.username or 'postgres'}:{password}@{parts.hostname}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _database(dsn: str) -> str:
    return urlsplit(dsn).path.lstrip("/")


def _migrations(dsn: str) -> list[tuple[int, object]]:
    rows = admin_sql(dsn, "SELECT version, applied_at FROM schema_migrations ORDER BY version")
    return [(row["version"], row["applied_at"]) for row in rows]


# ---------------------------------------------------------------------- migrations


def test_a_fresh_database_gets_every_migration_once(
    postgres_dsn: str, open_store: OpenStore
) -> None:
    open_store().close()
    first = _migrations(postgres_dsn)
    assert [version for version, _ in first] == list(range(1, len(MIGRATIONS) + 1))
    store = open_store()
    assert _migrations(postgres_dsn) == first  # opening again applies nothing
    assert store.load().leases == ()


def test_stores_opened_at_once_both_succeed(postgres_dsn: str) -> None:
    start = threading.Barrier(2)

    def open_and_close() -> None:
        start.wait()
        PostgresStore(postgres_dsn).close()

    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(open_and_close) for _ in range(2)]:
            future.result(timeout=60)
    versions = [version for version, _ in _migrations(postgres_dsn)]
    assert versions == list(range(1, len(MIGRATIONS) + 1))


def test_a_database_newer_than_the_code_is_refused(
    postgres_dsn: str, open_store: OpenStore
) -> None:
    open_store().close()
    newer = len(MIGRATIONS) + 1
    admin_sql(
        postgres_dsn, "INSERT INTO schema_migrations VALUES ($1, now())", newer
    )  # a later release migrated it
    with pytest.raises(StoreError, match=f"schema is at version {newer}, newer"):
        open_store()


# ---------------------------------------------------------------------- leadership


def test_one_leader_at_a_time_while_it_renews(open_store: OpenStore) -> None:
    first, second = open_store(), open_store()
    assert first.leader() == Leader(epoch=0, holder=None, url=None, alive=False)
    assert first.try_lead("a", "http://a:7070", TTL_S) == 1
    assert first.try_lead("a", "http://a:7070", TTL_S) == 1  # already leading
    assert second.try_lead("b", "http://b:7070", TTL_S) is None
    threading.Event().wait(TTL_S * 1.5)  # past the first term: only renewals keep it
    assert second.try_lead("b", "http://b:7070", TTL_S) is None
    assert second.leader() == Leader(epoch=1, holder="a", url="http://a:7070", alive=True)
    assert (first.epoch, second.epoch) == (1, None)


def test_a_standby_takes_over_when_the_leader_dies(open_store: OpenStore) -> None:
    first, second = open_store(), open_store()
    assert first.try_lead("a", None, TTL_S) == 1
    first.commit(_batch("l-1", next_token=5))
    first.close()  # dies: no step_down, no more renewals
    epoch = wait_for(lambda: second.try_lead("b", None, TTL_S), 10 * TTL_S, "the takeover")
    assert epoch == 2
    snapshot = second.load()
    assert [r.id for r in snapshot.leases] == ["l-1"]
    assert snapshot.meta["next_token"] == 5
    second.commit(_batch("l-2", next_token=6))
    assert second.lease("l-2") is not None


def test_a_deposed_leader_commits_nothing(postgres_dsn: str, open_store: OpenStore) -> None:
    first, second = open_store(), open_store()
    lost = threading.Event()
    assert first.try_lead("a", None, 60.0, on_lost=lost.set) == 1
    first.commit(_batch("l-1"))
    # Its term lapses without it noticing (a partition, a long pause), and a standby
    # takes over.
    admin_sql(postgres_dsn, "UPDATE leadership SET expires_at = now() WHERE id = 1")
    assert second.try_lead("b", None, 60.0) == 2
    version = second.version()
    with pytest.raises(Fenced, match=r"not the leader \(epoch 1 is over\)"):
        first.commit(_batch("l-2", next_token=99))
    assert second.lease("l-2") is None
    assert second.load().meta == {"next_token": 1}
    assert second.version() == version
    assert first.epoch is None
    assert lost.is_set()


def test_a_deposed_leader_writes_nothing_of_a_batch_touching_every_table(
    postgres_dsn: str, open_store: OpenStore
) -> None:
    first, second = open_store(), open_store()
    assert first.try_lead("a", None, 60.0) == 1
    first.commit(
        Batch(
            leases=_batch("l-1").leases,
            workers={"box-1": _worker("box-1"), "box-2": _worker("box-2")},
            events=[Event(1, 1.0, "lease.created", "l-1")],
            meta={"next_token": 1},
            gateway_names={"gw-1": GatewayNameRecord("gw-1", "gateway-a", "box-1", 1.0)},
        )
    )
    admin_sql(postgres_dsn, "UPDATE leadership SET expires_at = now() WHERE id = 1")
    assert second.try_lead("b", None, 60.0) == 2
    before = _tables(postgres_dsn)
    operation = OperationRecord("op-1", "update", "box-1", "running", 1.0)
    cancelled = replace(_pending("l-1"), state=LeaseState.CANCELLED)
    stale = Batch(
        leases={**_batch("l-2").leases, "l-1": cancelled},
        workers={"box-1": _worker("box-1", zone="b"), "box-3": _worker("box-3")},
        removed_workers={"box-2"},
        events=[Event(2, 2.0, "lease.created", "l-2")],
        meta={"next_token": 99, "paused": 1},
        operations={operation.id: operation},
        gateway_names={
            "gw-1": None,
            "gw-2": GatewayNameRecord("gw-2", "gateway-b", "box-3", 2.0),
        },
    )
    with pytest.raises(Fenced, match=r"epoch 1 is over"):
        first.commit(stale)
    assert _tables(postgres_dsn) == before


def test_a_worker_removed_and_written_in_one_batch_is_kept_as_written(
    open_store: OpenStore,
) -> None:
    store = open_store()
    assert store.try_lead("a", None, 60.0) == 1
    store.commit(Batch(workers={"box-1": _worker("box-1"), "box-2": _worker("box-2")}))
    rewritten = _worker("box-1", zone="b")
    store.commit(Batch(workers={"box-1": rewritten}, removed_workers={"box-1", "box-2"}))
    assert store.load().workers == (rewritten,)  # as SQLite: deleted, then written


def test_a_leader_that_sees_the_epoch_move_on_stops_leading(
    postgres_dsn: str, open_store: OpenStore
) -> None:
    first, second = open_store(), open_store()
    lost = threading.Event()
    assert first.try_lead("a", None, TTL_S, on_lost=lost.set) == 1
    admin_sql(postgres_dsn, "UPDATE leadership SET expires_at = now() WHERE id = 1")
    assert second.try_lead("b", None, 60.0) == 2
    assert lost.wait(10 * TTL_S)  # its next renewal finds epoch 2
    assert first.epoch is None
    with pytest.raises(Fenced, match="does not lead"):
        first.commit(_batch("l-1"))


def test_step_down_hands_over_at_once(open_store: OpenStore) -> None:
    first, second = open_store(), open_store()
    lost = threading.Event()
    assert first.try_lead("a", None, 60.0, on_lost=lost.set) == 1
    first.step_down()
    assert first.epoch is None
    assert not first.leader().alive
    assert second.try_lead("b", None, 60.0) == 2
    with pytest.raises(Fenced):
        first.commit(_batch("l-1"))
    assert not lost.is_set()  # stepping down is not a loss
    first.step_down()  # not leading: nothing to do


def test_a_store_closed_cleanly_can_hand_over_at_once(open_store: OpenStore) -> None:
    first, second = open_store(step_down_on_close=True), open_store()
    assert first.try_lead("a", None, 60.0) == 1
    first.close()
    assert second.try_lead("b", None, 60.0) == 2


def test_a_store_that_never_led_cannot_commit_but_may_add_tokens(open_store: OpenStore) -> None:
    store = open_store()
    with pytest.raises(Fenced, match="does not lead"):
        store.commit(_batch("l-1"))
    assert store.lease("l-1") is None
    token = TokenRecord(id="t1", digest="ab" * 32, role="client", created_at=1.0)
    store.put_token(token)
    assert store.token(token.digest) == token


def test_a_failed_batch_writes_nothing_and_the_leader_goes_on(open_store: OpenStore) -> None:
    store = open_store()
    assert store.try_lead("a", None, 60.0) == 1
    store.commit(Batch(events=[Event(1, 1.0, "x")]))
    version = store.version()
    duplicate = Batch(leases=_batch("l-1").leases, events=[Event(1, 1.0, "x")])
    with pytest.raises(StoreError, match="cannot write") as failed:
        store.commit(duplicate)
    assert not isinstance(failed.value, Fenced)
    assert store.lease("l-1") is None
    assert store.version() == version
    assert store.epoch == 1
    store.commit(_batch("l-1"))
    assert store.lease("l-1") is not None


def test_version_grows_with_every_commit(open_store: OpenStore) -> None:
    leader, standby = open_store(), open_store()
    assert leader.try_lead("a", None, 60.0) == 1
    before = standby.version()
    leader.commit(_batch("l-1"))
    leader.commit(Batch(meta={"paused": 1}))
    assert standby.version() == before + 2


def test_try_lead_refuses_a_non_positive_ttl(open_store: OpenStore) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        open_store().try_lead("a", None, 0.0)


# ---------------------------------------------------------------------- failures


@contextlib.contextmanager
def _leadership_row_locked(dsn: str) -> Iterator[int]:
    """Holds the leadership row locked from another connection; yields its pid."""
    locked, release = threading.Event(), threading.Event()
    pids: list[int] = []

    async def hold() -> None:
        conn = await asyncpg.connect(dsn, timeout=30)
        try:
            async with conn.transaction():
                pids.append(await conn.fetchval("SELECT pg_backend_pid()"))
                await conn.execute("SELECT 1 FROM leadership WHERE id = 1 FOR UPDATE")
                locked.set()
                while not release.is_set():
                    await asyncio.sleep(0.02)
        finally:
            await conn.close()

    thread = threading.Thread(target=asyncio.run, args=(hold(),))
    thread.start()
    try:
        assert locked.wait(30)
        yield pids[0]
    finally:
        release.set()
        thread.join(30)


def _lock_waiters(dsn: str) -> list[int]:
    rows = admin_sql(
        dsn,
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'",
    )
    return [row["pid"] for row in rows]


def test_a_cut_connection_fails_the_call_and_the_store_reconnects(
    postgres_dsn: str, open_store: OpenStore
) -> None:
    dsn = _with_password(postgres_dsn, SECRET)
    store = open_store(dsn)
    assert store.try_lead("a", None, 60.0) == 1
    with _leadership_row_locked(postgres_dsn), ThreadPoolExecutor(1) as pool:
        committing = pool.submit(store.commit, _batch("l-1"))
        waiters = wait_for(lambda: _lock_waiters(postgres_dsn), 30, "the commit to wait")
        assert store.lease("l-1") is None  # reads go on while a commit waits
        assert store.version() == 0
        cut = "SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) pid"
        admin_sql(postgres_dsn, cut, waiters)
        with pytest.raises(StoreError, match="cannot write postgresql://") as failed:
            committing.result(timeout=30)
    assert SECRET not in str(failed.value)
    assert store.lease("l-1") is None  # a read reconnects; nothing of the batch was written
    store.commit(_batch("l-2"))
    assert store.lease("l-2") is not None
    assert store.epoch == 1


def test_a_commit_delivered_late_after_a_take_over_writes_nothing(
    postgres_dsn: str, open_store: OpenStore
) -> None:
    """The partition neither end notices: the leader's commit is held in the network, the
    leader gives up on it, a standby takes over, and then the commit reaches the
    database, under the old epoch. The fence makes it write nothing (I9)."""
    relay = Relay(postgres_dsn)
    try:
        old = open_store(relay.dsn, timeout_s=1.0)
        assert old.try_lead("old", None, TTL_S) == 1
        old.commit(_batch("l-1"))
        relay.freeze()
        with pytest.raises(StoreError, match="whether it was written is unknown"):
            old.commit(_batch("l-2", next_token=2))
        new = open_store()
        assert wait_for(lambda: new.try_lead("new", None, 60.0), 30, "the old term to lapse") == 2
        ports = relay.upstream_ports()
        relay.thaw()  # the held commit reaches the database now
        old.close()  # its connections end once the database has read what they carried
        wait_for(lambda: not _backends(postgres_dsn, ports), 30, "the old connections to end")
        assert new.lease("l-1") is not None
        assert new.lease("l-2") is None
        new.commit(_batch("l-3", next_token=3))
        assert new.lease("l-3") is not None
    finally:
        relay.close()


def _backends(dsn: str, client_ports: list[int]) -> list[int]:
    rows = admin_sql(
        dsn,
        "SELECT pid FROM pg_stat_activity WHERE client_port = ANY($1::int[])",
        client_ports,
    )
    return [row["pid"] for row in rows]


def test_a_commit_that_runs_too_long_is_cancelled_by_the_database(
    postgres_dsn: str, open_store: OpenStore
) -> None:
    store = open_store(timeout_s=1.0)
    assert store.try_lead("a", None, 60.0) == 1
    with (
        _leadership_row_locked(postgres_dsn),
        pytest.raises(StoreError, match=r"not done within 1 s.*nothing of it was written"),
    ):
        store.commit(_batch("l-1"))
    # the lock is gone now: a commit the caller had merely stopped waiting for would land
    time.sleep(0.5)
    assert store.lease("l-1") is None
    store.commit(_batch("l-2"))
    assert store.lease("l-2") is not None


def test_a_commit_that_gets_no_answer_is_reported_as_unknown(
    postgres_dsn: str, open_store: OpenStore
) -> None:
    store = open_store(timeout_s=1.0)
    assert store.try_lead("a", None, 60.0) == 1
    with _leadership_row_locked(postgres_dsn), ThreadPoolExecutor(1) as pool:
        committing = pool.submit(store.commit, _batch("l-1"))
        (backend,) = wait_for(lambda: _lock_waiters(postgres_dsn), 30, "the commit to wait")
        try:
            os.kill(backend, signal.SIGSTOP)  # the database stops answering
        except (PermissionError, ProcessLookupError):
            pytest.skip("the database's processes are not this test's to signal")
        try:
            with pytest.raises(StoreError, match="no answer within 3 s; whether it was written"):
                committing.result(timeout=30)
        finally:
            os.kill(backend, signal.SIGCONT)
    store.commit(_batch("l-2"))  # the store goes on, on the same or a new connection
    assert store.lease("l-2") is not None


def test_an_unreachable_database_fails_calls_and_ends_the_term(
    postgres_server: str, postgres_dsn: str, open_store: OpenStore
) -> None:
    store = open_store(timeout_s=5.0)
    lost = threading.Event()
    assert store.try_lead("a", None, TTL_S, on_lost=lost.set) == 1
    name = _database(postgres_dsn)
    admin_sql(postgres_server, f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
    try:
        admin_sql(
            postgres_server,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
            name,
        )
        with pytest.raises(StoreError, match="cannot read"):
            store.lease("l-1")
        assert lost.wait(10 * TTL_S)  # renewals failed until the term would have expired
        assert store.epoch is None
    finally:
        admin_sql(postgres_server, f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
    assert store.lease("l-1") is None  # reachable again: reads work
    assert store.try_lead("a", None, TTL_S) == 2


@pytest.mark.parametrize("where", ["no_database", "no_server"])
def test_errors_never_show_the_password(postgres_server: str, where: str) -> None:
    dsn = _with_password(postgres_server, SECRET)
    if where == "no_database":
        dsn = with_database(dsn, "no_such_database")
    else:
        parts = urlsplit(dsn)
        dsn = urlunsplit(parts._replace(netloc=f"postgres:{SECRET}@127.0.0.1:1"))
    with pytest.raises(StoreError, match=r"cannot open postgresql://127\.0\.0\.1:\d+/") as failed:
        PostgresStore(dsn, timeout_s=5.0)
    assert SECRET not in str(failed.value)


def test_a_closed_store_says_so(open_store: OpenStore) -> None:
    store = open_store()
    store.close()
    store.close()  # twice is fine
    with pytest.raises(StoreError, match="closed"):
        store.load()
