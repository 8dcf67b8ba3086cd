"""The gateway's connections to llama.cpp's real server (``llama_server``: tests/llama.py)
under concurrent callers: a server that closes its connection after every streamed
answer, without saying so, costs no caller an error."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

import httpx
import pytest

from .test_gateway import Setup, setup
from .test_gateway_llama import llama_entry

__all__ = ["setup"]

pytestmark = pytest.mark.timeout(300)

CALLERS = 16
REQUESTS = 1000


async def _send_all(url: str, requests: int, callers: int) -> collections.Counter[str]:
    """``requests`` chat completions, streamed and plain in turn, from ``callers``
    concurrent callers (each its own keep-alive connection): each answer's status."""
    seen: collections.Counter[str] = collections.Counter()
    numbers = iter(range(requests))

    async def caller(client: httpx.AsyncClient) -> None:
        for number in numbers:
            stream = number % 2 == 0
            body = {
                "model": "chat",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "stream": stream,
            }
            async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
                text = await answer.aread()
            kind = "stream" if stream else "plain"
            ended = text.rstrip().endswith(b"[DONE]") if stream else b"choices" in text
            seen[f"{kind} {answer.status_code}{'' if ended else ' cut'}"] += 1

    clients = [httpx.AsyncClient(base_url=url, timeout=120) for _ in range(callers)]
    try:
        await asyncio.gather(*(caller(client) for client in clients))
    finally:
        for client in clients:
            await client.aclose()
    return seen


def test_hundreds_of_streamed_and_plain_requests_from_16_callers_get_no_error(
    setup: Setup, llama_server: Path, tiny_models: Path
) -> None:
    setup.agent()
    entry, _ = llama_entry(
        "chat", llama_server, tiny_models / "tiny-chat.gguf", vram="1G",
        max_parallel=CALLERS, keep_alive="5m",
    )  # fmt: skip
    gateway = setup.gateway(entry)
    assert (
        httpx.post(  # the cold start, alone
            gateway.url + "/v1/chat/completions",
            json={
                "model": "chat",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
            },
            timeout=120,
        ).status_code
        == 200
    )
    seen = asyncio.run(_send_all(gateway.url, REQUESTS, CALLERS))
    half = REQUESTS // 2
    assert seen == {"stream 200": half, "plain 200": half}, seen
