"""Where a model file's bytes come from: a :class:`Source` (a peer gateway's
``GET /files/NAME``, or the file's ``url``), opened from a byte offset by a
:class:`Fetcher`. The store (``store.py``) writes, hashes and checks what comes; this
is only the transport, so that a ten-line fake replaces it in tests.

:class:`HttpFetcher` is the real one: httpx, streaming, ``Range: bytes=START-`` when
resuming; a peer's request carries this gateway's ``x-arbiter-peer`` header for that
peer, method and path (``peer_identity.py``: the same proof a relayed model request
carries), over the gateway's peer TLS context (``serve.py``'s ``_peer_tls``).
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httpx

__all__ = ["CHUNK_BYTES", "Download", "FetchError", "Fetcher", "HttpFetcher", "Source"]

CHUNK_BYTES = 1 << 16
"""The most one read hands the store (the network's reads: the buffer a copy holds)."""


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


@dataclass(slots=True)
class Download:
    """An opened source: ``start``, the offset its first byte is at (0 when it ignored
    the range asked for), and its bytes as they come."""

    start: int
    chunks: AsyncIterator[bytes]


class Fetcher(Protocol):
    def open(self, source: Source, start: int) -> contextlib.AbstractAsyncContextManager[Download]:
        """The source's bytes from ``start`` on (or from 0, saying so); raises
        :class:`FetchError` when it cannot."""


Sign = Callable[[str, str, str], "str | None"]
"""(peer, method, target) -> the ``x-arbiter-peer`` header for it (None: no key known)."""


class HttpFetcher:
    """Files over HTTP(S) with httpx; ``sign`` makes the peer header; ``tls``: the peer
    TLS context (the cluster's CA, this gateway's certificate)."""

    def __init__(
        self, sign: Sign, tls: ssl.SSLContext | None = None, timeout_s: float = 30.0
    ) -> None:
        self.sign = sign
        verify: ssl.SSLContext | bool = tls if tls is not None else True
        self._http = httpx.AsyncClient(
            verify=verify, timeout=httpx.Timeout(timeout_s), follow_redirects=True
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    @contextlib.asynccontextmanager
    async def open(self, source: Source, start: int) -> AsyncIterator[Download]:
        headers = {"range": f"bytes={start}-"} if start else {}
        if source.peer is not None:
            parts = urlsplit(source.url)
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            signed = self.sign(source.peer, "GET", target)
            if signed is None:
                raise FetchError(f"no key of {source.peer} in this gateway's view")
            headers["x-arbiter-peer"] = signed
        try:
            async with self._http.stream("GET", source.url, headers=headers) as answer:
                yield Download(_start_of(answer, start), _chunks(answer))
        except httpx.HTTPError as error:
            raise FetchError(f"{error.__class__.__name__}: {error}") from None


def _start_of(answer: httpx.Response, start: int) -> int:
    """Where the answer's bytes begin: ``start`` for a 206, 0 for a 200."""
    if answer.status_code == 200:
        return 0
    if answer.status_code == 206 and answer.headers.get("content-range", "").startswith(
        f"bytes {start}-"
    ):
        return start
    raise FetchError(f"answered {answer.status_code} {answer.reason_phrase}".strip())


async def _chunks(answer: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in answer.aiter_raw():  # as read (64 KiB at most): none held back,
            yield chunk  # so a cut keeps every byte that came
    except httpx.HTTPError as error:
        raise FetchError(f"cut: {error.__class__.__name__}: {error}") from None
