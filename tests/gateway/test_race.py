"""The race helpers (``base/race.py``), on the virtual clock: the first wait to end wins,
the others are cancelled and over before the race returns, the winner's error is
raised, and a task that lives as long as a block is waited for at its end (one started
only once the block waits: none for a block that never does)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from gpu_arbiter.gateway.base.clock import LoopClock
from gpu_arbiter.gateway.base.race import first, running, running_if_waiting, sleep_or, within

from .fakes import FakeClock, settle


async def test_the_first_to_end_wins_and_the_others_are_over_when_it_returns() -> None:
    clock = FakeClock()
    ended: list[str] = []

    async def sleeper(name: str, seconds: float) -> None:
        try:
            await clock.sleep(seconds)
        finally:
            ended.append(name)

    race = asyncio.ensure_future(first(sleeper("long", 5.0), sleeper("short", 1.0)))
    await clock.advance(1.0)
    assert await race == 1
    assert sorted(ended) == ["long", "short"]  # the loser was cancelled and has ended


async def test_the_lowest_index_wins_when_several_end_together() -> None:
    clock = FakeClock()
    race = asyncio.ensure_future(first(clock.sleep(1.0), clock.sleep(1.0), clock.sleep(2.0)))
    await clock.advance(1.0)
    assert await race == 0


async def test_the_winners_error_is_raised_and_a_losers_dropped() -> None:
    clock = FakeClock()

    async def fails_after(seconds: float) -> None:
        await clock.sleep(seconds)
        raise ValueError("won with an error")

    race = asyncio.ensure_future(first(fails_after(1.0), clock.sleep(2.0)))
    await clock.advance(1.0)
    with pytest.raises(ValueError, match="won with an error"):
        await race
    race = asyncio.ensure_future(first(clock.sleep(1.0), fails_after(1.0)))
    await clock.advance(1.0)
    assert await race == 0


async def test_a_cancelled_race_cancels_and_waits_for_every_wait() -> None:
    clock = FakeClock()
    ended: list[str] = []

    async def sleeper(name: str) -> None:
        try:
            await clock.sleep(10.0)
        finally:
            ended.append(name)

    race = asyncio.ensure_future(first(sleeper("a"), sleeper("b")))
    await settle()
    race.cancel()
    with pytest.raises(asyncio.CancelledError):
        await race
    assert sorted(ended) == ["a", "b"]


async def test_sleep_or_says_whether_the_event_cut_the_sleep_short() -> None:
    clock = FakeClock()
    event = asyncio.Event()
    sleeping = asyncio.ensure_future(sleep_or(clock.sleep(5.0), event))
    await clock.advance(5.0)
    assert await sleeping is False
    sleeping = asyncio.ensure_future(sleep_or(clock.sleep(5.0), event))
    await settle()
    event.set()
    assert await sleeping is True
    assert await sleep_or(clock.sleep(5.0), event) is True  # set already: no sleep


async def test_sleep_or_leaves_a_callers_task_its_own_result_or_error() -> None:
    clock = FakeClock()
    event = asyncio.Event()

    async def fails() -> None:
        await clock.sleep(1.0)
        raise ConnectionError("unreachable")

    task = asyncio.ensure_future(fails())
    sleeping = asyncio.ensure_future(sleep_or(task, event))
    await clock.advance(1.0)
    assert await sleeping is False
    assert isinstance(task.exception(), ConnectionError)  # the caller reads it

    task = asyncio.ensure_future(clock.sleep(10.0))
    sleeping = asyncio.ensure_future(sleep_or(task, event := asyncio.Event()))
    await settle()
    event.set()
    assert await sleeping is True
    assert task.cancelled()


async def test_the_loops_own_sleep_is_cut_short_by_the_event_with_no_task_started() -> None:
    event = asyncio.Event()
    tasks = len(asyncio.all_tasks())
    sleeping = asyncio.ensure_future(sleep_or(LoopClock().sleep(10.0), event))
    await settle()
    assert len(asyncio.all_tasks()) == tasks + 1  # the sleep_or itself, nothing of its own
    event.set()
    assert await sleeping is True
    began = asyncio.get_running_loop().time()
    assert await sleep_or(LoopClock().sleep(0.01), asyncio.Event()) is False
    assert asyncio.get_running_loop().time() - began >= 0.01
    await LoopClock().sleep(0.0)  # awaited, it sleeps


async def test_within_waits_at_most_its_seconds() -> None:
    event = asyncio.Event()
    assert await within(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await within(event, 10.0) is True


async def test_a_running_task_is_cancelled_and_waited_for_at_the_blocks_end() -> None:
    clock = FakeClock()
    ended: list[str] = []

    async def watcher() -> None:
        try:
            await clock.sleep(100.0)
        finally:
            ended.append("watcher")

    async with running(watcher()) as task:
        await settle()
        assert not task.done()
    assert ended == ["watcher"]


async def test_a_running_tasks_error_is_raised_at_the_blocks_end() -> None:
    async def broken() -> None:
        raise RuntimeError("a bug in the watcher")

    with pytest.raises(RuntimeError, match="a bug in the watcher"):
        async with running(broken()):
            await settle()


async def test_a_block_that_never_waits_starts_no_task() -> None:
    made: list[str] = []
    async with running_if_waiting(watcher_of(made)):
        pass
    await settle()
    assert made == []


async def test_a_block_that_waits_runs_the_task_until_its_end() -> None:
    clock = FakeClock()
    ended: list[str] = []

    async def watcher() -> None:
        ended.append("started")
        try:
            await clock.sleep(100.0)
        finally:
            ended.append("watcher")

    async with running_if_waiting(watcher):
        await settle()
        assert ended == ["started"]
    assert ended == ["started", "watcher"]


async def test_a_task_started_once_the_block_waited_raises_its_error_at_the_end() -> None:
    async def broken() -> None:
        raise RuntimeError("a bug in the watcher")

    with pytest.raises(RuntimeError, match="a bug in the watcher"):
        async with running_if_waiting(broken):
            await settle()


def watcher_of(made: list[str]) -> Callable[[], Coroutine[Any, Any, None]]:
    async def watcher() -> None:
        made.append("ran")

    def work() -> Coroutine[Any, Any, None]:
        made.append("made")
        return watcher()

    return work


async def test_a_task_due_some_time_into_the_block_starts_only_if_the_block_lasts() -> None:
    made: list[str] = []
    async with running_if_waiting(watcher_of(made), after_s=0.05):
        await asyncio.sleep(0)  # the block waits, but ends before the time
    await asyncio.sleep(0.06)
    assert made == []
    async with running_if_waiting(watcher_of(made), after_s=0.01):
        await asyncio.sleep(0.03)
    assert made == ["made", "ran"]
