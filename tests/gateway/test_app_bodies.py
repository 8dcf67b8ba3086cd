"""What the gateway holds of a request's body, and how it finds the model in it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gpu_arbiter.gateway.base.upstream import Upstream
from gpu_arbiter.gateway.requests.bodies import (
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


SIZE = 10 * 1024 * 1024


def _slow_server(sock: socket.socket, received: list[int]) -> None:
    """Reads a request's head, lets its body wait a moment in the sockets (a model
    server busy elsewhere), then reads it into one buffer of its own and answers."""
    into = bytearray(1 << 20)  # made here: recv would make a new bytes each time
    with sock, sock.accept()[0] as conn:
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(65536)
        got = len(head.partition(b"\r\n\r\n")[2])
        time.sleep(0.3)
        while got < SIZE:
            got += conn.recv_into(into)
        received.append(got)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")


async def test_a_held_body_costs_its_size_once_through_to_the_model_server() -> None:
    """A 10 MB JSON body as the gateway holds it: read from its ASGI messages (64 KiB
    each, as uvicorn hands them on), scanned for its model, and written to a model
    server that does not read it at once. Its peak in Python's memory stays below 1.3
    times its size (asyncio's transport copied what the socket did not take: 2.35x)."""
    start, end = b'{"model": "chat", "messages": [{"role": "user", "content": "', b'"}]}'
    parts = [start, *[b"x" * (64 * 1024)] * ((SIZE - len(start) - len(end)) // (64 * 1024))]
    parts.append(b"x" * (SIZE - len(start) - len(end) - sum(map(len, parts[1:]))) + end)

    async def receive() -> dict[str, Any]:
        body = bytes(parts.pop(0))  # each message a new bytes, as a client's arrive
        return {"type": "http.request", "body": body, "more_body": bool(parts)}

    listener = socket.create_server(("127.0.0.1", 0))
    received: list[int] = []
    server = threading.Thread(target=_slow_server, args=(listener, received))
    server.start()
    upstream = Upstream(listener.getsockname()[1], 1)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held = HeldBody(BodyBudget(SIZE), SIZE)
        await held.read_all(receive)
        assert await asyncio.to_thread(json_model, held.data) == "chat"
        answer = await upstream.request("POST", b"/v1/chat/completions", [], held.data)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
        server.join(30)
    assert (answer.status, received) == (200, [SIZE])
    answer.close()
    upstream.close()
    assert peak < 1.3 * SIZE, peak / SIZE
