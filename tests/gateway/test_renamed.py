"""An answer's ``model`` renamed to the caller's name: a JSON object's top-level key
only, every other byte as it came; an event stream line by line wherever its chunks
split, never a byte twice; and the relay's use of it (``pass_on``): a JSON answer's new
``Content-Length``, what passes unchanged."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_arbiter.gateway.requests.relay import Exchange, pass_on
from gpu_arbiter.gateway.requests.renamed import (
    HELD_MAX,
    LINE_MAX,
    Events,
    named_already,
    renamed,
)

GGUF = "/work/models/tiny-chat.gguf"
_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)
_objects = st.dictionaries(st.text(), _values, max_size=6)


@given(_objects, st.text(), st.booleans(), st.booleans())
def test_any_json_object_keeps_every_other_key_and_gets_the_name(
    found: dict[str, Any], name: str, compact: bool, ascii_only: bool
) -> None:
    found = {**found, "model": GGUF}
    separators = (",", ":") if compact else (", ", ": ")
    body = json.dumps(found, separators=separators, ensure_ascii=ascii_only).encode()
    done = renamed(body, name)
    assert done is not None
    assert json.loads(done) == {**found, "model": name}
    before, _, after = body.partition(json.dumps(GGUF).encode())
    assert done.startswith(before) and done.endswith(after)  # every other byte as it came


@given(_objects, st.text())
def test_an_object_without_a_top_level_model_string_is_left_alone(
    found: dict[str, Any], name: str
) -> None:
    found.pop("model", None)
    nested = {**found, "usage": {"model": GGUF}}
    assert renamed(json.dumps(nested).encode(), name) is None
    assert renamed(json.dumps({**found, "model": 7}).encode(), name) is None


@pytest.mark.parametrize(
    "body",
    [b"", b"[DONE]", b"[1, 2]", b'"model"', b'{"model": "x"', b'{"model": "x"} {}',
     b'{"model": "x",}', b"\xff{", b'{"model" "x"}', b'{model: "x"}'],
)  # fmt: skip
def test_what_is_not_one_json_object_passes(body: bytes) -> None:
    assert renamed(body, "chat") is None


@given(_objects, st.sampled_from(["chat", "chat@gw-4", GGUF, "ü", 'a"b']), st.booleans())
def test_an_answer_that_names_the_model_as_asked_already_passes_as_it_came(
    found: dict[str, Any], name: str, compact: bool
) -> None:
    separators = (",", ":") if compact else (", ", ": ")
    for value in ({**found, "model": name}, {**found, "usage": {"model": name}}, [name]):
        body = json.dumps(value, separators=separators, ensure_ascii=False).encode()
        if named_already(body, name):  # renaming gives the same bytes, or nothing
            assert renamed(body, name) in (body, None)
    body = json.dumps({"model": name, "n": 1}, separators=separators, ensure_ascii=False)
    assert named_already(body.encode(), name)


@pytest.mark.parametrize(
    "body",
    [b'{"model": "chat", "usage": {"model": "chat"}}', b'{"model": "chatty"}',
     b'{"mod\\u0065l": "x", "u": {"model": "chat"}}', b'{"model": "gw"}', b'{"model"}',
     b'{"n": 1}'],
)  # fmt: skip
def test_what_may_need_a_rename_is_parsed(body: bytes) -> None:
    assert not named_already(body, "chat")


def test_the_last_model_key_is_the_one_renamed_as_json_reads_it() -> None:
    assert renamed(b'{"model":"a", "model" : "b" }', "chat") == b'{"model":"a", "model" : "chat" }'


_STREAM = (
    b": a comment\n\n"
    b'data: {"id":"1","model":"' + GGUF.encode() + b'","choices":[{"delta":{"content":"h"}}]}\n\n'
    b'data:{"model":"' + GGUF.encode() + b'","choices":[]}\r\n\r\n'
    b'data: {"error":{"message":"no","model":"x"}}\n\n'
    b"event: ping\ndata: not json\n\n"
    b"data: [DONE]\n\n"
)
_RENAMED = _STREAM.replace(json.dumps(GGUF).encode(), b'"chat@gw-4"')


@given(st.lists(st.integers(0, len(_STREAM)), max_size=8))
def test_a_stream_split_anywhere_comes_out_renamed_once(cuts: list[int]) -> None:
    events, out = Events("chat@gw-4"), bytearray()
    bounds = [0, *sorted(cuts), len(_STREAM)]
    for begin, end in itertools.pairwise(bounds):
        sent = events.feed(_STREAM[begin:end])
        assert sent.count(b"\n") == _STREAM[:end].count(b"\n") - out.count(b"\n")  # at once
        out += sent
    out += events.end()
    assert bytes(out) == _RENAMED


def test_a_line_longer_than_the_limit_passes_as_it_came() -> None:
    events = Events("chat")
    line = b'data: {"model":"m","x":"' + b"a" * (LINE_MAX + 10_000) + b'"}\n'
    out = b"".join(events.feed(line[i : i + 4096]) for i in range(0, len(line), 4096))
    out += events.feed(b'data: {"model":"m"}\n') + events.end()
    assert out == line + b'data: {"model":"chat"}\n'


def test_a_line_the_stream_never_ended_is_sent_as_it_came() -> None:
    events = Events("chat")
    assert events.feed(b'data: {"model":"m"}') == b""
    assert events.end() == b'data: {"model":"m"}'


class _Answer:
    """An upstream answer (``base.upstream.Answer``'s reading side), its body in chunks."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], chunks: list[bytes]):
        self.status, self.headers, self._chunks = status, headers, list(chunks)
        self.closed = False

    async def read(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""

    @property
    def ended(self) -> bool:
        return not self._chunks

    def close(self) -> None:
        self.closed = True


async def _passed(answer: _Answer, rename: str | None) -> tuple[dict[str, Any], bytes]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await pass_on(send, answer, Exchange(), [(b"x-served-by", b"gw-4/chat")], rename)
    assert answer.closed
    assert not any(m.get("body") == b"" and m.get("more_body") for m in sent)
    return sent[0], b"".join(m["body"] for m in sent[1:])


def _json(body: bytes, **headers: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            *((k.encode(), v) for k, v in headers.items())]  # fmt: skip


async def test_a_json_answer_is_renamed_with_its_new_length() -> None:
    body = json.dumps({"model": GGUF, "choices": [{"text": "hi"}]}).encode()
    start, sent = await _passed(_Answer(200, _json(body), [body[:10], body[10:]]), "gpt-4o-mini")
    assert json.loads(sent) == {"model": "gpt-4o-mini", "choices": [{"text": "hi"}]}
    headers = dict(start["headers"])
    assert headers[b"content-length"] == str(len(sent)).encode()
    assert sum(k == b"content-length" for k, _ in start["headers"]) == 1
    assert headers[b"x-served-by"] == b"gw-4/chat"


@pytest.mark.parametrize(
    ("status", "content_type", "length"),
    [(200, b"text/plain", None), (200, b"application/json", HELD_MAX + 1),
     (400, b"application/json", None), (200, b"application/json", -1)],
)  # fmt: skip
async def test_what_is_not_a_json_answer_to_hold_passes_unchanged(
    status: int, content_type: bytes, length: int | None
) -> None:
    body = json.dumps({"model": GGUF}).encode()
    headers = [(b"content-type", content_type)]
    if length is None:
        headers.append((b"content-length", str(len(body)).encode()))
    elif length >= 0:
        headers.append((b"content-length", str(length).encode()))
    start, sent = await _passed(_Answer(status, headers, [body]), "chat")
    assert sent == body
    assert [h for h in start["headers"] if h[0] != b"x-served-by"] == headers


async def test_an_answer_not_json_at_all_keeps_its_bytes_and_length() -> None:
    body = b"{not json"
    start, sent = await _passed(_Answer(200, _json(body), [body]), "chat")
    assert sent == body and dict(start["headers"])[b"content-length"] == b"9"


async def test_an_event_stream_is_renamed_as_it_comes() -> None:
    headers = [(b"content-type", b"text/event-stream")]
    chunks = [_STREAM[i : i + 7] for i in range(0, len(_STREAM), 7)]
    _, sent = await _passed(_Answer(200, headers, chunks), "chat@gw-4")
    assert sent == _RENAMED


async def test_without_a_name_nothing_is_renamed() -> None:
    body = json.dumps({"model": GGUF}).encode()
    _, sent = await _passed(_Answer(200, _json(body), [body]), None)
    assert sent == body
