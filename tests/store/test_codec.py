"""A lease's stored document (``store/codec.py``): what is written reads back equal, a
document written before format 1 (every field) reads as it was written, a document
leaves out the fields its reader assumes, and a store written in a newer format than
this code reads is refused, and left as it is."""

from __future__ import annotations

import json
import math
import os
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_arbiter.core import Constraints, GpuId, Lease, LeaseState, Request
from gpu_arbiter.store import LeaseRecord, SqliteStore, StoreError
from gpu_arbiter.store.codec import DOCUMENT_FORMAT, dumps, lease_from_doc, lease_to_doc

FORMAT_0 = (
    (
        '{"request":{"id":"lease-a","vram_mb":2048,"gpus":2,"priority":800,"preemptible":fals'
        'e,"constraints":{"vendor":null,"min_compute_capability":null,"gpu_arch":["sm_86"],"g'
        'pu_model":null,"worker":null,"labels":{"zone":"a"},"gpu_ids":[],"never_preempt":[]},'
        '"holder":"chat","metadata":{"model":"llama"},"ttl_s":30.0,"max_wait_s":null,"load_ti'
        'meout_s":300.0,"idempotency_key":"k-1","seq":7,"submitted_at":100.5},"state":"active'
        '","owner":"tok-1","lease":{"gpus":["box-1:0","box-1:1"],"token":3,"state":"active","'
        'granted_at":101.0,"expires_at":131.0,"load_deadline":401.0,"idle":false,"last_used_a'
        't":120.0,"loading":false,"revoke_reason":null,"preempted_for":null,"ended_at":null,"'
        'revoked_at":null,"supervised":true,"shrunk_to_mb":1024},"ended_at":null,"end_reason"'
        ":null}"
    ),
    (
        '{"request":{"id":"lease-a","vram_mb":2048,"gpus":2,"priority":800,"preemptible":fals'
        'e,"constraints":{"vendor":null,"min_compute_capability":null,"gpu_arch":["sm_86"],"g'
        'pu_model":null,"worker":null,"labels":{"zone":"a"},"gpu_ids":[],"never_preempt":[]},'
        '"holder":"chat","metadata":{"model":"llama"},"ttl_s":30.0,"max_wait_s":null,"load_ti'
        'meout_s":300.0,"idempotency_key":"k-1","seq":7,"submitted_at":100.5},"state":"releas'
        'ed","owner":"tok-1","lease":{"gpus":["box-1:0","box-1:1"],"token":3,"state":"revokin'
        'g","granted_at":101.0,"expires_at":null,"load_deadline":401.0,"idle":false,"last_use'
        'd_at":120.0,"loading":false,"revoke_reason":"preempted","preempted_for":"lease-b","e'
        'nded_at":126.0,"revoked_at":125.0,"supervised":true,"shrunk_to_mb":1024},"ended_at":'
        '126.0,"end_reason":"holder_stopped"}'
    ),
    (
        '{"request":{"id":"lease-p","vram_mb":512,"gpus":1,"priority":500,"preemptible":true,'
        '"constraints":{"vendor":null,"min_compute_capability":null,"gpu_arch":[],"gpu_model"'
        ':null,"worker":null,"labels":{},"gpu_ids":[],"never_preempt":[]},"holder":"","metada'
        'ta":{},"ttl_s":30.0,"max_wait_s":null,"load_timeout_s":300.0,"idempotency_key":null,'
        '"seq":9,"submitted_at":5.0},"state":"pending","owner":null,"lease":null,"ended_at":n'
        'ull,"end_reason":null}'
    ),
)
"""Documents the code before format 1 wrote for :func:`_records` (every field)."""


