"""The catalogue's long-poll ends once the server begins to stop (its event streams'
end), so that uvicorn never waits for one that a gateway gone away left running."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from gpu_arbiter.server.catalogue import RECHECK_S, _wait_after


class Revisions:
    """No revision ever comes: each wait lasts its whole timeout."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def wait_after(self, after: int, timeout_s: float) -> None:
        self.waits.append(timeout_s)
        await asyncio.sleep(timeout_s)


async def test_a_long_poll_ends_within_a_recheck_once_the_server_begins_to_stop() -> None:
    revisions = Revisions()
    ctl: Any = SimpleNamespace(catalogue=revisions)
    feed: Any = SimpleNamespace(closed=False)
    waiting = asyncio.ensure_future(_wait_after(ctl, feed, 0, 60.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    feed.closed = True
    assert await asyncio.wait_for(waiting, 2 * RECHECK_S) is None
    assert revisions.waits == [RECHECK_S]  # each wait at most a recheck


async def test_a_long_poll_lasts_its_wait_while_the_server_runs() -> None:
    revisions = Revisions()
    ctl: Any = SimpleNamespace(catalogue=revisions)
    feed: Any = SimpleNamespace(closed=False)
    assert await _wait_after(ctl, feed, 0, 0.3) is None
    [waited] = revisions.waits
    assert 0.29 < waited <= 0.3
