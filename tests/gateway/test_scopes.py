"""The cancel scope: cancelled from another task, it stops the code inside at its next
await and swallows that; any other cancellation passes through."""

from __future__ import annotations

import asyncio

import pytest

from gpu_arbiter.gateway.base.scopes import CancelScope


async def test_a_cancel_from_another_task_ends_the_block_and_is_caught() -> None:
    scope = CancelScope()
    reached: list[str] = []

    async def inside() -> str:
        async with scope:
            reached.append("in")
            await asyncio.Event().wait()
            reached.append("never")
        return "after"

    task = asyncio.ensure_future(inside())
    await asyncio.sleep(0)
    scope.cancel("cut at the end of the grace")
    assert await task == "after"
    assert reached == ["in"]
    assert scope.cancelled_caught
    assert scope.reason == "cut at the end of the grace"


async def test_cancelled_before_it_is_entered_the_block_ends_at_its_first_await() -> None:
    scope = CancelScope()
    scope.cancel("gone")
    async with scope:
        await asyncio.sleep(10)
    assert scope.cancelled_caught


async def test_a_block_that_ends_first_is_not_cancelled_later() -> None:
    scope = CancelScope()
    async with scope:
        await asyncio.sleep(0)
    scope.cancel("too late")
    await asyncio.sleep(0)
    assert not scope.cancelled_caught


async def test_another_cancellation_passes_through() -> None:
    scope = CancelScope()

    async def inside() -> None:
        async with scope:
            await asyncio.Event().wait()

    task = asyncio.ensure_future(inside())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not scope.cancelled_caught


async def test_an_error_inside_passes_through() -> None:
    scope = CancelScope()
    with pytest.raises(ZeroDivisionError):
        async with scope:
            _ = 1 / 0