def _records() -> tuple[LeaseRecord, LeaseRecord, LeaseRecord]:
    """A held lease with every kind of field set, the same one ended, and a pending one."""
    request = Request.build(
        "lease-a", vram_mb="2G", priority="interactive", holder="chat", gpus=2,
        constraints=Constraints.build(gpu_arch=["sm_86"], labels={"zone": "a"}),
        metadata={"model": "llama"}, idempotency_key="k-1",
    )  # fmt: skip
    request = replace(request, seq=7, submitted_at=100.5)
    lease = Lease(
        request=request, gpus=(GpuId("box-1", 0), GpuId("box-1", 1)), token=3,
        state=LeaseState.ACTIVE, granted_at=101.0, expires_at=131.0, load_deadline=401.0,
        loading=False, last_used_at=120.0, shrunk_to_mb=1024, supervised=True,
    )  # fmt: skip
    live = LeaseRecord(request=request, state=LeaseState.ACTIVE, owner="tok-1", lease=lease)
    last = replace(
        lease, state=LeaseState.REVOKING, revoke_reason="preempted", preempted_for="lease-b",
        revoked_at=125.0, ended_at=126.0, expires_at=math.inf,
    )  # fmt: skip
    ended = LeaseRecord(
        request=request, state=LeaseState.RELEASED, owner="tok-1", lease=last, ended_at=126.0,
        end_reason="holder_stopped",
    )  # fmt: skip
    waiting = replace(Request.build("lease-p", vram_mb=512), seq=9, submitted_at=5.0)
    pending = LeaseRecord(request=waiting, state=LeaseState.PENDING)
    return live, ended, pending


def test_documents_of_format_0_read_as_they_were_written() -> None:
    for text, record in zip(FORMAT_0, _records(), strict=True):
        assert lease_from_doc(json.loads(text)) == record


def test_a_document_leaves_out_what_its_reader_assumes_and_reads_back_equal() -> None:
    for text, record in zip(FORMAT_0, _records(), strict=True):
        written = dumps(lease_to_doc(record))
        assert lease_from_doc(json.loads(written)) == record
        assert len(written) < len(text)
    pending = lease_to_doc(_records()[2])
    assert pending == {
        "request": {"id": "lease-p", "vram_mb": 512, "seq": 9, "submitted_at": 5.0},
        "state": "pending",
    }


def test_a_field_is_left_out_only_at_its_default_of_the_same_type() -> None:
    request = Request(id="r", vram_mb=1, gpus=True, ttl_s=None, priority=0, preemptible=False)
    doc = lease_to_doc(LeaseRecord(request=request, state=LeaseState.PENDING))["request"]
    assert doc["gpus"] is True  # not 1
    assert doc["ttl_s"] is None and doc["priority"] == 0 and doc["preemptible"] is False


_text = st.text(st.characters(codec="utf-8"), max_size=8)
_maybe_time = st.none() | st.floats(0, 2e9)


