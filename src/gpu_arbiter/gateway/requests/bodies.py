"""Request bodies: what the gateway holds of them, and how it finds the model in them.

Bodies held in memory are bounded twice: ``max_body_bytes`` for one request (beyond
it: :class:`TooLarge`, a 413) and ``max_buffered_bytes`` for all of them together
(:class:`BodyBudget`; beyond it: :class:`OverBudget`, a 503 with ``Retry-After``).
Only what is needed to find the model is held and looked at:

- a JSON body (``POST /v1/...``) is read whole (the model may be its last key) and
  scanned for its top-level ``model`` string without building the document
  (:func:`json_model`: a million nested arrays cost no memory beyond the body);
- a multipart body (``/v1/audio/transcriptions``, ``/v1/images/edits``) is held up to
  the end of its ``model`` field (:class:`MultipartModel`); the rest streams on;
- a body to ``/models/NAME/...`` is not held at all: it streams to the model server
  as it comes (:func:`stream_rest`).

A held body is one ``bytearray`` (one allocation, grown in place and given back whole
when the request ends), never a list of chunks joined later.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_BUFFERED_BYTES",
    "BodyBudget",
    "ClientGone",
    "HeldBody",
    "MultipartModel",
    "OverBudget",
    "TooLarge",
    "asks_stream",
    "boundary_of",
    "json_model",
    "json_true",
    "scan_model",
    "stream_rest",
]

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]

MAX_BODY_BYTES = 64 * 1024 * 1024
"""One request's body, by default (``[gateway] max_body_bytes``)."""
MAX_BUFFERED_BYTES = 256 * 1024 * 1024
"""The bodies held in memory at once, all requests, by default (``max_buffered_bytes``)."""
MAX_PART_HEAD_BYTES = 16 * 1024
"""A multipart part's own headers (``Content-Disposition``...) beyond this: malformed."""
MAX_MODEL_BYTES = 4096
"""A ``model`` field longer than this: malformed (a name, not a payload)."""


class ClientGone(Exception):
    """The client went away before its request's body had arrived."""


class TooLarge(Exception):
    """The body is over ``max_body_bytes``."""


class OverBudget(Exception):
    """Holding more of the body would take the bodies held over ``max_buffered_bytes``."""


