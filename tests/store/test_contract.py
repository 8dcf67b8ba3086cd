"""One contract, every store: what is committed is what is loaded, in one transaction."""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpu_arbiter.core import Constraints, Gpu, GpuId, Lease, LeaseState, Request, WorkerStatus
from gpu_arbiter.store import (
    Batch,
    CatalogueRevision,
    Event,
    GatewayNameRecord,
    LeaseRecord,
    MemoryStore,
    OperationRecord,
    OperationStep,
    PostgresStore,
    SqliteStore,
    Store,
    StoreError,
    TokenRecord,
    WorkerRecord,
)
from gpu_arbiter.store import sqlite as sqlite_store
from gpu_arbiter.store.sqlite import CHECKPOINT_EVERY


def _open(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if kind == "memory":
        return MemoryStore(event_history=20)
    if kind == "sqlite":
        return SqliteStore(tmp_path / "state.db", event_history=20)
    shared = PostgresStore(request.getfixturevalue("postgres_dsn"), event_history=20)
    assert shared.try_lead("contract", None, ttl_s=60) == 1  # only a leader commits
    return shared


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    made = _open(request.param, request, tmp_path)
    yield made
    made.close()


def _request(rid: str, key: str | None = None) -> Request:
    return Request.build(
        rid,
        vram_mb="2G",
        priority="interactive",
        constraints=Constraints.build(gpu_arch=["sm_86"], labels={"zone": "a"}),
        holder="chat",
        metadata={"model": "llama"},
        idempotency_key=key,
    )


def _worker(name: str = "box-1") -> WorkerRecord:
    gpus = (Gpu(index=0, total_mb=24576, arch="sm_86", worker=name, headroom_mb=256),)
    return WorkerRecord(name=name, status=WorkerStatus.ONLINE, gpus=gpus, labels={"zone": "a"})


def _granted(rid: str, token: int) -> LeaseRecord:
    request = replace(_request(rid), seq=token, submitted_at=1.0)
    lease = Lease(
        request=request,
        gpus=(GpuId("box-1", 0),),
        token=token,
        state=LeaseState.LOADING,
        granted_at=2.0,
        expires_at=32.0,
        load_deadline=302.0,
    )
    return LeaseRecord(request=request, state=lease.state, owner="tok-1", lease=lease)


def test_empty_store_loads_nothing(store: Store) -> None:
    snapshot = store.load()
    assert snapshot.workers == ()
    assert snapshot.leases == ()
    assert snapshot.last_event_seq == 0


def test_committed_records_load_back_equal(store: Store) -> None:
    worker = _worker()
    held = _granted("l-1", 7)
    pending = LeaseRecord(request=replace(_request("l-2"), seq=9), state=LeaseState.PENDING)
    batch = Batch(
        leases={held.id: held, pending.id: pending},
        workers={worker.name: worker},
        events=[Event(1, 2.0, "lease.granted", "l-1", "box-1", {"token": 7})],
        meta={"next_token": 8},
    )
    store.commit(batch)
    snapshot = store.load()
    assert snapshot.workers == (worker,)
    assert sorted(snapshot.leases, key=lambda r: r.id) == [held, pending]
    assert snapshot.meta["next_token"] == 8
    assert snapshot.last_event_seq == 1
    assert store.lease("l-1") == held


def test_final_leases_are_kept_but_not_loaded_as_live(store: Store) -> None:
    held = _granted("l-1", 1)
    store.commit(Batch(leases={held.id: held}))
    assert held.lease is not None
    ended = replace(held.lease, state=LeaseState.RELEASED, ended_at=5.0)
    store.commit(
        Batch(leases={held.id: replace(held, state=LeaseState.RELEASED, lease=ended, ended_at=5.0)})
    )
    assert store.load().leases == ()
    record = store.lease("l-1")
    assert record is not None
    assert record.state is LeaseState.RELEASED


def test_a_shrunk_lease_on_exact_gpus_round_trips(store: Store) -> None:
    """The sleep tier's state: a lease shrunk below its grant, asked for on exact GPUs,
    and the wake's lease that must never preempt it."""
    held = _granted("l-1", 1)
    assert held.lease is not None
    exact = Constraints.build(gpu_ids=["box-1:0", "box-1:1"], never_preempt=["l-0"])
    request = replace(held.request, constraints=exact, gpus=2)
    lease = replace(
        held.lease,
        request=request,
        gpus=(GpuId("box-1", 0), GpuId("box-1", 1)),
        state=LeaseState.ACTIVE,
        shrunk_to_mb=300,
    )
    held = replace(held, request=request, state=LeaseState.ACTIVE, lease=lease)
    store.commit(Batch(leases={held.id: held}))
    assert store.load().leases == (held,)
    loaded = store.lease("l-1")
    assert loaded == held
    assert loaded is not None and loaded.lease is not None
    assert (loaded.lease.vram_mb, loaded.lease.granted_mb) == (300, 2048)
    assert loaded.request.constraints.gpu_ids == (GpuId("box-1", 0), GpuId("box-1", 1))
    assert loaded.request.constraints.never_preempt == ("l-0",)


def test_infinite_expiry_round_trips(store: Store) -> None:
    held = _granted("l-1", 1)
    assert held.lease is not None
    held = replace(held, lease=replace(held.lease, expires_at=math.inf))
    store.commit(Batch(leases={held.id: held}))
    loaded = store.lease("l-1")
    assert loaded is not None
    assert loaded.lease is not None
    assert loaded.lease.expires_at == math.inf


def test_idempotency_key_is_scoped_to_its_owner(store: Store) -> None:
    mine = LeaseRecord(request=_request("l-1", key="k"), state=LeaseState.PENDING, owner="a")
    store.commit(Batch(leases={mine.id: mine}))
    found = store.lease_by_key("a", "k")
    assert found is not None
    assert found.id == "l-1"
    assert store.lease_by_key("b", "k") is None
    assert store.lease_by_key("a", "other") is None


def test_removed_workers_are_gone(store: Store) -> None:
    store.commit(Batch(workers={"box-1": _worker("box-1"), "box-2": _worker("box-2")}))
    store.commit(Batch(removed_workers={"box-1"}))
    assert [w.name for w in store.load().workers] == ["box-2"]


def test_events_are_ordered_and_history_is_bounded(store: Store) -> None:
    for seq in range(1, 301):
        store.commit(Batch(events=[Event(seq, float(seq), "lease.released", f"l-{seq}")]))
    after = store.events_after(290, 100)
    assert [e.seq for e in after] == list(range(291, 301))
    assert store.events_after(298, 1)[0].seq == 299
    retained = store.events_after(0, 1000)
    assert len(retained) < 300
    assert retained[-1].seq == 300


def test_tokens_are_found_by_digest(store: Store) -> None:
    token = TokenRecord(id="t1", digest="ab" * 32, role="worker", worker="box-1", created_at=1.0)
    store.put_token(token)
    assert store.token("ab" * 32) == token
    assert store.token("cd" * 32) is None


def _ended(rid: str, ended_at: float, key: str | None = None) -> LeaseRecord:
    request = _request(rid, key=key)
    return LeaseRecord(request, LeaseState.RELEASED, owner="a", ended_at=ended_at)


def test_prune_forgets_only_final_leases_that_ended_before_the_cutoff(store: Store) -> None:
    live = LeaseRecord(request=_request("live"), state=LeaseState.PENDING, owner="a")
    old = [_ended(f"old-{i}", 10.0 + i, key=f"k-{i}") for i in range(5)]
    recent = _ended("recent", 100.0, key="k-recent")
    store.commit(Batch(leases={r.id: r for r in [live, *old, recent]}))

    assert store.prune(50.0, limit=3) == 3  # a bounded batch at a time
    assert store.prune(50.0, limit=3) == 2
    assert store.prune(50.0, limit=3) == 0

    assert all(store.lease(r.id) is None for r in old)
    assert store.lease_by_key("a", "k-0") is None  # the key is forgotten with its lease
    assert store.lease("recent") is not None
    assert store.lease_by_key("a", "k-recent") is not None
    assert [r.id for r in store.load().leases] == ["live"]


def test_tokens_are_listed_and_revoked_by_id(store: Store) -> None:
    first = TokenRecord(id="client-1", digest="ab" * 32, role="client", created_at=1.0)
    second = TokenRecord(id="worker-2", digest="cd" * 32, role="worker", worker="b", created_at=2.0)
    store.put_token(second)
    store.put_token(first)
    assert store.tokens() == [first, second]

    assert store.revoke_token("client-1") is True
    assert store.revoke_token("client-1") is False
    assert store.token("ab" * 32) is None
    assert store.tokens() == [second]


def test_sqlite_state_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = SqliteStore(path)
    held = _granted("l-1", 3)
    first.commit(Batch(leases={held.id: held}, meta={"next_token": 4}))
    first.close()
    second = SqliteStore(path)
    try:
        snapshot = second.load()
        assert snapshot.leases == (held,)
        assert snapshot.meta == {"next_token": 4}
    finally:
        second.close()


def test_sqlite_failed_batch_writes_nothing(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    try:
        store.commit(Batch(events=[Event(1, 1.0, "x")]))
        duplicate = _granted("l-9", 9)
        with pytest.raises(Exception, match="cannot write"):
            store.commit(Batch(leases={duplicate.id: duplicate}, events=[Event(1, 1.0, "x")]))
        assert store.lease("l-9") is None
    finally:
        store.close()


def test_operations_round_trip_and_running_ones_load(store: Store) -> None:
    step = OperationStep("drain", "started", 1.0, "graceful")
    running = OperationRecord("op-1", "update", "box-1", "running", 1.0, (step,), from_version="1")
    failed = replace(running, id="op-2", state="failed", reason="exit 1")
    store.commit(Batch(operations={"op-1": running, "op-2": failed}))
    assert store.operation("op-1") == running
    assert store.operation("op-2") == failed
    assert store.operation("op-3") is None
    assert store.load().operations == (running,)


def test_merged_batches_store_what_the_batches_in_order_store(store: Store) -> None:
    """Group commit: one transaction of several batches leaves what committing them one
    after the other leaves (a worker a later batch removes is gone, a lease two batches
    write is the later's, events keep their order)."""
    first = _granted("l-1", 1)
    ended = replace(first, state=LeaseState.RELEASED, ended_at=5.0)
    batches = [
        Batch(workers={"box-1": _worker("box-1")}, leases={"l-1": first}, meta={"n": 1}),
        Batch(removed_workers={"box-1"}, events=[Event(1, 1.0, "a")], meta={"n": 2}),
        Batch(workers={"box-2": _worker("box-2")}, leases={"l-1": ended}),
        Batch(events=[Event(2, 2.0, "b")]),
    ]
    merged = Batch()
    for batch in batches:
        merged.merge(batch)
    store.commit(merged)
    one_by_one = MemoryStore()
    for batch in batches:
        one_by_one.commit(batch)
    assert store.load() == one_by_one.load()
    assert store.lease("l-1") == ended
    assert [e.kind for e in store.events_after(0, 10)] == ["a", "b"]


def test_gateway_names_are_taken_and_forgotten(store: Store) -> None:
    """A name's owner is written when taken, replaced when another token takes it, and
    deleted when forgotten; a batch may forget one name and take another."""
    first = GatewayNameRecord("gw-x", "gateway-a", "box-1", 10.0)
    other = GatewayNameRecord("gw-y", "admin", None, 11.0)
    store.commit(Batch(gateway_names={"gw-x": first, "gw-y": other}))
    assert store.load().gateway_names == (first, other)

    taken_again = GatewayNameRecord("gw-x", "gateway-b", "box-2", 20.0)
    store.commit(Batch(gateway_names={"gw-x": taken_again}))
    store.commit(Batch(gateway_names={"gw-y": None, "gw-z": None}))  # gw-z: held by none
    assert store.load().gateway_names == (taken_again,)


def test_merged_batches_take_and_forget_gateway_names_in_order(store: Store) -> None:
    taken = GatewayNameRecord("gw-x", "gateway-a", "box-1", 1.0)
    again = GatewayNameRecord("gw-x", "gateway-b", "box-1", 3.0)
    batches = [
        Batch(gateway_names={"gw-x": taken, "gw-y": replace(taken, name="gw-y")}),
        Batch(gateway_names={"gw-x": None}),
        Batch(gateway_names={"gw-y": None}),
        Batch(gateway_names={"gw-x": again}),
    ]
    merged = Batch()
    for batch in batches:
        merged.merge(batch)
    store.commit(merged)
    assert store.load().gateway_names == (again,)


def test_sqlite_gateway_names_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = SqliteStore(path)
    held = GatewayNameRecord("gw-x", "gateway-a", "box-1", 10.0)
    first.commit(Batch(gateway_names={"gw-x": held}))
    first.close()
    second = SqliteStore(path)
    try:
        assert second.load().gateway_names == (held,)
    finally:
        second.close()


def test_sqlite_database_without_the_gateway_names_table_gains_it(tmp_path: Path) -> None:
    """A database of a version before gateway names were stored opens, and takes them."""
    path = tmp_path / "state.db"
    SqliteStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE gateway_names")
    db.close()
    store = SqliteStore(path)
    try:
        assert store.load().gateway_names == ()
        held = GatewayNameRecord("gw-x", "gateway-a", None, 1.0)
        store.commit(Batch(gateway_names={"gw-x": held}))
        assert store.load().gateway_names == (held,)
    finally:
        store.close()


def _revision(number: int, text: str = "[models.a]\n") -> CatalogueRevision:
    return CatalogueRevision(number, text, f"{number:064x}", 100.0 + number, "admin", "c.toml")


def test_catalogue_revisions_round_trip_oldest_first(store: Store) -> None:
    first, second = _revision(1), _revision(2, "# é, and a long one\n" + "x" * 100_000)
    store.commit(Batch(catalogue=[first]))
    store.commit(Batch(catalogue=[second], meta={"n": 1}))
    assert store.load().catalogue == (first, second)


def test_a_catalogue_revision_is_written_once_and_a_batch_rewriting_one_writes_nothing(
    store: Store,
) -> None:
    store.commit(Batch(catalogue=[_revision(1)]))
    again = Batch(catalogue=[_revision(1, "other")], meta={"n": 7}, events=[Event(1, 1.0, "x")])
    with pytest.raises(StoreError):
        store.commit(again)
    snapshot = store.load()
    assert snapshot.catalogue == (_revision(1),)
    assert "n" not in snapshot.meta and snapshot.last_event_seq == 0


def test_merged_batches_keep_the_catalogues_revisions_in_order(store: Store) -> None:
    merged = Batch()
    for batch in (Batch(catalogue=[_revision(1)]), Batch(), Batch(catalogue=[_revision(2)])):
        merged.merge(batch)
    store.commit(merged)
    assert [r.revision for r in store.load().catalogue] == [1, 2]


def test_sqlite_catalogue_survives_reopening_and_an_older_database_gains_its_table(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    SqliteStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE catalogue")  # as a database of a version before catalogues
    db.close()
    first = SqliteStore(path)
    first.commit(Batch(catalogue=[_revision(1), _revision(2)]))
    first.close()
    second = SqliteStore(path)
    try:
        assert second.load().catalogue == (_revision(1), _revision(2))
    finally:
        second.close()


class _Blocking(dict[str, LeaseRecord]):
    """Leases whose encoding (inside the transaction) waits until ``go`` is set."""

    def __init__(self, records: dict[str, LeaseRecord], inside: threading.Event) -> None:
        super().__init__(records)
        self.inside = inside
        self.go = threading.Event()

    def values(self) -> Any:
        self.inside.set()
        assert self.go.wait(30)
        return super().values()


def test_sqlite_reads_never_see_a_commit_in_flight_on_another_thread(tmp_path: Path) -> None:
    """The commit thread of group commit writes while the event loop reads: a read
    sees what was committed, never a transaction still open."""
    store = SqliteStore(tmp_path / "state.db")
    inside = threading.Event()
    leases = _Blocking({"l-1": _granted("l-1", 1)}, inside)
    batch = Batch(workers={"box-1": _worker()}, leases=leases)
    writer = threading.Thread(target=store.commit, args=(batch,))
    try:
        writer.start()
        assert inside.wait(30)  # the worker is written, the transaction open
        assert store.load().workers == ()
        assert store.lease("l-1") is None
    finally:
        leases.go.set()
        writer.join(30)
    assert [w.name for w in store.load().workers] == ["box-1"]
    store.close()


def test_sqlite_log_is_copied_into_the_database_by_the_checkpointer_not_by_a_commit(
    tmp_path: Path,
) -> None:
    """No commit copies the write-ahead log back (SQLite's own checkpoint would, and flush
    the database file inside that commit): every CHECKPOINT_EVERY commits the
    checkpointer's thread does, so that the database file itself (read without the log)
    holds what was committed; closing the store ends that thread."""
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    try:
        for k in range(CHECKPOINT_EVERY - 1):
            lease = _granted(f"l-{k}", k + 1)
            store.commit(Batch(leases={lease.id: lease}))
        assert _in_database_file(path) == 0  # all of it still in the log
        last = _granted("l-last", CHECKPOINT_EVERY)
        store.commit(Batch(leases={last.id: last}))
        guard = time.monotonic() + 30  # the thread is woken at once; this only bounds a hang
        found = _in_database_file(path)
        while found != CHECKPOINT_EVERY and time.monotonic() < guard:
            time.sleep(0.01)  # nothing to wait on: the checkpoint is SQLite's, on its thread
            found = _in_database_file(path)
        assert found == CHECKPOINT_EVERY
    finally:
        store.close()
    assert not [t for t in threading.enumerate() if t.name == "sqlite-checkpoint"]


def test_sqlite_log_that_every_checkpoint_left_behind_is_emptied_once_it_is_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that holds an old snapshot keeps every passive checkpoint from copying
    the whole log, so it never starts again and grows with every commit (as a steady
    stream of commits does). Once it is LOG_LIMIT_PAGES long and the reader is gone, the
    checkpointer copies and empties it."""
    monkeypatch.setattr(sqlite_store, "LOG_LIMIT_PAGES", 64)
    path = tmp_path / "state.db"
    log_file = tmp_path / "state.db-wal"
    store = SqliteStore(path)
    reader = sqlite3.connect(path)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM leases").fetchone()  # an old snapshot, held
        for k in range(2 * CHECKPOINT_EVERY):
            lease = _granted(f"l-{k}", k + 1)
            store.commit(Batch(leases={lease.id: lease}))
        grown = log_file.stat().st_size
        assert grown > 64 * 4096
        reader.rollback()
        for k in range(2 * CHECKPOINT_EVERY, 3 * CHECKPOINT_EVERY):
            lease = _granted(f"l-{k}", k + 1)
            store.commit(Batch(leases={lease.id: lease}))
        guard = time.monotonic() + 30  # the thread is woken at once; this only bounds a hang
        while log_file.stat().st_size >= 64 * 4096 and time.monotonic() < guard:
            time.sleep(0.01)  # nothing to wait on: the checkpoint is SQLite's, on its thread
        assert log_file.stat().st_size < 64 * 4096
        assert len(store.load().leases) == 3 * CHECKPOINT_EVERY
    finally:
        reader.close()
        store.close()


def _in_database_file(path: Path) -> int:
    """Leases in the database file alone, its write-ahead log ignored; -1 while the file
    cannot be read so (this reader takes no lock: a checkpoint may be writing it)."""
    db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    try:
        return int(db.execute("SELECT COUNT(*) FROM leases").fetchone()[0])
    except sqlite3.OperationalError as error:
        if "no such table" in str(error):  # the tables themselves are still in the log
            return 0
        return -1
    except sqlite3.DatabaseError:  # read half-written
        return -1
    finally:
        db.close()


def test_sqlite_a_checkpoint_that_fails_is_logged_and_commits_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpointer cannot open its connection (any error of SQLite's): it says so,
    and every commit still lands, in the log, to be loaded back whole."""
    store = SqliteStore(tmp_path / "state.db")

    def refuse(*args: object, **kwargs: object) -> sqlite3.Connection:
        raise sqlite3.OperationalError("unable to open database file")

    monkeypatch.setattr(sqlite3, "connect", refuse)  # opened already: only its own refused
    try:
        with caplog.at_level("WARNING", logger="gpu_arbiter.store"):
            for k in range(CHECKPOINT_EVERY + 1):
                lease = _granted(f"l-{k}", k + 1)
                store.commit(Batch(leases={lease.id: lease}))
            guard = time.monotonic() + 30  # the thread is woken at once; this bounds a hang
            while "checkpoint of" not in caplog.text and time.monotonic() < guard:
                time.sleep(0.01)
        assert "unable to open database file" in caplog.text
        assert len(store.load().leases) == CHECKPOINT_EVERY + 1
    finally:
        store.close()
