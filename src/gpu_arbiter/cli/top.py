"""``gpu-arbiter top``: a live full-screen view of a controller.

Workers and their GPU memory bars, the queue with reasons, the held leases and the
latest events, drawn with the renderers of ``status``, ``queue`` and ``leases``. The
view is fetched again when the event stream reports a change (at most
``MAX_REDRAWS_PER_S`` times a second) and every ``--interval`` seconds regardless.
``q`` quits (exit 0), Ctrl-C too (exit 130). ``--once`` prints one frame and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import termios
import time
import tty
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import httpx
from rich.console import Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from ..client import ArbiterClient
from ..core import ArbiterError
from .ops import (
    Controller,
    Json,
    Token,
    call_controller,
    event_line,
    leases_view,
    option,
    queue_view,
    status_view,
    stdout_console,
)

__all__ = ["top"]

MAX_REDRAWS_PER_S = 4.0
EVENTS_SHOWN = 8
HELD = ("loading", "active", "revoking")


@dataclass(slots=True)
class Frame:
    """What one screen shows: a snapshot of the controller and the latest events."""

    url: str
    workers: list[Json] = field(default_factory=list)
    status: Json = field(default_factory=dict)
    queue: list[Json] = field(default_factory=list)
    leases: list[Json] = field(default_factory=list)
    events: deque[Json] = field(default_factory=lambda: deque(maxlen=EVENTS_SHOWN))
    live: bool = False
    problem: str = ""
    fetched_at: float = 0.0


async def fetch(client: ArbiterClient, frame: Frame) -> None:
    """Reads the snapshot into ``frame``."""
    workers, status, queue, leases = await asyncio.gather(
        client.workers(), client.status(), client.queue(), client.leases()
    )
    frame.workers, frame.status, frame.queue = workers, status, queue
    frame.leases = [lease for lease in leases if lease["state"] in HELD]
    frame.fetched_at = time.time()
    frame.problem = ""


def render(frame: Frame, interactive: bool) -> RenderableType:
    head = Text.assemble(
        ("gpu-arbiter top", "bold"),
        f"  {frame.url}  {time.strftime('%H:%M:%S', time.localtime(frame.fetched_at))}",
    )
    if interactive:
        head.append_text(
            Text.assemble(
                "  ",
                ("live", "green") if frame.live else ("event stream offline", "red"),
                "  (q quits, interval redraws and every event)",
            )
        )
    if frame.problem:
        head.append(f"\n{frame.problem}", style="bold red")
    events = Group(*(Text(event_line(event)) for event in reversed(frame.events)))
    return Group(
        head,
        Panel(status_view(frame.workers, frame.status), title="workers and GPUs"),
        Panel(queue_view(frame.queue), title=f"queue ({len(frame.queue)})"),
        Panel(leases_view(frame.leases), title=f"leases ({len(frame.leases)})"),
        Panel(events if frame.events else Text("no events yet"), title="latest events"),
    )


async def follow(client: ArbiterClient, frame: Frame, changed: asyncio.Event) -> None:
    """Follows the event stream from a few events back; reconnects after a break."""
    last: str | None = None
    while True:
        try:
            if last is None:
                seq = int((await client.status()).get("last_event") or 0)
                last = str(max(0, seq - EVENTS_SHOWN))
            async for event in client.events(last_event_id=last):
                frame.live = True
                if event.id is not None:
                    last = event.id
                if isinstance(event.data, dict) and "kind" in event.data:
                    frame.events.append(event.data)
                changed.set()
        except (httpx.HTTPError, ArbiterError, ValueError) as error:  # ValueError: bad JSON
            frame.problem = f"event stream: {error}".strip()
        frame.live = False
        changed.set()
        await asyncio.sleep(1.0)


@contextlib.contextmanager
def keys(quit_requested: asyncio.Event) -> Iterator[None]:
    """Single keys from a terminal on stdin (``q`` sets ``quit_requested``); Ctrl-C still
    interrupts. Nothing when stdin is not a terminal."""
    if not sys.stdin.isatty():
        yield
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    loop = asyncio.get_running_loop()

    def read() -> None:
        if os.read(fd, 32).lower().startswith(b"q"):
            quit_requested.set()

    tty.setcbreak(fd)
    loop.add_reader(fd, read)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def watch(client: ArbiterClient, interval_s: float) -> None:
    """Redraws on events (throttled) and every ``interval_s``, until ``q``."""
    frame = Frame(client.url)
    await fetch(client, frame)  # a refused token or no controller: one error line, an exit
    changed, quit_requested = asyncio.Event(), asyncio.Event()
    console = stdout_console()
    with keys(quit_requested), Live(console=console, screen=True, auto_refresh=False) as live:
        async with asyncio.TaskGroup() as group:
            stream = group.create_task(follow(client, frame, changed))
            while not quit_requested.is_set():
                live.update(render(frame, interactive=True), refresh=True)
                await _next_change(changed, quit_requested, interval_s)
                changed.clear()
                if quit_requested.is_set():
                    break
                try:
                    await fetch(client, frame)
                except (httpx.HTTPError, ArbiterError) as error:
                    frame.problem = f"controller: {error}"
            stream.cancel()


async def _next_change(
    changed: asyncio.Event, quit_requested: asyncio.Event, wait_s: float
) -> None:
    """Waits for an event, a key or ``wait_s``; then at least the throttle interval."""
    started = time.monotonic()
    waiters = [asyncio.ensure_future(changed.wait()), asyncio.ensure_future(quit_requested.wait())]
    try:
        await asyncio.wait(waiters, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
    rest = 1.0 / MAX_REDRAWS_PER_S - (time.monotonic() - started)
    if rest > 0 and not quit_requested.is_set():
        await asyncio.sleep(rest)


def top(
    interval: Annotated[
        float, option("Redraw at least every this many seconds.", min=0.25, max=3600)
    ] = 5.0,
    once: Annotated[bool, option("Print one frame to stdout and exit.")] = False,
    controller: Controller = None,
    token: Token = None,
) -> None:
    """A live full-screen view: GPUs, queue, leases, events. q or Ctrl-C quits."""

    async def main(client: ArbiterClient) -> None:
        if once:
            frame = Frame(client.url)
            await asyncio.gather(fetch(client, frame), _recent_events(client, frame))
            stdout_console().print(render(frame, interactive=False))
        else:
            await watch(client, interval)

    call_controller(controller, token, main)


async def _recent_events(client: ArbiterClient, frame: Frame) -> None:
    """The latest events already retained (for ``--once``), without following."""
    last = int((await client.status()).get("last_event") or 0)
    if last == 0:
        return
    stream = client.events(last_event_id=str(max(0, last - EVENTS_SHOWN)))
    try:
        async for event in stream:
            data: Any = event.data
            if isinstance(data, dict) and "kind" in data:
                frame.events.append(data)
                if int(data.get("seq") or 0) >= last:
                    break
    finally:
        await stream.aclose()
