"""What the gateway itself answers, over ASGI: a body with its length, JSON, an error in
OpenAI's shape (``{"error": {"message", "type", "code"}}``, a 503 with
``Retry-After``), the final error event of an event stream cut short, and
:class:`AfterHead`, how the rest of an answer goes once an event stream's head went
out while the request waited."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from ...web.jsontext import dumps
from ..servers.model import Refused

__all__ = [
    "MAX_ERROR_BYTES",
    "SSE_HEAD",
    "STOPPING",
    "AfterHead",
    "Headers",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "error_event",
    "send_bytes",
    "send_error",
    "send_final_error",
    "send_json",
    "send_refused",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
STOPPING = "the gateway is stopping"
MAX_ERROR_BYTES = 64 * 1024
"""Of a model server's error answer to a request whose head went out while it waited,
this much is kept for the SSE error event (the rest is read and dropped)."""
SSE_HEAD = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-queued", b"true"),
]


async def send_bytes(
    send: Send, status: int, body: bytes, content_type: bytes, extra: Any = ()
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    headers += list(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, value: Any, extra: Any = ()) -> None:
    body = dumps(value, what="a gateway answer").encode()
    await send_bytes(send, status, body, b"application/json", extra)


async def send_error(
    send: Send,
    status: int,
    message: str,
    code: str,
    retry_after_s: float | None = None,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """An error in OpenAI's shape. Sent before the client's body has all come, the
    connection stays open: uvicorn reads the rest and drops it (holding none of it),
    as closing with unread bytes would reset the connection, the answer with it."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    extra = list(headers)
    if retry_after_s is not None:
        extra.append((b"retry-after", str(max(1, round(retry_after_s))).encode()))
    body = {"error": {"message": message, "type": kind, "code": code}}
    await send_json(send, status, body, extra)


async def send_refused(send: Send, refused: Refused, waited_s: float) -> None:
    """The queue's refusal (502, 503; 404 for a model removed meanwhile), with how long
    the request waited."""
    codes = {502: "model_failed", 404: "model_not_found"}
    code = codes.get(refused.status, "unavailable")
    queued = [(b"x-queue-seconds", f"{waited_s:.3f}".encode())]
    await send_error(send, refused.status, refused.reason, code, refused.retry_after_s, queued)


async def send_final_error(send: Send, status: int, message: str, code: str) -> None:
    """The final event of an event stream cut short, in OpenAI's error shape."""
    error = {"message": message, "type": "server_error", "code": code, "status": status}
    event = b"data: " + dumps({"error": error}, what="an error event").encode() + b"\n\n"
    with contextlib.suppress(OSError):
        await send({"type": "http.response.body", "body": event, "more_body": False})


class AfterHead:
    """Sends the rest of an answer whose head (200, an event stream) went out while the
    request waited: the model server's 200 streams on as it comes, its head dropped;
    any other answer (the model server's or the gateway's own error) becomes one SSE
    ``data:`` event in OpenAI's error shape, its status in it, and the stream ends."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.status = 0
        self.error = bytearray()

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            served = dict(message.get("headers") or ()).get(b"x-served-by")
            if served and self.status == 200:  # its head is gone: a comment line says it
                line = b": served by " + served + b"\n\n"
                await self.send({"type": "http.response.body", "body": line, "more_body": True})
        elif self.status == 200:
            await self.send(message)
        else:
            body: bytes = message.get("body", b"")
            self.error += body[: MAX_ERROR_BYTES - len(self.error)]
            if not message.get("more_body"):
                error = dumps(error_event(self.status, self.error), what="an error event")
                event = b"data: " + error.encode()
                await self.send({"type": "http.response.body", "body": event + b"\n\n"})


def error_event(status: int, body: bytes | bytearray) -> dict[str, Any]:
    """An error answer as OpenAI's error object, with its ``status``: the body when it
    is one already, else the body's text in one."""
    try:
        found = json.loads(body)
    except ValueError:
        found = None
    if isinstance(found, dict) and isinstance(found.get("error"), dict):
        return {"error": {**found["error"], "status": status}}
    text = bytes(body).decode("utf-8", "replace")[:1000]
    kind = "invalid_request_error" if status < 500 else "server_error"
    message = f"the model server answered {status}: {text}"
    return {"error": {"message": message, "type": kind, "code": "model_error", "status": status}}
