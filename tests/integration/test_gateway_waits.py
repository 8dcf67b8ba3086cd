"""A caller waiting for a cold model sees why: a streaming request gets its head at once
and SSE comment lines (queued, then loading) before the model server's own stream; every
answer relayed names the wait in ``x-queue-seconds``. Through the real gateway process,
controller, agent and test model server."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from .conftest import wait_for
from .gateways import chat, model_entry
from .test_gateway import Setup, setup

__all__ = ["setup"]

pytestmark = pytest.mark.timeout(120)


def _block(setup: Setup) -> str:
    """A lease of 20 GiB of box's 24: a 10 GiB model queues behind it."""
    held = setup.admin.post(
        "/v1/leases", json={"vram_mb": 20480, "ttl_s": 120, "constraints": {"worker": "box"}}
    )
    assert held.status_code == 201, held.text
    lease_id: str = held.json()["id"]
    return lease_id


def _events(lines: Iterator[str]) -> Iterator[str]:
    return (line for line in lines if line)


def test_a_streaming_request_to_a_cold_model_sees_queued_then_loading(setup: Setup) -> None:
    setup.agent()
    blocker = _block(setup)
    gateway = setup.gateway(model_entry("chat", setup.record, mb=8000, vram="10G", load_s=4))
    seen: list[str] = []
    with (
        gateway.client() as client,
        client.stream("POST", "/v1/chat/completions", json=chat("chat", stream=True)) as stream,
    ):
        assert stream.status_code == 200
        assert stream.headers["content-type"] == "text/event-stream"
        assert stream.headers["x-queued"] == "true"
        lines = _events(stream.iter_lines())
        first = next(lines)  # at once, before the lease is asked for
        assert first.startswith(": queued, waiting for a lease ("), first
        queued = next(lines)  # as soon as the controller says why it waits
        assert queued.startswith(": queued, position 1: "), queued
        assert "insufficient_vram (need 10.0 GiB" in queued, queued
        assert setup.admin.delete(f"/v1/leases/{blocker}").status_code == 200
        seen = [first, queued, *lines]
    comments = [line for line in seen if line.startswith(":")]
    data = [line for line in seen if line.startswith("data:")]
    assert any(line.startswith(": loading chat (") for line in comments), seen
    assert comments[-2].startswith(": ready after "), seen
    assert comments[-1].startswith(": served by ") and comments[-1].endswith("/chat"), seen
    assert seen.index(comments[-1]) < seen.index(data[0])  # every comment before the data
    chunks = [json.loads(line[len("data: ") :]) for line in data[:-1]]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["t0", "t1", "t2"]
    assert data[-1] == "data: [DONE]"


def test_x_queue_seconds_names_the_wait_and_a_warm_request_gets_no_comments(
    setup: Setup,
) -> None:
    setup.agent()
    gateway = setup.gateway(model_entry("chat", setup.record, mb=8000, vram="10G", load_s=2))
    with gateway.client() as client:
        cold = client.post("/v1/chat/completions", json=chat("chat"))
        assert cold.status_code == 200, cold.text
        assert float(cold.headers["x-queue-seconds"]) >= 2.0  # it waited for the load
        warm = client.post("/v1/chat/completions", json=chat("chat"))
        assert warm.status_code == 200
        assert float(warm.headers["x-queue-seconds"]) < 2.0  # no load to wait for
        body = chat("chat", stream=True)
        with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            assert "x-queued" not in stream.headers
            assert float(stream.headers["x-queue-seconds"]) < 2.0
            lines = list(_events(stream.iter_lines()))
    assert lines[0].startswith("data: "), lines  # the server's own stream, untouched
    assert lines[-1] == "data: [DONE]"


def test_the_openai_sdk_skips_the_comments_and_reads_a_late_error(setup: Setup) -> None:
    """The head went out while the request waited: a refusal after it (here the queue
    timeout) comes as an SSE error event, which the SDK raises as an APIError."""
    setup.agent()
    blocker = _block(setup)
    gateway = setup.gateway(
        model_entry("chat", setup.record, mb=8000, vram="10G", load_s=1, queue_timeout="2s")
    )
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "hi"}
    ]
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", timeout=60) as client:
        late = client.chat.completions.create(model="chat", messages=messages, stream=True)
        with pytest.raises(openai.APIError) as raised:  # the head said 200: the error comes later
            list(late)
        assert "still queued for its lease after 2s" in raised.value.message
        assert isinstance(raised.value.body, dict) and raised.value.body["status"] == 503
        assert setup.admin.delete(f"/v1/leases/{blocker}").status_code == 200

        def streamed() -> list[str | None] | None:
            """The answer's texts; None when the 2 s queue timeout (its load and start,
            which a loaded machine can make longer) ran out first: its load goes on."""
            stream = client.chat.completions.create(model="chat", messages=messages, stream=True)
            try:
                return [chunk.choices[0].delta.content for chunk in stream]
            except openai.APIError as error:
                if "not ready after 2s" not in error.message:
                    raise
                return None

        texts = wait_for(streamed, 60, "chat streamed once its lease is free")
    assert texts == ["t0", "t1", "t2"]  # the cold start's comment lines were skipped


def test_a_client_that_hangs_up_during_the_streaming_wait_gives_its_lease_back(
    setup: Setup,
) -> None:
    setup.agent()
    _block(setup)
    gateway = setup.gateway(model_entry("chat", setup.record, mb=8000, vram="10G"))
    with (
        httpx.Client(base_url=gateway.url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=chat("chat", stream=True)) as stream,
    ):
        lines = _events(stream.iter_lines())
        assert next(line for line in lines if line.startswith(": queued, position 1: "))
        assert len(setup.held("chat")) == 1  # its lease, pending
    wait_for(lambda: not setup.held("chat"), 30, "the pending lease given back")
    assert gateway.model_state("chat")["state"] == "cold"
