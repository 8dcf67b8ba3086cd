"""What the gateway holds of a request's body, and how it finds the model in it."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gpu_arbiter.gateway.bodies import (
    BodyBudget,
    ClientGone,
    HeldBody,
    MultipartModel,
    OverBudget,
    TooLarge,
    boundary_of,
    json_model,
    stream_rest,
)


@pytest.mark.parametrize(
    ("body", "model"),
    [
        (b'{"model": "chat"}', "chat"),
        (b' {"messages": [{"model": "x", "c": "]}\\"[{"}], "model" : "chat" } ', "chat"),
        (b'{"stream": true, "n": -1.5e3, "x": null, "model": "m"}', "m"),
        (b'{"model": "a", "model": "b"}', "b"),  # the last, as a JSON parser takes it
        (b'{"\\u006dodel": "caf\\u00e9"}', "caf\u00e9"),  # escapes read as JSON reads them
        (b'{"a": "\\\\", "model": "after-a-backslash"}', "after-a-backslash"),
        (b'{"a": {"model": "nested"}}', None),  # only the top level names the model
        (b'{"model": 7}', None),
        (b'{"model": "cut', None),
        (b'{"model": "a" "b"}', None),
        (b"[1, 2]", None),
        (b"{}", None),
        (b"model=chat", None),
        (b"", None),
    ],
)
def test_the_top_level_model_of_a_json_body(body: bytes, model: str | None) -> None:
    assert json_model(body) == model
    assert json_model(bytearray(body)) == model
    if model is not None:
        assert json.loads(body)["model"] == model  # what the model server will read


def test_a_deeply_nested_body_is_scanned_without_building_it() -> None:
    body = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b', "model": "deep"}'
    assert json_model(body) == "deep"  # json.loads: RecursionError


def _form(boundary: bytes, *parts: tuple[bytes, bytes]) -> bytes:
    found = b"".join(
        b"--" + boundary + b"\r\n" + head + b"\r\n\r\n" + value + b"\r\n" for head, value in parts
    )
    return found + b"--" + boundary + b"--\r\n"


FILE = (b'Content-Disposition: form-data; name="file"; filename="a.wav"', b"\0\r\n--x" * 500)
MODEL = (b'Content-Disposition: form-data; name="model"', b"whisper-1")


@pytest.mark.parametrize("step", [1, 5, 64, 100_000])
def test_the_model_field_of_a_multipart_body_in_pieces_of_any_size(step: int) -> None:
    boundary = b"----b0undary"
    body = _form(boundary, FILE, MODEL, (b'Content-Disposition: form-data; name="x"', b"1"))
    scan = MultipartModel(boundary)
    found = None
    for end in range(step, len(body) + step, step):
        found = scan.feed(body[:end])
        if found is not None:
            break
    assert found == "whisper-1"
    assert end < len(body) or step > len(body)  # found before the end of the body


def test_a_multipart_body_without_a_model_or_malformed() -> None:
    boundary = b"b"
    scan = MultipartModel(boundary)
    assert scan.feed(_form(boundary, FILE)) is None and scan.ended
    bad = MultipartModel(boundary)
    assert bad.feed(b"--b\r\n" + b"x" * 20_000) is None and bad.malformed  # endless head


def test_the_boundary_of_a_content_type() -> None:
    assert boundary_of("multipart/form-data; boundary=abc") == b"abc"
    assert boundary_of('multipart/form-data; charset=x; boundary="a b"') == b"a b"
    assert boundary_of("multipart/form-data") is None


def _client(*messages: dict[str, Any]) -> Callable[[], Awaitable[dict[str, Any]]]:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return receive


def _part(body: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


async def test_held_bodies_share_one_budget_and_give_it_back() -> None:
    budget = BodyBudget(100)
    first, second = HeldBody(budget, 80), HeldBody(budget, 80)
    await first.read_all(_client(_part(b"x" * 40), _part(b"x" * 30, more=False)))
    assert (bytes(first.data), budget.held) == (b"x" * 70, 70)
    with pytest.raises(OverBudget):
        await second.read_all(_client(_part(b"y" * 20), _part(b"y" * 20, more=False)))
    second.release()
    first.release()
    assert budget.held == 0 and not first.data
    with pytest.raises(TooLarge):  # one body's own limit, before the budget's
        await HeldBody(budget, 80).read_all(_client(_part(b"z" * 81, more=False)))
    with pytest.raises(ClientGone):
        await HeldBody(budget, 80).read_all(_client({"type": "http.disconnect"}))


async def test_the_rest_of_a_streamed_body_is_counted_not_held() -> None:
    receive = _client(_part(b"ab"), _part(b""), _part(b"cd", more=False))
    assert [chunk async for chunk in stream_rest(receive, 10, 14)] == [b"ab", b"cd"]
    with pytest.raises(TooLarge):
        async for _ in stream_rest(_client(_part(b"abcdef", more=False)), 10, 14):
            pass
