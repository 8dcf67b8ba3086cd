"""The fetcher against a real socket, from a peer (its own HTTP exchange) and from a
file's url (httpx), on asyncio's loop and on uvloop's (the gateway's where installed):
a whole answer, a range, a cut, a refusal."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from gpu_arbiter.gateway.files.fetch import CHUNK_BYTES, FetchError, HttpFetcher, Source

DATA = bytes(range(256)) * 24000  # about 6 MiB: several chunks
Loop = Callable[[], asyncio.AbstractEventLoop] | None
LOOPS: list[Loop] = [None]
with contextlib.suppress(ImportError):
    import uvloop

    LOOPS.append(uvloop.new_event_loop)


def run(
    loop: Callable[[], asyncio.AbstractEventLoop] | None, work: Coroutine[Any, Any, Any]
) -> Any:
    with asyncio.Runner(loop_factory=loop) as runner:
        return runner.run(work)


@contextlib.asynccontextmanager
async def peer(mode: str) -> AsyncIterator[str]:
    """A server answering ``GET``: ``whole``, ``cut`` (closes half-way) or ``refuse``."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        asked = [ln.split(":", 1)[1].strip() for ln in head.split("\r\n") if ln.startswith("range")]
        start = int(asked[0][6:].rstrip("-")) if asked else 0
        if mode == "refuse":
            body = json.dumps({"error": {"message": "no model file 'x' here"}}).encode()
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        else:
            status = b"206 Partial Content" if start else b"200 OK"
            extra = b"content-range: bytes %d-%d/%d\r\n" % (start, len(DATA) - 1, len(DATA))
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: %d\r\n" % (len(DATA) - start)
                         + (extra if start else b"") + b"\r\n")  # fmt: skip
            writer.write(DATA[start : len(DATA) // 2] if mode == "cut" else DATA[start:])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}/files/m.gguf"


async def fetch(
    mode: str, start: int = 0, via: str | None = "gw-a", buffers: list[bytearray] | None = None
) -> tuple[int, bytes]:
    """What a fetch gives; ``buffers``: each chunk, once read, is given back to be filled
    again, and kept there."""
    fetcher = HttpFetcher(lambda peer, method, target: f"signed {method} {target}", timeout_s=5)
    got = bytearray()
    async with peer(mode) as url, fetcher.open(Source(url, peer=via), start) as download:
        async for chunk in download.chunks:
            got += chunk
            if buffers is not None and isinstance(chunk, bytearray):
                buffers.append(chunk)
                download.give_back(chunk)
    await fetcher.aclose()
    return download.start, bytes(got)


VIA = [("gw-a", r"cut: the peer closed after \d+ of", "answered 404: no model file 'x' here"),
       (None, "cut: RemoteProtocolError", "answered 404 Not Found")]  # fmt: skip


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(("via", "cut", "refused"), VIA)
def test_whole_and_ranged(loop: Loop, via: str | None, cut: str, refused: str) -> None:
    assert run(loop, fetch("whole", via=via)) == (0, DATA)
    assert run(loop, fetch("whole", 1000, via)) == (1000, DATA[1000:])


@pytest.mark.parametrize("loop", LOOPS)
def test_chunks_given_back_are_filled_again_and_the_bytes_stay_right(loop: Loop) -> None:
    buffers: list[bytearray] = []
    assert run(loop, fetch("whole", 1000, buffers=buffers)) == (1000, DATA[1000:])
    full = [buffer for buffer in buffers if len(buffer) == CHUNK_BYTES]
    assert len(full) == 5 and len({id(buffer) for buffer in full}) <= 3  # filled again


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(("via", "cut", "refused"), VIA)
def test_a_cut_and_a_refusal(loop: Loop, via: str | None, cut: str, refused: str) -> None:
    with pytest.raises(FetchError, match=cut):
        run(loop, fetch("cut", via=via))
    with pytest.raises(FetchError, match=refused):
        run(loop, fetch("refuse", via=via))