class BodyBudget:
    """Bytes of request bodies held in memory now, all requests together."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class HeldBody:
    """The part of one request's body held in memory (``data``), counted in the budget
    until :meth:`release`; ``more``: whether the client has more of it to send."""

    def __init__(self, budget: BodyBudget, max_bytes: int) -> None:
        self.budget = budget
        self.max_bytes = max_bytes
        self.data = bytearray()
        self.more = True

    async def read(self, receive: Receive) -> None:
        """Holds the next part the client sent; raises :class:`TooLarge`,
        :class:`OverBudget` or :class:`ClientGone`."""
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        self.more = bool(message.get("more_body"))
        if len(self.data) + len(chunk) > self.max_bytes:
            raise TooLarge
        if not self.budget.take(len(chunk)):
            raise OverBudget
        self.data += chunk

    async def read_all(self, receive: Receive) -> None:
        while self.more:
            await self.read(receive)

    def release(self) -> None:
        self.budget.give(len(self.data))
        self.data = bytearray()


async def stream_rest(receive: Receive, sent: int, max_bytes: int) -> AsyncIterator[bytes]:
    """The rest of a body as the client sends it, ``sent`` bytes of it already taken;
    raises :class:`TooLarge` beyond ``max_bytes`` in all, :class:`ClientGone`."""
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        more = bool(message.get("more_body"))
        sent += len(chunk)
        if sent > max_bytes:
            raise TooLarge
        if chunk:
            yield chunk


# ---------------------------------------------------------------------------- JSON

_SPACE = re.compile(rb"[ \t\r\n]*")
_SCALAR = re.compile(rb"[^,:\[\]{}\" \t\r\n]+")
_NESTING = re.compile(rb'["\[\]{}]')
_MODEL_KEY = b'"model"'


class _Malformed(Exception):
    pass


def json_model(body: bytes | bytearray) -> str | None:
    """The top-level ``model`` string of a JSON object (the last one, as a JSON parser
    reads duplicates), or None when there is none or the body is not such an object.

    Nested values are skipped bracket to bracket and string to string: nothing of the
    document is built, and no single step (a regular expression, a ``find``) runs
    longer than a stretch of plain text takes to search, so that a scan run in a
    thread leaves the event loop its turns whatever the body."""
    try:
        value = _top_level(body, _MODEL_KEY)
        found = json.loads(value) if value is not None and value.startswith(b'"') else None
    except (_Malformed, ValueError):
        return None
    return found if isinstance(found, str) else None


def json_true(body: bytes | bytearray, name: str) -> bool:
    """Whether the top-level ``name`` of a JSON object is ``true`` (``"stream"``: the
    gateway asks only for a request that has to wait), scanned as :func:`json_model`."""
    try:
        return _top_level(body, json.dumps(name).encode()) == b"true"
    except (_Malformed, ValueError):
        return False


SCAN_IN_THREAD_BYTES = 1024 * 1024
"""A JSON body larger than this is scanned in a thread: the event loop goes on relaying
meanwhile."""


async def scan_model(body: bytearray) -> str | None:
    """:func:`json_model`, in a thread for a large body."""
    if len(body) > SCAN_IN_THREAD_BYTES:
        return await asyncio.to_thread(json_model, body)
    return json_model(body)


async def asks_stream(body: bytearray) -> bool:
    """Whether a JSON body asks for an event stream (``"stream": true``), in a thread
    for a large body."""
    if len(body) > SCAN_IN_THREAD_BYTES:
        return await asyncio.to_thread(json_true, body, "stream")
    return json_true(body, "stream")


def _top_level(body: bytes | bytearray, quoted: bytes) -> bytes | None:
    """The raw value of the last top-level key ``quoted`` (``b'"model"'``) of a JSON
    object; None when it has none or is not an object; :class:`_Malformed`."""
    pos = _space(body, 0)
    if body[pos : pos + 1] != b"{":
        return None
    found: bytes | None = None
    pos = _space(body, pos + 1)
    if body[pos : pos + 1] == b"}":
        return None
    while True:
        if body[pos : pos + 1] != b'"':
            raise _Malformed
        key_end = _string_end(body, pos)
        key = bytes(body[pos:key_end])
        pos = _space(body, key_end)
        if body[pos : pos + 1] != b":":
            raise _Malformed
        start = _space(body, pos + 1)
        pos = _value_end(body, start)
        if key == quoted or (b"\\" in key and json.loads(key) == json.loads(quoted)):
            found = bytes(body[start:pos])
        pos = _space(body, pos)
        separator = body[pos : pos + 1]
        if separator == b"}":
            return found
        if separator != b",":
            raise _Malformed
        pos = _space(body, pos + 1)


def _space(body: bytes | bytearray, pos: int) -> int:
    match = _SPACE.match(body, pos)
    return match.end() if match else pos


def _string_end(body: bytes | bytearray, pos: int) -> int:
    """Past the quote that closes the string opening at ``pos``."""
    end = pos
    while True:
        end = body.find(b'"', end + 1)
        if end < 0:
            raise _Malformed
        escapes = 0
        while body[end - 1 - escapes] == 0x5C:  # a quote after an odd number of \ is text
            escapes += 1
        if escapes % 2 == 0:
            return end + 1


def _value_end(body: bytes | bytearray, pos: int) -> int:
    """Where the JSON value starting at ``pos`` ends."""
    first = body[pos : pos + 1]
    if first == b'"':
        return _string_end(body, pos)
    if first in (b"[", b"{"):
        return _container_end(body, pos)
    scalar = _SCALAR.match(body, pos)
    if scalar is None:
        raise _Malformed
    return scalar.end()


def _container_end(body: bytes | bytearray, pos: int) -> int:
    """Past the bracket that closes the one at ``pos``: only brackets and strings are
    looked at (a regular expression skips the rest)."""
    depth = 0
    while True:
        mark = _NESTING.search(body, pos)
        if mark is None:
            raise _Malformed
        char = body[mark.start()]
        if char == 0x22:  # a string: brackets in it do not count
            pos = _string_end(body, mark.start())
            continue
        depth += 1 if char in (0x5B, 0x7B) else -1
        pos = mark.end()
        if depth == 0:
            return pos


# ---------------------------------------------------------------------------- multipart

_BOUNDARY = re.compile(r';\s*boundary=(?:"([^"]{1,70})"|([^;\s]{1,70}))', re.IGNORECASE)
_FIELD_NAME = re.compile(
    rb'^content-disposition:[^\r\n]*;\s*name=(?:"([^"]*)"|([^;\s]+))', re.IGNORECASE | re.M
)


def boundary_of(content_type: str) -> bytes | None:
    """The boundary of a ``multipart/form-data`` content type, or None."""
    match = _BOUNDARY.search(content_type)
    if match is None:
        return None
    return (match.group(1) or match.group(2)).encode("latin-1")


class MultipartModel:
    """Finds the ``model`` field of a multipart body as its bytes arrive: :meth:`feed`
    takes all the bytes so far and goes on where it stopped (each byte looked at once,
    but for the length of a delimiter)."""

    def __init__(self, boundary: bytes) -> None:
        self.delimiter = b"\r\n--" + boundary
        self.pos = 0  # where to look next
        self.part_start: int | None = None  # the current part's headers, once found
        self.model_start: int | None = None  # the model field's value, once found
        self.ended = False  # the closing delimiter came: no model field
        self.malformed = False

    def feed(self, data: bytes | bytearray) -> str | None:
        """The model, once the whole of its field has arrived."""
        while not (self.ended or self.malformed):
            if self.part_start is None:
                if not self._next_part(data):
                    return None
            elif self.model_start is None:
                if not self._part_head(data):
                    return None
            else:
                return self._model_value(data)
        return None

    def _delimiter_at(self, data: bytes | bytearray) -> tuple[int, int] | None:
        """The next delimiter: (start, end); the first may open the body without CRLF."""
        if self.pos == 0:
            if len(data) < len(self.delimiter):
                return None
            if data.startswith(self.delimiter[2:]):
                return 0, len(self.delimiter) - 2
        found = data.find(self.delimiter, self.pos)
        if found < 0:
            self.pos = max(self.pos, len(data) - len(self.delimiter) + 1)
            return None
        return found, found + len(self.delimiter)

    def _next_part(self, data: bytes | bytearray) -> bool:
        found = self._delimiter_at(data)
        if found is None or len(data) < found[1] + 2:
            return False
        after = bytes(data[found[1] : found[1] + 2])
        if after == b"--":
            self.ended = True
        elif after == b"\r\n":
            self.part_start = self.pos = found[1] + 2
        else:
            self.malformed = True
        return True

    def _part_head(self, data: bytes | bytearray) -> bool:
        assert self.part_start is not None
        if data[self.part_start : self.part_start + 2] == b"\r\n":
            head, content = b"", self.part_start + 2  # a part without headers
        else:
            end = data.find(b"\r\n\r\n", self.part_start, self.part_start + MAX_PART_HEAD_BYTES)
            if end < 0:
                self.malformed = len(data) - self.part_start >= MAX_PART_HEAD_BYTES
                return self.malformed
            head, content = bytes(data[self.part_start : end]), end + 4
        name = _FIELD_NAME.search(head)
        if name is not None and (name.group(1) or name.group(2)) == b"model":
            self.model_start = self.pos = content
        else:
            self.part_start, self.pos = None, content
        return True

    def _model_value(self, data: bytes | bytearray) -> str | None:
        assert self.model_start is not None
        found = data.find(self.delimiter, self.model_start)
        if found < 0:
            self.malformed = len(data) - self.model_start > MAX_MODEL_BYTES + len(self.delimiter)
            return None
        try:
            return bytes(data[self.model_start : found]).decode("utf-8").strip()
        except UnicodeDecodeError:
            self.malformed = True
            return None