@st.composite
def _record(draw: st.DrawFn) -> LeaseRecord:
    constraints = Constraints(
        vendor=draw(st.none() | st.sampled_from(["nvidia", "amd"])),
        min_compute_capability=draw(st.none() | st.tuples(st.integers(0, 9), st.integers(0, 9))),
        gpu_arch=tuple(draw(st.lists(st.sampled_from(["sm_80", "sm_86", "sm_90"]), max_size=2))),
        worker=draw(st.none() | _text),
        labels=tuple(sorted(draw(st.dictionaries(_text, _text, max_size=2)).items())),
        gpu_ids=tuple(
            draw(
                st.lists(
                    st.builds(GpuId, _text.filter(lambda t: ":" not in t), st.integers(0, 7)),
                    max_size=2,
                )
            )
        ),
        never_preempt=tuple(draw(st.lists(_text, max_size=2))),
        workers=tuple(draw(st.lists(_text, max_size=3))),
        prefer_workers=tuple(draw(st.lists(_text, max_size=3))),
    )
    request = Request(
        id=draw(_text), vram_mb=draw(st.integers(1, 1 << 20)), gpus=draw(st.integers(1, 8)),
        priority=draw(st.sampled_from([0, 100, 500, 800, 1000])), preemptible=draw(st.booleans()),
        constraints=constraints, holder=draw(_text),
        metadata=draw(st.dictionaries(_text, st.none() | st.integers() | _text, max_size=3)),
        ttl_s=draw(st.none() | st.sampled_from([30.0, 3600.0]) | st.floats(1, 1e6)),
        max_wait_s=draw(st.none() | st.floats(0, 1e6)),
        load_timeout_s=draw(st.sampled_from([300.0, 10.0])),
        idempotency_key=draw(st.none() | _text),
        seq=draw(st.integers(0, 1 << 40)), submitted_at=draw(st.floats(0, 2e9)),
    )  # fmt: skip
    state = draw(st.sampled_from(list(LeaseState)))
    lease = None
    if draw(st.booleans()):
        lease = Lease(
            request=request, gpus=tuple(GpuId("w", i) for i in range(request.gpus)),
            token=draw(st.integers(1, 1 << 40)), state=draw(st.sampled_from(list(LeaseState))),
            granted_at=draw(st.floats(0, 2e9)),
            expires_at=draw(st.just(math.inf) | st.floats(0, 2e9)),
            load_deadline=draw(st.floats(0, 2e9)), idle=draw(st.booleans()),
            last_used_at=draw(st.sampled_from([0.0, 5.0])), loading=draw(st.booleans()),
            revoke_reason=draw(st.none() | _text), preempted_for=draw(st.none() | _text),
            ended_at=draw(_maybe_time), revoked_at=draw(_maybe_time),
            supervised=draw(st.booleans()),
            shrunk_to_mb=draw(st.none() | st.integers(0, 1 << 20)),
        )  # fmt: skip
    return LeaseRecord(
        request=request, state=state, owner=draw(st.none() | _text), lease=lease,
        ended_at=draw(_maybe_time), end_reason=draw(st.none() | _text),
    )  # fmt: skip


@given(_record())
def test_every_record_reads_back_equal(record: LeaseRecord) -> None:
    assert lease_from_doc(json.loads(dumps(lease_to_doc(record)))) == record


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_sqlite_refuses_a_newer_document_format_and_leaves_the_database_as_it_is(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version={DOCUMENT_FORMAT + 1}")
    files = _open_files()
    with pytest.raises(
        StoreError, match=f"newer gpu-arbiter \\(document format {DOCUMENT_FORMAT + 1};"
    ):
        SqliteStore(path)
    assert _open_files() == files
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (DOCUMENT_FORMAT + 1,)
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == []  # no table made


def test_sqlite_reads_a_database_of_format_0_and_writes_its_own_from_then_on(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    SqliteStore(path).close()
    live, _, pending = _records()
    with sqlite3.connect(path) as db:  # as the code before format 1 left it
        db.execute("PRAGMA user_version=0")
        for record, text in ((live, FORMAT_0[0]), (pending, FORMAT_0[2])):
            row = (record.id, str(record.state), 0, record.owner or "", None, text)
            db.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?)", row)
    store = SqliteStore(path)
    try:
        assert sorted(store.load().leases, key=lambda r: r.id) == [live, pending]
    finally:
        store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (DOCUMENT_FORMAT,)


@pytest.mark.parametrize("failure", ["not a database", "any error"])
def test_sqlite_that_cannot_open_closes_what_it_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """A file that is no database (SQLite's error), or any exception while the store
    opens: the error goes to the caller and no connection is left open."""
    path = tmp_path / "state.db"
    expected: type[BaseException] = StoreError
    if failure == "not a database":
        path.write_bytes(b"\x8f" * 8192)
    else:

        def fail(self: SqliteStore) -> None:
            raise KeyError("anything")

        monkeypatch.setattr(SqliteStore, "_check_format", fail)
        expected = KeyError
    files = _open_files()
    for _ in range(3):
        with pytest.raises(expected):
            SqliteStore(path)
    assert _open_files() == files
