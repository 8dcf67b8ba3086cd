"""What a request waiting for a replica is told, on a virtual clock: ``acquire``'s
``on_wait`` and the model's ``waiting_for``; the gateway's app sending a streaming
request's head at once, comment lines on each change and every few seconds, and a late
refusal as an SSE error event; ``json_true`` finding ``"stream": true``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpu_arbiter.gateway.base.metrics import GatewayMetrics
from gpu_arbiter.gateway.requests.answers import AfterHead
from gpu_arbiter.gateway.requests.app import GatewayApp
from gpu_arbiter.gateway.requests.bodies import json_true
from gpu_arbiter.gateway.requests.waits import HEARTBEAT_S
from gpu_arbiter.gateway.servers.replica import ReplicaState

from .fakes import World, settle

pytestmark = pytest.mark.timeout(20)
Message = dict[str, Any]


@pytest.fixture
async def world() -> AsyncIterator[World]:
    found = World(keep_alive="5m", max_parallel=1, queue_timeout="10s")
    yield found
    await found.close()


async def test_on_wait_is_called_once_and_only_when_the_request_has_to_wait(
    world: World,
) -> None:
    waits: list[str] = []
    world.leases.grant = False
    world.health.loaded = False
    first = asyncio.ensure_future(world.model.acquire(lambda: waits.append("first")))
    await settle()
    assert waits == ["first"]
    assert world.model.waiting_for() == "queued, insufficient_vram"  # the arbiter's reason
    world.leases.give(world.replica.lease_id)
    await world.clock.advance(1)
    assert world.model.waiting_for() == "loading chat"
    world.health.loaded = True
    await world.clock.advance(1)
    replica, queued_s = await first
    assert waits == ["first"] and queued_s >= 1.0  # called once, however long it waited
    second = asyncio.ensure_future(world.model.acquire(lambda: waits.append("second")))
    await settle()
    assert waits == ["first", "second"]  # max_parallel 1, one in flight: it waits
    assert world.model.waiting_for() == "waiting for a free slot on chat (max_parallel 1)"
    replica.leave()
    (await second)[0].leave()
    await world.model.acquire(lambda: waits.append("third"))  # a slot free: no wait
    assert waits == ["first", "second"]


async def test_changed_returns_at_the_models_next_change(world: World) -> None:
    changed = asyncio.ensure_future(world.model.changed())
    await settle()
    assert not changed.done()
    world.model.notify()
    await settle()
    assert changed.done()


class Exchange:
    """One request to the app: the body the client sends, and what the app sent back."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = json.dumps(body).encode()
        self.sent: list[Message] = []
        self.gone = asyncio.Event()
        self._given = False

    async def receive(self) -> Message:
        if not self._given:
            self._given = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    def scope(self) -> dict[str, Any]:
        length = str(len(self.body)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", length)]
        path = "/v1/chat/completions"
        return {"type": "http", "method": "POST", "path": path, "headers": headers}

    def heads(self) -> list[Message]:
        return [m for m in self.sent if m["type"] == "http.response.start"]

    def text(self) -> str:
        return b"".join(m.get("body", b"") for m in self.sent).decode()


def _app(world: World) -> GatewayApp:
    return GatewayApp({"chat": world.model}, {"chat": "chat"}, GatewayMetrics())


async def test_a_streaming_request_that_waits_is_told_why_then_refused_in_the_stream(
    world: World,
) -> None:
    world.leases.grant = False
    exchange = Exchange({"model": "chat", "stream": True})
    request = asyncio.ensure_future(_app(world)(exchange.scope(), exchange.receive, exchange.send))
    await settle()
    [head] = exchange.heads()
    assert head["status"] == 200
    assert (b"content-type", b"text/event-stream") in head["headers"]
    assert (b"x-queued", b"true") in head["headers"]
    assert exchange.text() == ": queued, insufficient_vram (0.0s)\n\n"  # at once
    await world.clock.advance(HEARTBEAT_S)  # nothing changed: a heartbeat
    assert exchange.text().endswith(f": queued, insufficient_vram ({HEARTBEAT_S:.1f}s)\n\n")
    world.replica.pending_reason = "position 1: waiting for 1024 MiB"
    world.model.notify()  # a change: said at once, not at the next beat
    await world.clock.advance(0.5)
    assert exchange.text().endswith(": queued, position 1: waiting for 1024 MiB (3.0s)\n\n")
    await world.clock.advance(10)  # queue_timeout: the head said 200, the error comes after
    await request
    assert len(exchange.heads()) == 1
    last = exchange.sent[-1]
    assert not last.get("more_body")
    event = last["body"].decode()
    assert event.startswith("data: ") and event.endswith("\n\n")
    error = json.loads(event[len("data: ") :])["error"]
    assert error["status"] == 503 and error["code"] == "unavailable"
    assert "still queued for its lease after 10s" in error["message"]


async def test_a_request_not_streaming_waits_silently_and_names_its_wait(world: World) -> None:
    world.leases.grant = False
    exchange = Exchange({"model": "chat", "stream": False})
    request = asyncio.ensure_future(_app(world)(exchange.scope(), exchange.receive, exchange.send))
    await world.clock.advance(5)
    assert exchange.sent == []
    await world.clock.advance(5)
    await request
    [head] = exchange.heads()
    assert head["status"] == 503
    assert (b"x-queue-seconds", b"10.000") in head["headers"]


async def test_a_client_that_hangs_up_while_told_why_ends_the_comments(world: World) -> None:
    world.leases.grant = False
    exchange = Exchange({"model": "chat", "stream": True})
    request = asyncio.ensure_future(_app(world)(exchange.scope(), exchange.receive, exchange.send))
    await settle()
    exchange.gone.set()
    await world.clock.advance(1)
    await request  # over before queue_timeout
    sent = len(exchange.sent)
    await world.clock.advance(HEARTBEAT_S * 2)
    assert len(exchange.sent) == sent  # no comment after it
    assert not world.model.replicas or world.replica.state is ReplicaState.ENDED


async def test_after_the_head_a_200_streams_on_and_an_error_becomes_an_event() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    ok = AfterHead(send)
    await ok({"type": "http.response.start", "status": 200, "headers": []})
    await ok({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    assert sent == [{"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True}]
    sent.clear()
    failed = AfterHead(send)
    await failed({"type": "http.response.start", "status": 400, "headers": []})
    await failed({"type": "http.response.body", "body": b"context too ", "more_body": True})
    await failed({"type": "http.response.body", "body": b"long"})
    [event] = sent
    error = json.loads(event["body"][len(b"data: ") :])["error"]
    assert error == {
        "message": "the model server answered 400: context too long",
        "type": "invalid_request_error",
        "code": "model_error",
        "status": 400,
    }


@pytest.mark.parametrize(
    ("body", "streams"),
    [
        (b'{"model": "m", "stream": true}', True),
        (b'{"stream" : true , "model": "m"}', True),
        (b'{"\\u0073tream": true}', True),
        (b'{"stream": true, "stream": false}', False),  # the last, as a JSON parser reads it
        (b'{"stream": "true"}', False),
        (b'{"options": {"stream": true}}', False),  # only the top level
        (b'{"stream": true', False),  # malformed
        (b"[true]", False),
        (b"", False),
    ],
)
def test_json_true_finds_a_top_level_true(body: bytes, streams: bool) -> None:
    assert json_true(body, "stream") is streams
    assert json_true(bytearray(body), "stream") is streams


async def test_the_held_json_body_goes_to_the_replicas_pick(world: World) -> None:
    """With prefix affinity on, the pick reads the request's prefix from it."""
    bodies: list[bytes | bytearray | None] = []
    acquire = world.model.acquire

    async def recording(on_wait: Any = None, priority: int | None = None, body: Any = None) -> Any:
        bodies.append(body)
        return await acquire(on_wait, priority, body)

    world.model.acquire = recording  # type: ignore[method-assign]
    world.leases.grant = False
    exchange = Exchange({"model": "chat", "messages": []})
    request = asyncio.ensure_future(_app(world)(exchange.scope(), exchange.receive, exchange.send))
    await world.clock.advance(10)
    await request
    assert [bytes(body or b"") for body in bodies] == [exchange.body]
