"""``GET /files/{name}``: a model file this gateway holds, for its peers only.

Only a request that carries a verified peer header (``x-arbiter-peer``, the proof a
relayed model request carries: ``peer_identity.py``; its MAC covers the method and the
path, so a header made for one file opens no other) is served; a caller with an API
key and no peer proof is refused 403 (``files_for_peers``). Only the files of this
gateway's own models that its store holds verified are served (404 otherwise: a
``.part``, a file of no model, a path).

``Range: bytes=START-END`` (one range; ``START-`` and ``-SUFFIX`` too) is answered 206
with ``Content-Range``; a range that is not one or lies beyond the file, 416 with
``Content-Range: bytes */SIZE``. On a plain connection the body goes from the page cache
to the socket (ASGI's zero-copy send, ``web/zerocopy.py``: ``sendfile``); over TLS it
streams in :data:`CHUNK_BYTES` reads, each read while the one before it is sent (the
server's flow control holds a slow reader back): a file is never held in memory.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from ...web.zerocopy import ZEROCOPY
from ..servers.config import ModelFile
from .access import Denial
from .answers import Send, send_error

__all__ = ["CHUNK_BYTES", "FILES_FOR_PEERS", "PREFIX", "byte_range", "serve_file"]

PREFIX = "/files/"
CHUNK_BYTES = 1 << 20
FILES_FOR_PEERS = Denial(
    403,
    "permission_denied",
    "model files are served to peer gateways only (a verified x-arbiter-peer header); "
    "an API key does not open them",
)
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def byte_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """The range ``header`` asks for, as (first byte, last byte) within ``size``; None:
    no header (the whole file); a string: why it cannot be served (a 416)."""
    if header is None:
        return None
    found = _RANGE.fullmatch(header.strip())
    if found is None:
        return f"{header[:64]!r} is not one range bytes=START-END"
    first, last = found.groups()
    if not first and not last:
        return "bytes=- names no byte"
    if not first:  # the last N bytes
        suffix = int(last)
        if suffix == 0 or size == 0:
            return "an empty suffix range"
        return (max(0, size - suffix), size - 1)
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or (last and int(last) < start):
        return f"bytes {start}-{last} lie beyond the file's {size} bytes"
    return (start, end)


async def serve_file(
    send: Send,
    name: str,
    held: Iterable[ModelFile],
    root: Path,
    range_header: str | None,
    zero_copy: bool = False,
) -> None:
    """Answers ``GET /files/{name}`` from ``root`` (the request's peer proof checked);
    ``zero_copy``: the server offers ASGI's zero-copy send."""
    file = next((f for f in held if f.name == name), None)
    if file is None:
        await send_error(send, 404, f"no model file {name[:200]!r} here", "not_found")
        return
    wanted = byte_range(range_header, file.size)
    if isinstance(wanted, str):
        unsatisfiable = [(b"content-range", f"bytes */{file.size}".encode())]
        await send_error(send, 416, f"range refused: {wanted}", "range_not_satisfiable",
                         headers=unsatisfiable)  # fmt: skip
        return
    start, end = (0, file.size - 1) if wanted is None else wanted
    headers = [
        (b"content-type", b"application/octet-stream"),
        (b"content-length", str(end - start + 1).encode()),
        (b"accept-ranges", b"bytes"),
        (b"x-sha256", file.sha256.encode()),
    ]
    if wanted is not None:
        headers.append((b"content-range", f"bytes {start}-{end}/{file.size}".encode()))
    try:
        source = (root / name).open("rb")
    except OSError:
        await send_error(send, 404, f"model file {name!r} is gone", "not_found")
        return
    with source:
        status = 200 if wanted is None else 206
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if zero_copy:
            await send({"type": ZEROCOPY, "file": source, "offset": start,
                        "count": end + 1 - start, "more_body": False})  # fmt: skip
        else:
            await _stream(send, source, start, end + 1 - start)


async def _stream(send: Send, source: BinaryIO, start: int, length: int) -> None:
    """``length`` bytes of ``source`` from ``start``, two chunks in memory at most: the
    next one is read (in a thread) while the one in hand is sent."""
    source.seek(start)
    left = length
    reading = asyncio.ensure_future(asyncio.to_thread(source.read, min(CHUNK_BYTES, left)))
    try:
        while left > 0:
            chunk = await reading
            if not chunk:  # the file shrank meanwhile: the answer ends short
                break
            left -= len(chunk)
            if left > 0:
                reading = asyncio.ensure_future(
                    asyncio.to_thread(source.read, min(CHUNK_BYTES, left))
                )
            await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
    finally:
        if not reading.done():  # cut: the read in hand ends before the file is closed
            await asyncio.wait([reading])
    if left > 0:
        raise OSError(f"the model file ended {left} bytes short")
