"""Group commit: changes handed over while a commit is in flight share the next
transaction, in order; their answers wait for it; a failed transaction fails every
change in it and leaves none of them visible. The store is a memory store whose commit
(run on the commit thread) blocks until the test lets it go."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gpu_arbiter.controller import Controller, ServiceUnavailable
from gpu_arbiter.core import Gpu
from gpu_arbiter.store import Batch, MemoryStore, StoreError

from .support import Clock, request


class GatedStore(MemoryStore):
    """Each commit waits for ``gate``; the ``fail_at``-th one raises instead of writing.
    ``batches``: what each commit wrote, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)
        self.batches: list[Batch] = []
        self.fail_at: int | None = None

    def commit(self, batch: Batch) -> None:
        self.entered.release()
        assert self.gate.wait(60), "the test never let the commit go"
        if len(self.batches) + 1 == self.fail_at:
            self.fail_at = None
            raise StoreError("disk full")
        self.batches.append(batch)
        super().commit(batch)


def grouped(store: GatedStore) -> Controller:
    gpu = Gpu(index=0, total_mb=81920, worker="local", arch="sm_90")
    controller = Controller(store, clock=Clock(), simulated=[gpu])
    controller.start()  # stored at once, as before group commit begins
    controller.changes.commit_in_groups()
    return controller


def ask(controller: Controller, holder: str) -> str:
    record = controller.leases.submit("client-1", request(1, holder=holder)).record
    return record.id


async def entered(store: GatedStore) -> None:
    """Waits until a commit is being written (on the commit thread)."""
    assert await asyncio.to_thread(store.entered.acquire, True, 60)


async def test_changes_made_during_a_commit_share_the_next_one_in_order() -> None:
    store = GatedStore()
    controller = grouped(store)
    written = len(store.batches)
    store.gate.clear()
    first = ask(controller, "a")
    await entered(store)  # the first change's transaction is in flight
    rest = [ask(controller, "b"), ask(controller, "c"), ask(controller, "d")]
    seq = controller.events.last_seq
    answer = asyncio.create_task(controller.changes.settled(controller.changes.failures))
    await asyncio.sleep(0.05)
    assert not answer.done()  # an answer waits for the transaction holding its change
    assert controller.events.last_seq == seq  # nobody is told of what is not stored
    store.gate.set()
    await asyncio.wait_for(answer, 60)
    one, grouped_batch = store.batches[written:]
    assert list(one.leases) == [first]
    assert list(grouped_batch.leases) == rest  # three changes, one transaction
    seqs = [e.seq for batch in (one, grouped_batch) for e in batch.events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # numbered in order, no gap
    requested = [e.lease_id for e in grouped_batch.events if e.kind == "lease.requested"]
    assert requested == rest
    assert controller.events.last_seq == seqs[-1]
    await controller.changes.flush()


async def test_a_failed_commit_fails_every_change_in_it_and_leaves_none_visible() -> None:
    store = GatedStore()
    controller = grouped(store)
    store.gate.clear()
    kept = ask(controller, "a")
    await entered(store)
    failed_before = controller.changes.failures
    lost = [ask(controller, "b"), ask(controller, "c")]  # the next transaction: it fails
    store.fail_at = len(store.batches) + 2
    answer = asyncio.create_task(controller.changes.settled(failed_before))
    store.gate.set()
    with pytest.raises(ServiceUnavailable, match="disk full"):
        await asyncio.wait_for(answer, 60)
    assert controller.gate.broken is None  # reloaded: memory is what the store holds
    assert [r.id for r in controller.leases.all()] == [kept]
    assert all(store.lease(lease_id) is None for lease_id in lost)
    assert controller.events.last_seq == store.load().last_event_seq
    ask(controller, "e")  # it serves on
    await asyncio.wait_for(controller.changes.settled(controller.changes.failures), 60)
    await controller.changes.flush()


async def test_a_change_that_fails_during_a_commit_reloads_once_the_commit_ends() -> None:
    store = GatedStore()
    controller = grouped(store)
    store.gate.clear()
    stored = ask(controller, "a")
    await entered(store)
    queued = ask(controller, "b")
    failed_before = controller.changes.failures
    with pytest.raises(RuntimeError), controller.changes.change():  # a bug in a change
        raise RuntimeError("a bug halfway through a change")
    with pytest.raises(ServiceUnavailable):  # refused until the reload
        ask(controller, "c")
    store.gate.set()
    with pytest.raises(ServiceUnavailable):
        await asyncio.wait_for(controller.changes.settled(failed_before), 60)
    await asyncio.wait_for(controller.changes.flush(), 60)
    assert controller.gate.broken is None
    assert [r.id for r in controller.leases.all()] == [stored]  # the queued one was dropped
    assert store.lease(queued) is None
