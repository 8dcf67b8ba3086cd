"""Where a model file's bytes come from: a :class:`Source` (a peer gateway's
``GET /files/NAME``, or the file's ``url``), opened from a byte offset by a
:class:`Fetcher`. The store (``store.py``) writes, hashes and checks what comes; this
is only the transport, so that a ten-line fake replaces it in tests.

:class:`HttpFetcher` is the real one, asking ``Range: bytes=START-`` when resuming. A
peer is asked over a plain HTTP/1.1 exchange (:meth:`HttpFetcher._from_peer`): its
answer is the gateway's own (``requests/files.py``: a Content-Length, no redirect, no
chunks), read by a buffered protocol straight into the store's chunks
(``receive.py``), with this gateway's ``x-arbiter-peer`` header for
that peer, method and path (``peer_identity.py``: the same proof a relayed model
request carries), over the gateway's peer TLS context (``serve.py``'s ``_peer_tls``).
httpx reads 64 KiB at a time, which held a loopback copy to a quarter of ``curl``'s
rate (``bench/bench_file_copy.py``). A ``url`` is anybody's server (redirects, chunked
answers): httpx, streaming, takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

import httpx

from .receive import Receiver

T = TypeVar("T")
__all__ = ["CHUNK_BYTES", "Download", "FetchError", "Fetcher", "HttpFetcher", "Source"]

CHUNK_BYTES = 1 << 20
"""The most one read hands the store (the buffer a copy holds)."""
MAX_HEAD_BYTES = 64 * 1024
ERROR_BYTES = 4096  # of a refusal's body, for the reason


class FetchError(Exception):
    """A source that could not give the file (refused, unreachable, a bad answer)."""


@dataclass(frozen=True, slots=True)
class Source:
    """Where a copy comes from: ``url`` (a peer's ``/files/NAME``, or the file's own
    url); ``peer``: the peer gateway's name (None: a plain URL); ``label``: as the log
    and a waiting caller read it."""

    url: str
    peer: str | None = None

    @property
    def label(self) -> str:
        return self.peer if self.peer is not None else (urlsplit(self.url).hostname or self.url)


def _keep(chunk: bytearray) -> None:
    """A chunk handed back to a source that does not use its chunks again."""


@dataclass(slots=True)
class Download:
    """An opened source: ``start``, the offset its first byte is at (0 when it ignored
    the range asked for), and its bytes as they come. ``give_back``: a chunk its reader
    is done with, which the source may fill again (no fresh buffer, zeroed and faulted
    in, for every MiB that comes)."""

    start: int
    chunks: AsyncIterator[bytes | bytearray]
    give_back: Callable[[bytearray], None] = _keep


class Fetcher(Protocol):
    def open(self, source: Source, start: int) -> contextlib.AbstractAsyncContextManager[Download]:
        """The source's bytes from ``start`` on (or from 0, saying so); raises
        :class:`FetchError` when it cannot."""


Sign = Callable[[str, str, str], "str | None"]
"""(peer, method, target) -> the ``x-arbiter-peer`` header for it (None: no key known)."""


class HttpFetcher:
    """Files over HTTP(S): ``sign`` makes the peer header; ``tls``: the peer TLS context
    (the cluster's CA, this gateway's certificate), for peers only: a file's ``url`` is
    checked against the system's CAs, as any download is."""

    def __init__(
        self, sign: Sign, tls: ssl.SSLContext | None = None, timeout_s: float = 30.0
    ) -> None:
        self.sign = sign
        self.tls = tls
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), follow_redirects=True)

    async def aclose(self) -> None:
        await self._http.aclose()

    @contextlib.asynccontextmanager
    async def open(self, source: Source, start: int) -> AsyncIterator[Download]:
        if source.peer is not None:
            async with self._from_peer(source, source.peer, start) as download:
                yield download
            return
        headers = {"range": f"bytes={start}-"} if start else {}
        try:
            async with self._http.stream("GET", source.url, headers=headers) as answer:
                if answer.status_code not in (200, 206):
                    raise FetchError(f"answered {answer.status_code} {answer.reason_phrase}")
                range_ = answer.headers.get("content-range", "")
                begin = _start_of_answer(answer.status_code, range_, start)
                yield Download(begin, _chunks(answer))
        except httpx.HTTPError as error:
            raise FetchError(f"{error.__class__.__name__}: {error}") from None

    @contextlib.asynccontextmanager
    async def _from_peer(self, source: Source, peer: str, start: int) -> AsyncIterator[Download]:
        """``GET /files/NAME`` of a peer gateway, signed, on a connection of its own."""
        parts = urlsplit(source.url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        signed = self.sign(peer, "GET", target)
        if signed is None:
            raise FetchError(f"no key of {peer} in this gateway's view")
        secure = parts.scheme == "https"
        host = parts.hostname or "127.0.0.1"
        port = parts.port or (443 if secure else 80)
        context = (self.tls or ssl.create_default_context()) if secure else None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout_s):
                transport, receiver = await loop.create_connection(
                    lambda: Receiver(CHUNK_BYTES), host, port, ssl=context,
                    server_hostname=host if secure else None,
                )  # fmt: skip
        except (OSError, TimeoutError, ssl.SSLError) as error:
            raise FetchError(f"cannot connect to {host}:{port}: {error}") from None
        try:
            asked = [f"GET {target} HTTP/1.1", f"host: {parts.netloc}", "connection: close",
                     f"x-arbiter-peer: {signed}"]  # fmt: skip
            if start:
                asked.append(f"range: bytes={start}-")
            transport.write(("\r\n".join(asked) + "\r\n\r\n").encode("latin-1"))
            status, headers = _parsed_head(await self._within(receiver.head(MAX_HEAD_BYTES)))
            length = _length(headers)
            if status not in (200, 206):
                body = await self._within(receiver.chunk(min(length, ERROR_BYTES)))
                raise FetchError(f"answered {status}: {_reason(bytes(body[:ERROR_BYTES]))}")
            begin = _start_of_answer(status, headers.get("content-range", ""), start)
            yield Download(begin, self._body(receiver, length), receiver.give_back)
        finally:
            transport.close()

    async def _within(self, reading: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await reading
        except TimeoutError:
            raise FetchError(f"cut: nothing came for {self.timeout_s:g}s") from None

    async def _body(self, receiver: Receiver, length: int) -> AsyncIterator[bytes | bytearray]:
        left = length
        while left > 0:
            chunk = await self._within(receiver.chunk(left))
            if not chunk:
                why = f" ({receiver.error})" if receiver.error else ""
                raise FetchError(
                    f"cut: the peer closed after {length - left} of {length} bytes{why}"
                )
            if len(chunk) > left:
                raise FetchError(f"the peer sent more than the {length} bytes it said")
            left -= len(chunk)
            yield chunk


def _parsed_head(raw: bytes | None) -> tuple[int, dict[str, str]]:
    """An answer's status and headers (lower-case names)."""
    if raw is None:
        raise FetchError("no answer's head (the peer closed, or beyond 64 KiB)")
    lines = raw.decode("latin-1").split("\r\n")
    words = lines[0].split(" ", 2)
    if len(words) < 2 or not words[1].isdigit():
        raise FetchError(f"not an HTTP answer: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return int(words[1]), headers


def _length(headers: Mapping[str, str]) -> int:
    found = headers.get("content-length", "")
    if not found.isdigit():
        raise FetchError("an answer without a Content-Length")
    return int(found)


def _reason(body: bytes) -> str:
    """A refusal's reason: the gateway's error message, else the body's first words."""
    try:
        return str(json.loads(body)["error"]["message"])[:500]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace") or "no reason given"


def _start_of_answer(status: int, content_range: str, start: int) -> int:
    """Where an answer's bytes begin: ``start`` for a 206 that says so, 0 for a 200."""
    if status == 200:
        return 0
    if content_range.startswith(f"bytes {start}-"):
        return start
    raise FetchError(f"a 206 for another range ({content_range[:80]!r}, asked {start}-)")


async def _chunks(answer: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in answer.aiter_raw():  # as read: none held back, so a cut keeps
            yield chunk  # every byte that came
    except httpx.HTTPError as error:
        raise FetchError(f"cut: {error.__class__.__name__}: {error}") from None
