"""The gateway's health check against a real server on loopback."""

from __future__ import annotations

import asyncio

from gpu_arbiter.gateway.links import HttpHealthCheck


async def test_a_health_check_keeps_no_connection_open_to_the_server() -> None:
    """A server being stopped waits for its idle clients (llama.cpp's server about
    110 ms after SIGTERM): the check's connection is closed once it has its answer."""
    closed = asyncio.Event()
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        if await reader.read() == b"":  # the client's end, not a second request
            closed.set()
        writer.close()

    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    health = HttpHealthCheck()
    try:
        assert await health.status(port, "/health") == 200
        await asyncio.wait_for(closed.wait(), 30)  # at once; the bound is for the old code
        assert await health.status(port, "/health") == 200
        assert connections == 2
    finally:
        await health.aclose()
        listener.close()
