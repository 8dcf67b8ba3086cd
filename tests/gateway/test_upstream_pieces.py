"""A large held body leaves for the model server a piece at a time, the next once the
transport has room; a server that answers before it reads the body still gets the rest
and its answer is read, against servers on loopback."""

from __future__ import annotations

import asyncio

import pytest

from gpu_arbiter.gateway.base.upstream import WRITE_PIECE_BYTES, Upstream

pytestmark = pytest.mark.timeout(60)

SIZE = 8 * 1024 * 1024
TOO_LARGE = b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 3\r\n\r\nbig"


async def test_a_server_that_answers_before_reading_the_body_is_heard() -> None:
    """The server answers 413 after the head and reads nothing more until its answer
    was read: the body's pieces wait for room that does not come, so the answer must
    be read meanwhile (writing then waiting for room would wait for ever)."""
    heard, done = asyncio.Event(), asyncio.Event()
    rest: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        writer.write(TOO_LARGE)
        await heard.wait()
        rest.append(len(await reader.readexactly(length)))  # the rest came all the same
        done.set()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    upstream = Upstream(server.sockets[0].getsockname()[1], 1)
    async with server:
        assert SIZE > 16 * WRITE_PIECE_BYTES  # more than the sockets take at once
        answer = await upstream.request("POST", b"/v1/x", [], bytearray(SIZE))
        heard.set()
        assert answer.status == 413
        assert await answer.read() == b"big"
        answer.close()
        upstream.close()
        await done.wait()
    assert rest == [SIZE]


async def test_a_large_body_arrives_whole_and_in_order() -> None:
    body = bytearray(i % 251 for i in range(SIZE))
    got: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        got.append(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    upstream = Upstream(server.sockets[0].getsockname()[1], 1)
    async with server:
        answer = await upstream.request("POST", b"/v1/x", [], body)
        assert (answer.status, await answer.read()) == (200, b"ok")
        answer.close()
        upstream.close()
    assert got == [bytes(body)]
