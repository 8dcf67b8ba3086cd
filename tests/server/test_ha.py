"""The coordinator in-process, on a real PostgreSQL store: it stands by while another
controller leads, takes over when that term ends, and never spins."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpu_arbiter.controller import Controller
from gpu_arbiter.server.ha import Coordinator
from gpu_arbiter.store import Leader, PostgresStore


class Counted:
    """The real store, counting the elections it is asked for and keeping the loss
    callback the coordinator gives it."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.campaigns = 0
        self.on_lost: Callable[[], None] | None = None

    @property
    def epoch(self) -> int | None:
        return self.store.epoch

    def try_lead(
        self, holder: str, url: str | None, ttl_s: float, on_lost: Callable[[], None] | None = None
    ) -> int | None:
        self.campaigns += 1
        self.on_lost = on_lost
        return self.store.try_lead(holder, url, ttl_s, on_lost)

    def step_down(self) -> None:
        self.store.step_down()

    def leader(self) -> Leader:
        return self.store.leader()

    def version(self) -> int:
        return self.store.version()


@pytest.fixture
def stores(postgres_dsn: str) -> Iterator[tuple[PostgresStore, PostgresStore]]:
    other, mine = PostgresStore(postgres_dsn), PostgresStore(postgres_dsn)
    yield other, mine
    mine.close()
    other.close()


async def _run(coordinator: Coordinator, seconds: float) -> tuple[asyncio.Event, Any]:
    stop = asyncio.Event()
    task = asyncio.create_task(coordinator.run(stop))
    await asyncio.sleep(seconds)
    return stop, task


async def test_it_stands_by_then_takes_over_when_the_term_ends(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    other, mine = stores
    assert other.try_lead("other", "http://other:7070", 60) == 1
    controller = Controller(mine)
    controller.mirror()
    coordinator = Coordinator(controller, mine, url="http://me:7070", ttl_s=60, poll_s=0.1)
    stop, task = await _run(coordinator, 0.5)
    assert controller.gate.standby and controller.gate.leader_url == "http://other:7070"

    other.step_down()
    for _ in range(100):
        if not controller.gate.standby:
            break
        await asyncio.sleep(0.05)
    assert not controller.gate.standby and mine.epoch == 2
    assert mine.leader().url == "http://me:7070"
    stop.set()
    await asyncio.wait_for(task, 10)
    assert mine.epoch is None and not mine.leader().alive  # it ended its term as it stopped


async def test_a_loss_reported_after_the_term_was_given_up_does_not_spin_the_loop(
    stores: tuple[PostgresStore, PostgresStore],
) -> None:
    other, mine = stores
    other.try_lead("other", "http://other:7070", 60)
    counted = Counted(mine)
    controller = Controller(mine)
    controller.mirror()
    coordinator = Coordinator(controller, counted, url="http://me:7070", ttl_s=60, poll_s=0.25)
    stop, task = await _run(coordinator, 0.3)
    assert counted.on_lost is not None
    counted.on_lost()  # as the store's thread does, late
    before = counted.campaigns
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert counted.campaigns - before <= 6  # one a poll (4 in a second), not a busy loop
    assert controller.gate.standby
