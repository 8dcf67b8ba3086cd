"""An answer's ``model`` field renamed to the name its caller asked for. A model server
names itself in its answers (llama.cpp's server: the path of its GGUF file), while an
OpenAI client compares ``model`` with what it sent: the model's name, one of its aliases
or ``MODEL@GATEWAY``, as the request's body named it.

    a JSON answer     held whole when it says its length (at most :data:`HELD_MAX`
                      bytes): :func:`renamed`; its ``Content-Length`` is the new one
                      (one that names the model as asked already passes as it came:
                      :func:`named_already`)
    an event stream   renamed event by event as it comes (:class:`Events`): only the
                      bytes of a line not yet ended are held back, never sent twice

Only the top-level ``model`` key of a JSON object is renamed, and only when its value is a
string; its value's bytes are replaced in place and every other byte is left as it came.
Anything else (a body that is not one JSON object, an answer over the limit or of unknown
length, a ``data:`` line that is not a JSON object, ``[DONE]``, comments, errors) passes
unchanged. Lines end with ``\\n`` (a ``\\r`` before it is kept); a stream whose lines
end with a lone ``\\r`` passes unchanged."""

from __future__ import annotations

import functools
import json
import re

__all__ = ["HELD_MAX", "Events", "model_span", "named_already", "renamed"]

HELD_MAX = 1 << 20
"""The largest JSON answer held to be renamed; a larger one passes unchanged."""
LINE_MAX = 1 << 20
"""The longest event line held back until it ends; a longer one passes unchanged."""
_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
_SPACED_COLON = re.compile(rb"[ \t\n\r]*:[ \t\n\r]*")


def model_span(text: str) -> tuple[int, int] | None:
    """Where the value of the top-level ``"model"`` key is in ``text`` (its last, as
    ``json.loads`` keeps), when ``text`` is one JSON object and that value a string."""
    span = None
    try:
        at = _skip(text, 0)
        if text[at] != "{":
            return None
        at = _skip(text, at + 1)
        closed = text[at] == "}"
        at += closed
        while not closed:
            if text[at] != '"':
                return None
            key, at = _DECODER.raw_decode(text, at)  # a string: it begins with a quote
            at = _skip(text, at)
            if text[at] != ":":
                return None
            begin = _skip(text, at + 1)
            value, end = _DECODER.raw_decode(text, begin)
            if key == "model":
                span = (begin, end) if isinstance(value, str) else None
            at = _skip(text, end)
            closed = text[at] == "}"
            if not closed and text[at] != ",":
                return None
            at = _skip(text, at + 1)
    except (ValueError, IndexError):
        return None
    return span if _skip(text, at) == len(text) else None


def _skip(text: str, at: int) -> int:
    """Past the JSON white space at ``at``."""
    found = _SPACE.match(text, at)
    assert found is not None  # it matches nothing at worst
    return found.end()


def renamed(body: bytes, name: str) -> bytes | None:
    """``body`` with its top-level ``model`` renamed ``name``; None when it has none
    (or is not one JSON object in UTF-8)."""
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return None
    span = model_span(text)
    if span is None:
        return None
    return (text[: span[0]] + json.dumps(name, ensure_ascii=False) + text[span[1] :]).encode()


def named_already(body: bytes, name: str) -> bool:
    """Whether ``body`` is to pass as it came, told by a bytes search, nothing parsed
    (a model server that names the model as its caller did: no answer is rewritten):
    its one ``"model"`` is followed by ``name`` as JSON writes it, and it has no ``\\u``
    escape (the only other way to write a key ``model``). That ``"model"`` is then the
    top-level key's, naming ``name`` already (:func:`renamed` gives the same bytes), or
    there is no top-level ``model`` (or no JSON object: :func:`renamed` gives None)."""
    at = body.find(b'"model"')
    if at < 0 or body.find(b'"model"', at + 7) >= 0 or b"\\u" in body:
        return False
    colon = _SPACED_COLON.match(body, at + 7)
    if colon is None:
        return False
    return body.startswith(_as_json(name), colon.end())


@functools.lru_cache(maxsize=256)
def _as_json(name: str) -> bytes:
    """``name`` as :func:`renamed` writes it (the names asked for are few: kept)."""
    return json.dumps(name, ensure_ascii=False).encode()


class Events:
    """An event stream renamed as it comes: :meth:`feed` each chunk and send what it
    gives at once, then :meth:`end`. Each ended line is renamed (a ``data:`` line whose
    value is a JSON object naming a model) or passed as it is; the bytes of the line not
    yet ended are held back until it ends, up to :data:`LINE_MAX` (then they, and the
    rest of that line, pass unchanged)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._held = bytearray()
        self._passing = False  # the line under way is too long: it passes as it comes

    def feed(self, chunk: bytes) -> bytes:
        """What to send of ``chunk`` now (with the held start of its first line)."""
        last = chunk.rfind(b"\n")
        if last < 0:
            return self._unended(chunk)
        out = bytearray()
        lines = chunk[: last + 1].split(b"\n")[:-1]
        if self._passing:  # the long line ends here: its end passes as it is
            out += lines[0] + b"\n"
            lines = lines[1:]
            self._passing = False
        elif self._held:
            lines[0] = bytes(self._held) + lines[0]
            self._held.clear()
        for line in lines:
            out += self._line(line) + b"\n"
        out += self._unended(chunk[last + 1 :])
        return bytes(out)

    def end(self) -> bytes:
        """The held start of a line the stream never ended, as it came."""
        held, self._held = bytes(self._held), bytearray()
        return held

    def _unended(self, part: bytes) -> bytes:
        if self._passing:
            return part
        self._held += part
        if len(self._held) <= LINE_MAX:
            return b""
        self._passing = True
        return self.end()

    def _line(self, line: bytes) -> bytes:
        if not line.startswith(b"data:"):
            return line
        value = line[5:]
        lead = b" " if value.startswith(b" ") else b""
        value = value[len(lead) :]
        cr = b"\r" if value.endswith(b"\r") else b""
        if not value.startswith(b"{"):
            return line
        value = value[: len(value) - len(cr)]
        done = None if named_already(value, self.name) else renamed(value, self.name)
        return line if done is None else b"data:" + lead + done + cr
