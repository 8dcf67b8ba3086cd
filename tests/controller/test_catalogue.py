"""The catalogue's revisions at the controller: stored in the change's transaction, with
an event, before anyone is told; a failed commit leaves none; a restart, a reload or a
standby's copy has every one."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from gpu_arbiter.controller import Controller, NotLeader, ServiceUnavailable
from gpu_arbiter.store import MemoryStore, PostgresStore, StoreError

from .support import Clock, FailingStore

TEXT = '[models.chat]\ncommand = "llama-server -m /m.gguf --port {port}"\n'


def started(store: MemoryStore | None = None) -> Controller:
    controller = Controller(store or MemoryStore(), clock=Clock())
    controller.start()
    return controller


async def test_an_apply_stores_a_numbered_revision_with_an_event() -> None:
    store = MemoryStore()
    controller = started(store)
    assert controller.catalogue.current is None
    revision, new = controller.catalogue.apply(TEXT, "catalogue.toml", "admin")
    assert new and revision.revision == 1
    assert revision.sha256 == hashlib.sha256(TEXT.encode()).hexdigest()
    assert (revision.applied_by, revision.file, revision.applied_at) == (
        "admin", "catalogue.toml", 1000.0,
    )  # fmt: skip
    assert store.load().catalogue == (revision,)
    applied = [e for e in store.events_after(0, 100) if e.kind == "catalogue.applied"]
    assert [dict(e.data) for e in applied] == [
        {"revision": 1, "by": "admin", "sha256": revision.sha256, "file": "catalogue.toml",
         "size": len(TEXT)},
    ]  # fmt: skip


async def test_the_same_text_again_makes_no_revision_and_another_makes_the_next() -> None:
    store = MemoryStore()
    controller = started(store)
    first, _ = controller.catalogue.apply(TEXT, "a.toml", "admin")
    seq = controller.events.last_seq
    again, new = controller.catalogue.apply(TEXT, "b.toml", "other")
    assert (again, new) == (first, False)
    assert controller.events.last_seq == seq  # nothing stored, no event
    second, new = controller.catalogue.apply(TEXT + "# more\n", "a.toml", "admin")
    assert new and second.revision == 2
    assert controller.catalogue.history() == [second, first]
    assert controller.catalogue.revision(1) == first
    assert controller.catalogue.revision(3) is None
    assert [r.revision for r in store.load().catalogue] == [1, 2]


async def test_an_apply_that_cannot_be_stored_leaves_no_revision() -> None:
    store = FailingStore()
    controller = started(store)
    first, _ = controller.catalogue.apply(TEXT, "c.toml", "admin")
    store.fail = True
    with pytest.raises(ServiceUnavailable, match="disk full"):
        controller.catalogue.apply(TEXT + "# two\n", "c.toml", "admin")
    assert controller.catalogue.current == first  # memory is what the store holds
    assert store.load().catalogue == (first,)
    store.fail = False
    second, new = controller.catalogue.apply(TEXT + "# two\n", "c.toml", "admin")
    assert new and second.revision == 2


async def test_an_apply_failing_under_group_commit_leaves_no_revision() -> None:
    store = FailingStore(lambda: StoreError("disk full"))
    controller = started(store)
    controller.changes.commit_in_groups()
    failures = controller.changes.failures
    store.fail = True
    controller.catalogue.apply(TEXT, "c.toml", "admin")  # handed over, not stored yet
    with pytest.raises(ServiceUnavailable):
        await controller.changes.settled(failures)
    store.fail = False
    await controller.changes.flush()
    assert controller.catalogue.current is None
    assert store.load().catalogue == ()


async def test_a_restarted_controller_and_a_standby_have_every_revision() -> None:
    store = MemoryStore()
    first = started(store)
    first.catalogue.apply(TEXT, "c.toml", "admin")
    first.catalogue.apply(TEXT + "# 2\n", "c.toml", "admin")
    first.close()
    again = started(store)
    assert [r.revision for r in again.catalogue.history()] == [2, 1]
    standby = Controller(store, clock=Clock())
    standby.mirror("http://leader:7070")
    assert standby.catalogue.current == again.catalogue.current
    with pytest.raises(NotLeader):
        standby.catalogue.apply(TEXT + "# 3\n", "c.toml", "admin")


async def test_a_reader_waiting_for_a_newer_revision_is_answered_once_one_is_stored() -> None:
    controller = started()
    controller.catalogue.apply(TEXT, "c.toml", "admin")
    current = await controller.catalogue.wait_after(0, 5.0)
    assert current is not None and current.revision == 1  # at once
    waiting = asyncio.ensure_future(controller.catalogue.wait_after(1, 30.0))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    controller.catalogue.apply(TEXT + "# 2\n", "c.toml", "admin")
    found = await asyncio.wait_for(waiting, 5.0)
    assert found is not None and found.revision == 2
    quiet = await controller.catalogue.wait_after(2, 0.05)
    assert quiet is not None and quiet.revision == 2  # the wait's end: the current one


async def test_a_standbys_reader_is_answered_when_its_copy_gains_a_revision() -> None:
    store = MemoryStore()
    leader = started(store)
    standby = Controller(store, clock=Clock())
    standby.mirror("http://leader:7070")
    waiting = asyncio.ensure_future(standby.catalogue.wait_after(0, 30.0))
    await asyncio.sleep(0.01)
    leader.catalogue.apply(TEXT, "c.toml", "admin")
    standby.mirror("http://leader:7070")  # what the standby's follower does
    found = await asyncio.wait_for(waiting, 5.0)
    assert found is not None and found.revision == 1


async def test_on_a_shared_postgresql_store_a_standby_has_it_and_the_next_leader_goes_on(
    postgres_dsn: str,
) -> None:
    first_store, second_store = PostgresStore(postgres_dsn), PostgresStore(postgres_dsn)
    try:
        assert first_store.try_lead("first", None, ttl_s=60) is not None
        leader = Controller(first_store, clock=Clock())
        leader.start()
        applied, _ = leader.catalogue.apply(TEXT, "c.toml", "admin")
        standby = Controller(second_store, clock=Clock())
        standby.mirror()
        assert standby.catalogue.current == applied
        leader.close()
        first_store.step_down()
        assert second_store.try_lead("second", None, ttl_s=60) is not None
        standby.start()  # the take-over
        assert standby.catalogue.history() == [applied]
        second, new = standby.catalogue.apply(TEXT + "# 2\n", "c.toml", "admin")
        assert new and second.revision == 2
        assert [r.revision for r in first_store.load().catalogue] == [1, 2]
    finally:
        first_store.close()
        second_store.close()
