"""The event stream's body against a controller that cannot serve what it counted."""

from __future__ import annotations

import asyncio

import pytest

from gpu_arbiter.controller import Controller
from gpu_arbiter.server.events import EventFeed, event_stream
from gpu_arbiter.store import Event, MemoryStore


def never_served(seq: int, limit: int = 500) -> list[Event]:
    return []


async def test_a_position_the_controller_cannot_serve_is_skipped_and_the_stream_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controller = Controller(MemoryStore())
    controller.start()
    assert controller.events.last_seq >= 1
    monkeypatch.setattr(controller.events, "after", never_served)
    feed = EventFeed(controller)
    stream = event_stream(feed, 0, lease=None, worker=None)
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counting = asyncio.create_task(count_turns())
    assert await anext(stream) == b"retry: 1000\n\n"
    gap = await anext(stream)
    assert gap.startswith(b"event: stream.gap\n")
    with pytest.raises(TimeoutError):  # nothing more to send: it waits, it does not spin
        await asyncio.wait_for(anext(stream), 0.3)
    assert turns > 10  # the loop ran meanwhile
    counting.cancel()
    controller.close()


async def test_wait_events_suspends_even_when_the_answer_is_known() -> None:
    controller = Controller(MemoryStore())
    controller.start()
    ran = False

    async def other() -> None:
        nonlocal ran
        ran = True

    task = asyncio.create_task(other())
    assert await controller.events.wait_after(controller.events.last_seq - 1)
    assert ran
    await task
    controller.close()


async def test_a_closed_feed_ends_its_streams() -> None:
    controller = Controller(MemoryStore())
    controller.start()
    feed = EventFeed(controller)
    stream = event_stream(feed, controller.events.last_seq, lease=None, worker=None)
    assert await anext(stream) == b"retry: 1000\n\n"
    following = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.05)
    assert not following.done()
    feed.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(following, 1)
    controller.close()
