"""Races between waits, written once (Trio's nursery, in small): every task started here
is waited for before the function that started it returns, whoever won.

- :func:`first`: runs several waits, returns which ended first; the others are
  cancelled and over before it returns. The winner's error is raised.
- :func:`sleep_or`: a clock's sleep that an event cuts short (every waiting loop of
  the gateway sleeps so: on a virtual clock in tests, the loop's own in service, a
  :class:`Sleep`: then a timeout over the event's wait, no race of tasks).
- :func:`within`: an event waited for at most some seconds (the loop's clock).
- :func:`running`: a task that lives as long as a block (a client's disconnect
  watched while a request is relayed): started on entry, cancelled and waited for on
  the way out; its error, if any, is raised there.
- :func:`running_if_waiting`: the same, started only once the block gives the loop a
  turn (a request that waits for a replica), or some time into it (a relay whose
  answer takes that long): a block over before starts no task, and costs no turn of
  the loop to end."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from contextlib import AbstractAsyncContextManager
from typing import Any

__all__ = ["Sleep", "first", "running", "running_if_waiting", "sleep_or", "within"]


async def first(*waits: Awaitable[Any]) -> int:
    """Waits until the first of ``waits`` ends; its index (the lowest, when several
    ended together). The others are cancelled, and have ended, when it returns; the
    winner's error is raised (a loser's is dropped: it lost)."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await _until(tasks, every=False)
    finally:
        for task in tasks:
            task.cancel()
        await _until(tasks, every=True)
    won = next(i for i, task in enumerate(tasks) if task.done() and not task.cancelled())
    error = tasks[won].exception()
    if error is not None:
        raise error
    return won


async def sleep_or(sleeping: Awaitable[Any], event: asyncio.Event) -> bool:
    """Waits for ``sleeping`` (a clock's sleep, or a task of the caller's whose result
    it reads itself) or ``event``; True when the event came. A task of the caller's is
    cancelled when the event comes first (the caller cancels it when the event was set
    already), and its own error stays in it."""
    if event.is_set():
        if asyncio.iscoroutine(sleeping):
            sleeping.close()
        return True
    if isinstance(sleeping, Sleep):  # the loop's own: the event waited for under a timeout
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, sleeping.seconds)):
                await event.wait()
        return event.is_set()
    await first(_quietly(sleeping), event.wait())
    return event.is_set()


async def within(event: asyncio.Event, seconds: float) -> bool:
    """Waits for ``event`` at most ``seconds`` of the event loop's clock; whether it is
    set then."""
    return await sleep_or(Sleep(seconds), event)


class Sleep:
    """A sleep of ``seconds`` on the event loop's clock (``clock.LoopClock.sleep``), as a
    value: awaited, it sleeps; given to :func:`sleep_or`, no task is started (a replica's
    keep-warm loop sleeps so twice per request): the event is waited for in the
    caller's own task, under a timeout."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.sleep(self.seconds).__await__()


@contextlib.asynccontextmanager
async def running(work: Coroutine[Any, Any, Any]) -> AsyncIterator[asyncio.Task[Any]]:
    """``work`` as a task for the length of the block: cancelled (if not over) and
    waited for when the block ends; an error of its own is raised then."""
    task = asyncio.ensure_future(work)
    try:
        yield task
    finally:
        await _ended(task)


def running_if_waiting(
    work: Callable[[], Coroutine[Any, Any, Any]], after_s: float = 0.0
) -> AbstractAsyncContextManager[None]:
    """``work()`` as a task from the loop's first turn ``after_s`` seconds into the
    block (0: its first wait) to the block's end, then as :func:`running`; none when
    the block ends before (``work`` is not called)."""
    return _Deferred(work, after_s)


class _Deferred:
    """:func:`running_if_waiting`'s block: a timer that starts the task, cancelled at
    the end if it has not fired."""

    __slots__ = ("_after_s", "_handle", "_task", "_work")

    def __init__(self, work: Callable[[], Coroutine[Any, Any, Any]], after_s: float) -> None:
        self._work = work
        self._after_s = after_s
        self._handle: asyncio.Handle | None = None
        self._task: asyncio.Task[Any] | None = None

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        if self._after_s > 0:
            self._handle = loop.call_later(self._after_s, self._start)
        else:
            self._handle = loop.call_soon(self._start)

    def _start(self) -> None:
        self._task = asyncio.ensure_future(self._work())

    async def __aexit__(self, *_: object) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self._task is not None:
            await _ended(self._task)


async def _ended(task: asyncio.Task[Any]) -> None:
    """``task`` cancelled (if not over) and waited for; its own error raised."""
    task.cancel()
    await _until([task], every=True)
    error = None if task.cancelled() else task.exception()
    if error is not None:
        raise error


async def _until(tasks: list[asyncio.Task[Any]], *, every: bool) -> None:
    """Waits until one of ``tasks`` has ended (``every``: each of them), as
    ``asyncio.wait`` does, with less to do per wait (a request's path waits so several
    times): one future, woken by the tasks' own callbacks."""
    pending = [task for task in tasks if not task.done()]
    if not pending or (not every and len(pending) < len(tasks)):
        return
    woken = asyncio.get_running_loop().create_future()
    left = len(pending) if every else 1

    def ended(_: asyncio.Task[Any]) -> None:
        nonlocal left
        left -= 1
        if left <= 0 and not woken.done():
            woken.set_result(None)

    for task in pending:
        task.add_done_callback(ended)
    try:
        await woken
    finally:
        for task in pending:
            task.remove_done_callback(ended)


async def _quietly(wait: Awaitable[Any]) -> None:
    """``wait``, its error kept in it (a task of the caller's: the caller reads it)."""
    with contextlib.suppress(Exception):
        await wait
