"""The gateway's health check and engine calls against a real server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gpu_arbiter.gateway.servers.engines import EngineHttp
from gpu_arbiter.gateway.servers.links import HttpHealthCheck


async def _one_connection_each(ask: Callable[[int], Awaitable[int | None]]) -> None:
    """Two calls through ``ask`` (port -> status), each on a connection that the client
    closes once it has its answer."""
    ends: asyncio.Queue[bytes] = asyncio.Queue()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        more = await reader.read()  # b"": the client's end, not a second request
        writer.close()
        await writer.wait_closed()
        ends.put_nowait(more)

    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        for _ in range(2):  # each on a connection of its own, closed by the client
            assert await ask(port) == 200
            assert await asyncio.wait_for(ends.get(), 30) == b""  # at once (bound: old code)
    finally:
        listener.close()
        await listener.wait_closed()


async def test_a_health_check_keeps_no_connection_open_to_the_server() -> None:
    """A server being stopped waits for its idle clients (llama.cpp's server about
    110 ms after SIGTERM): the check's connection is closed once it has its answer."""
    health = HttpHealthCheck()
    try:
        await _one_connection_each(lambda port: health.status(port, "/health"))
    finally:
        await health.aclose()


async def test_an_engine_call_keeps_no_connection_open_to_the_server() -> None:
    """The same for the engines' own calls (sleep, wake, busy, used memory)."""
    engines = EngineHttp()

    async def ask(port: int) -> int | None:
        answer = await engines.call("GET", port, "/slots")
        return None if answer is None else answer.status

    try:
        await _one_connection_each(ask)
    finally:
        await engines.aclose()
