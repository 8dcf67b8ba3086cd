"""The gateway in front of llama.cpp's real server (``llama_server`` fixture: tests/llama.py)
on tiny GGUF models, driven by the official ``openai`` SDK as its users drive it, with a
real controller and agent (fake probe: the GPUs are simulated, the server runs on the CPU).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gpu_arbiter.gateway.servers.estimate import estimate_vram

from .agents import ExitWatch
from .conftest import wait_for
from .gateways import GatewayProcess, metric
from .test_gateway import Setup, setup

__all__ = ["setup"]

pytestmark = pytest.mark.timeout(180)


def llama_entry(
    name: str, server: Path, model: Path, *, ctx: int = 512, flags: tuple[str, ...] = (),
    **keys: Any,
) -> tuple[str, list[str]]:  # fmt: skip
    """One ``[models.NAME]`` table running the real llama-server, and its command."""
    command = [str(server), "-m", str(model), "-c", str(ctx), "--port", "{port}", "-t", "1"]
    command += flags
    keys = {"idle_after": "0.3s", "grace": "2s", "queue_timeout": "120s", **keys}
    lines = [f"[models.{name}]", f"command = {json.dumps(command)}"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
    return "\n".join(lines) + "\n", command


@pytest.fixture
def sdk() -> Iterator[Any]:
    """``sdk(gateway)``: an OpenAI client of that gateway (no retries: a failure shows)."""
    made: list[openai.OpenAI] = []

    def make(gateway: GatewayProcess) -> openai.OpenAI:
        client = openai.OpenAI(
            base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def ask(client: openai.OpenAI, model: str, tokens: int = 8) -> str:
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=tokens
    )
    assert answer.choices[0].message.content is not None
    return answer.choices[0].message.content


def lease_of(setup: Setup, model: str) -> dict[str, Any]:
    [lease] = setup.held(model)
    return lease


def test_a_cold_start_from_the_gguf_chat_and_stream_through_the_sdk(
    setup: Setup, sdk: Any, llama_server: Path, tiny_models: Path
) -> None:
    setup.agent()
    entry, command = llama_entry(
        "chat", llama_server, tiny_models / "tiny-chat.gguf", vram="auto",
        aliases=["gpt-4o-mini"], keep_alive="5m",
    )  # fmt: skip
    gateway = setup.gateway(entry)
    client = sdk(gateway)
    assert ask(client, "gpt-4o-mini")  # cold: the first request starts the server
    expected = estimate_vram(tuple(command)).total_mb
    assert lease_of(setup, "chat")["vram_mb"] == expected  # vram = "auto", from the file
    chunks = list(
        client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
            stream=True,
        )
    )  # fmt: skip
    assert len(chunks) >= 2
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    completion = client.completions.create(model="chat", prompt="once upon", max_tokens=4)
    assert completion.choices[0].text is not None
    listed = {model.id for model in client.models.list()}
    assert {"chat", "gpt-4o-mini"} <= listed
    assert client.models.retrieve("chat").id == "chat"
    page = httpx.get(gateway.url + "/metrics").text
    assert metric(page, "gpu_arbiter_gateway_cold_starts_total", model="chat") == 1


def test_keep_warm_holds_across_many_requests_and_goes_idle_after_each(
    setup: Setup, sdk: Any, llama_server: Path, tiny_models: Path
) -> None:
    """After every request, not only the first, the lease is marked idle within
    ``idle_after`` (a cache the arbiter may reclaim) and busy again for the next one."""
    setup.agent()
    entry, _ = llama_entry("chat", llama_server, tiny_models / "tiny-chat.gguf", vram="1G")
    gateway = setup.gateway(entry)
    client = sdk(gateway)
    pids = set()
    for _ in range(4):
        ask(client, "chat")
        wait_for(lambda: lease_of(setup, "chat")["idle"] is True, 20, "the lease idle")
        assert gateway.model_state("chat")["state"] == "warm"
        pids.add(gateway.model_state("chat")["replicas"][0]["pid"])
    assert len(pids) == 1  # one server, kept warm
    page = httpx.get(gateway.url + "/metrics").text
    assert metric(page, "gpu_arbiter_gateway_cold_starts_total", model="chat") == 1


def test_keep_alive_stops_the_real_server_and_releases_its_lease(
    setup: Setup, sdk: Any, llama_server: Path, tiny_models: Path
) -> None:
    setup.agent()
    entry, _ = llama_entry(
        "chat", llama_server, tiny_models / "tiny-chat.gguf", vram="1G", keep_alive="1s"
    )
    gateway = setup.gateway(entry)
    ask(sdk(gateway), "chat")
    pid = gateway.model_state("chat")["replicas"][0]["pid"]
    wait_for(lambda: gateway.model_state("chat")["state"] == "cold", 30, "the keep-alive stop")
    assert not Path(f"/proc/{pid}").exists()
    assert setup.held("chat") == []
    page = httpx.get(gateway.url + "/metrics").text
    assert metric(page, "gpu_arbiter_gateway_stops_total", model="chat", reason="keep_alive") == 1


def test_an_idle_real_server_is_reclaimed_by_another_models_request(
    setup: Setup, sdk: Any, llama_server: Path, tiny_models: Path
) -> None:
    setup.agent()
    chat, _ = llama_entry("chat", llama_server, tiny_models / "tiny-chat.gguf", vram="14G")
    big, _ = llama_entry("big", llama_server, tiny_models / "tiny-big.gguf", vram="14G")
    gateway = setup.gateway(chat + big)
    client = sdk(gateway)
    ask(client, "chat")
    chat_pid = gateway.model_state("chat")["replicas"][0]["pid"]
    wait_for(lambda: lease_of(setup, "chat")["idle"] is True, 20, "chat idle")
    ask(client, "big")  # 14G + 14G > 24G: chat's idle lease is reclaimed for it
    assert not Path(f"/proc/{chat_pid}").exists()
    assert gateway.model_state("chat")["state"] == "cold"
    assert setup.held("chat") == []
    page = httpx.get(gateway.url + "/metrics").text
    assert metric(page, "gpu_arbiter_gateway_stops_total", model="chat", reason="reclaimed") == 1


def test_a_stream_of_a_batch_model_is_preempted_by_an_interactive_one(
    setup: Setup, llama_server: Path, tiny_models: Path
) -> None:
    """A batch stream the client reads slowly is still in flight when an interactive
    model needs the GPU: the batch server is stopped after its grace, its stream ends,
    with a final error event, and the interactive server starts only once the batch one
    has exited (I4)."""
    setup.agent("1x24G:sm_86", "--grace-s", "1")
    batch, _ = llama_entry(
        "batch", llama_server, tiny_models / "tiny-chat.gguf", ctx=2048, vram="14G",
        priority="batch", grace="1s", flags=("--context-shift",),
    )  # fmt: skip  # past its 2048 context: it generates for about 16 s, past the grace
    chat, _ = llama_entry(
        "chat", llama_server, tiny_models / "tiny-big.gguf", vram="14G", priority="interactive"
    )
    gateway = setup.gateway(batch + chat)
    body = {
        "model": "batch", "messages": [{"role": "user", "content": "go"}], "stream": True,
        "max_tokens": 16000, "ignore_eos": True,
    }  # fmt: skip
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", gateway.url + "/v1/chat/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # after the comments
        batch_pid = gateway.model_state("batch")["replicas"][0]["pid"]
        asked: list[httpx.Response] = []
        chat_body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        url = gateway.url + "/v1/chat/completions"
        thread = threading.Thread(
            target=lambda: asked.append(httpx.post(url, json=chat_body, timeout=120))
        )
        thread.start()
        wait_for(lambda: not Path(f"/proc/{batch_pid}").exists(), 60, "the batch server gone")
        events = [line for line in lines if line.startswith("data: ")]
    last = json.loads(events[-1][len("data: ") :])  # cut short: the final event says why
    assert last["error"]["code"] == "unavailable" and "preempted" in last["error"]["message"]
    thread.join(120)
    assert asked and asked[0].status_code == 200, asked and asked[0].text
    ended = [
        lease for lease in setup.admin.get("/v1/leases").json()
        if lease["holder"].startswith("gateway batch ")
    ]  # fmt: skip
    assert [lease["revoke_reason"] for lease in ended] == ["preempted"]
    page = httpx.get(gateway.url + "/metrics").text
    assert metric(page, "gpu_arbiter_gateway_stops_total", model="batch", reason="preempted") == 1


def test_a_generating_llama_server_is_stopped_without_a_second_grace(
    setup: Setup, llama_server: Path, tiny_models: Path
) -> None:
    """A batch llama-server generates a long stream (read through the SDK) when an
    interactive model needs the GPU: the stream gets the 4 s grace, is cut with the final
    error event (the SDK raises it), and the server, which may ignore SIGTERM while it
    generates or just after a cancelled request, is killed llama.cpp's short stop time
    after the cut, not a grace later."""
    grace_s = 4.0
    setup.agent("1x24G:sm_86", "--grace-s", "60")  # it supervises; its own grace is longer
    batch, _ = llama_entry(
        "batch", llama_server, tiny_models / "tiny-chat.gguf", ctx=2048, vram="14G",
        priority="batch", grace=f"{grace_s:g}s", flags=("--context-shift",),
    )  # fmt: skip  # past its 2048 context: it generates for about 16 s
    chat, _ = llama_entry(
        "chat", llama_server, tiny_models / "tiny-big.gguf", vram="14G", priority="interactive"
    )
    gateway = setup.gateway(batch + chat)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="batch", messages=[{"role": "user", "content": "go"}], stream=True,
        max_tokens=16000, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    victim = ExitWatch(gateway.model_state("batch")["replicas"][0]["pid"])
    asked: list[float] = []
    chat_body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}

    def ask_chat() -> None:
        started = time.time()
        answer = httpx.post(gateway.url + "/v1/chat/completions", json=chat_body, timeout=120)
        assert answer.status_code == 200, answer.text
        asked.extend([started, time.time() - started])

    thread = threading.Thread(target=ask_chat)
    thread.start()
    with pytest.raises(openai.APIError) as raised:
        list(chunks)
    thread.join(120)
    client.close()
    assert type(raised.value) is openai.APIError  # the final event, not a broken stream
    assert "preempted" in raised.value.message
    assert asked, "the interactive request failed"
    started, served_s = asked
    gone_s = victim.wait() - started  # the grace, the cut, the stop time
    assert gone_s >= grace_s - 0.5  # the stream had its grace
    assert gone_s < 2 * grace_s - 0.5  # not a second grace
    print(f"llama: batch gone {gone_s:.1f}s, preemptor served {served_s:.1f}s after it asked")


def test_the_answer_names_the_model_as_the_caller_asked_for_it(
    setup: Setup, sdk: Any, llama_server: Path, tiny_models: Path
) -> None:
    """llama.cpp's server names itself by the path of its GGUF file; the caller gets
    the name it sent (the model's, an alias, or ``MODEL@GATEWAY``) in a JSON answer, with
    its length, and in every chunk of a stream."""
    setup.agent()
    entry, _ = llama_entry(
        "chat", llama_server, tiny_models / "tiny-chat.gguf", vram="1G",
        aliases=["gpt-4o-mini"], keep_alive="5m",
    )  # fmt: skip
    gateway = setup.gateway(entry)
    client = sdk(gateway)
    hello = [{"role": "user", "content": "hello"}]
    raw = client.chat.completions.with_raw_response.create(
        model="chat", messages=hello, max_tokens=4
    )
    assert raw.parse().model == "chat"
    assert int(raw.headers["content-length"]) == len(raw.content)
    here = raw.headers["x-served-by"].partition("/")[0]  # MODEL@GATEWAY: this gateway's
    for asked in ("gpt-4o-mini", f"chat@{here}"):
        answer = client.chat.completions.create(model=asked, messages=hello, max_tokens=4)
        assert answer.model == asked
        chunks = list(
            client.chat.completions.create(model=asked, messages=hello, max_tokens=4, stream=True)
        )
        assert chunks  # a random-weight model may end at its first token: one chunk
        assert {chunk.model for chunk in chunks} == {asked}
    completion = client.completions.create(model="gpt-4o-mini", prompt="once", max_tokens=2)
    assert completion.model == "gpt-4o-mini"
