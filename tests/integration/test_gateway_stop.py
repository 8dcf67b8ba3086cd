"""How a request ends when its model stops under it, through a real gateway process,
controller, agent and model server processes (tests/integration/model_server.py).

A gateway stopped with SIGTERM answers each new request 503 at once, gives the requests
in flight the model's grace, ends the rest as a preemption ends them (a plain request:
503 naming why; a stream: a final ``data: {"error": ...}`` event that the ``openai`` SDK
raises), logs no traceback and exits 0. A stream cut by a preemption or an unload ends
with the same event. A server deaf to SIGTERM while its request is cut (as
``llama-server`` is while it generates) is killed the engine's short stop time after its
SIGTERM, not a second grace later: the preemptor is not held for two graces."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .agents import ExitWatch
from .conftest import Server, wait_for
from .gateways import MODEL_SERVER, GatewayProcess, chat, records
from .test_gateway import Setup

pytestmark = pytest.mark.timeout(180)
MESSAGES: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture
def setup(start_server: Callable[..., Server], tmp_path: Path) -> Iterator[Setup]:
    record = tmp_path / "record"
    record.mkdir()
    found = Setup(start_server(), tmp_path / "rt", record)
    yield found
    for process in reversed(found.started):
        process.stop()
    found.admin.close()


def entry(name: str, record: Path, *, ignore_term: bool = False, **keys: Any) -> str:
    """A ``[models.NAME]`` table running the test model server (``ignore_term``: it
    records its SIGTERM and carries on; only SIGKILL ends it)."""
    command = [sys.executable, str(MODEL_SERVER), "--port", "{port}", "--name", name]
    command += ["--mb", "15000", "--load-s", "0.2", "--record", str(record)]
    command += ["--ignore-term"] if ignore_term else []
    keys = {"vram": "16G", "idle_after": "0.1s", "queue_timeout": "60s", **keys}
    lines = [f"[models.{name}]", f"command = {json.dumps(command)}"]
    return "\n".join(lines + [f"{key} = {json.dumps(value)}" for key, value in keys.items()]) + "\n"


class Streamed:
    """A streaming chat completion read with the ``openai`` SDK in a thread: the
    content of each chunk, and the exception the SDK raised (None: the stream ended)."""

    def __init__(self, url: str, model: str, **body: Any) -> None:
        self.chunks: list[str | None] = []
        self.error: Exception | None = None
        self.done = False
        self._client = openai.OpenAI(
            base_url=url + "/v1", api_key="none", max_retries=0, timeout=120
        )
        self._thread = threading.Thread(target=self._read, args=(model, body), daemon=True)
        self._thread.start()

    def _read(self, model: str, body: dict[str, Any]) -> None:
        try:
            stream = self._client.chat.completions.create(
                model=model, messages=MESSAGES, stream=True, extra_body=body
            )
            for chunk in stream:
                self.chunks.append(chunk.choices[0].delta.content)
        except Exception as error:
            self.error = error
        finally:
            self.done = True
            self._client.close()

    def join(self, timeout_s: float = 60.0) -> None:
        self._thread.join(timeout_s)
        assert self.done, "the stream did not end"


def _post_later(url: str, body: dict[str, Any]) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []

    def post() -> None:
        answers.append(httpx.post(url, json=body, timeout=120))

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread, answers


def _sdk_error(streamed: Streamed) -> dict[str, Any]:
    """The gateway's error event as the SDK raised it (not a broken connection: the
    SDK raises that as APIConnectionError, a subclass)."""
    error = streamed.error
    assert type(error) is openai.APIError, repr(error)
    assert isinstance(error.body, dict)
    return error.body


def _in_flight(gateway: GatewayProcess, model: str, count: int) -> bool:
    replicas = gateway.model_state(model)["replicas"]
    return bool(replicas) and replicas[0]["in_flight"] == count


def test_sigterm_refuses_new_requests_gives_the_grace_then_ends_the_rest_as_a_preemption(
    setup: Setup, tmp_path: Path
) -> None:
    setup.agent()
    gateway = setup.gateway(entry("chat", setup.record, grace="3s", max_parallel=8))
    url = gateway.url + "/v1/chat/completions"
    never, later = tmp_path / "never", tmp_path / "later"
    plain, plain_answer = _post_later(url, chat("chat", tokens=2, token_s=120))
    cut = Streamed(gateway.url, "chat", hold=str(never))
    finishing = Streamed(gateway.url, "chat", hold=str(later))
    wait_for(lambda: _in_flight(gateway, "chat", 3), 60, "three requests in flight")
    wait_for(lambda: len(cut.chunks) >= 1 and len(finishing.chunks) >= 1, 30, "first tokens")
    assert gateway.proc is not None

    gateway.proc.terminate()

    def refused() -> httpx.Response | None:
        answer = httpx.post(url, json=chat("chat"), timeout=30)
        return answer if answer.status_code == 503 else None

    new = wait_for(refused, 30, "a new request refused")  # the listener still answers
    assert new.json()["error"]["code"] == "unavailable"
    assert "the gateway is stopping" in new.json()["error"]["message"]
    assert new.headers["retry-after"] == "1"
    later.touch()  # within the grace: it finishes as if nothing happened
    finishing.join()
    assert finishing.error is None and finishing.chunks == ["t0", "t1", "t2"]
    cut.join()
    body = _sdk_error(cut)
    assert body["code"] == "unavailable" and body["status"] == 503
    assert "the gateway is stopping" in body["message"]
    assert "did not finish within its 3s grace" in body["message"]
    assert cut.chunks[:1] == ["t0"]
    plain.join(60)
    [answer] = plain_answer
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "unavailable" and "the gateway is stopping" in error["message"]
    assert gateway.proc.wait(timeout=60) == 0
    text = gateway.log.read_text()
    for bad in ("Traceback", "CancelledError", "Cancel ", "ASGI callable"):
        assert bad not in text, text
    [server] = records(setup.record, "chat")
    assert server["terms"] == 1  # one SIGTERM, once the requests were done or cut


def test_a_stream_cut_by_an_unload_ends_with_an_error_event(setup: Setup, tmp_path: Path) -> None:
    setup.agent()
    gateway = setup.gateway(entry("chat", setup.record, grace="1s"))
    cut = Streamed(gateway.url, "chat", hold=str(tmp_path / "never"))
    wait_for(lambda: len(cut.chunks) >= 1, 60, "the first token")

    with gateway.client() as client:
        done = client.post("/admin/models/chat/unload", json={})
    assert done.status_code == 200, done.text

    cut.join()
    body = _sdk_error(cut)
    assert body["code"] == "unavailable"
    assert "unloaded by an operator" in body["message"]
    assert "ASGI callable" not in gateway.log.read_text()


def test_a_server_deaf_to_sigterm_while_its_request_is_cut_gets_no_second_grace(
    setup: Setup, tmp_path: Path
) -> None:
    """The batch server ignores SIGTERM (llama-server does while it generates or just
    after a cancelled request). Its stream is cut at the end of the 12 s grace with the
    final error event; SIGKILL follows the generic engine's 3 s stop time, not a second
    grace, so the interactive caller waits about one grace, not two."""
    grace_s = 12.0
    setup.agent("1x24G:sm_86", "--grace-s", "60")  # it supervises; its own grace is longer
    models = entry(
        "batch", setup.record, ignore_term=True, priority="batch", grace=f"{grace_s:g}s"
    )  # fmt: skip
    models += entry("chat", setup.record, priority="interactive")
    gateway = setup.gateway(models)
    cut = Streamed(gateway.url, "batch", hold=str(tmp_path / "never"))
    wait_for(lambda: len(cut.chunks) >= 1, 60, "the batch stream's first token")
    victim = ExitWatch(records(setup.record, "batch")[0]["pid"])

    asked_at = time.time()
    answer = httpx.post(gateway.url + "/v1/chat/completions", json=chat("chat"), timeout=120)
    served_s = time.time() - asked_at

    assert answer.status_code == 200, answer.text
    cut.join()
    body = _sdk_error(cut)
    assert "preempted for" in body["message"] and body["status"] == 503
    [batch] = records(setup.record, "batch")
    assert batch["terms"] == 1 and "exit_at" not in batch  # deaf to it: SIGKILLed
    assert batch["term_at"] - asked_at >= grace_s - 1  # its request had the grace
    killed_after_s = victim.wait() - batch["term_at"]
    assert killed_after_s < grace_s / 2  # the stop time (3 s), not a second grace (12 s)
    [chat_server] = records(setup.record, "chat")
    assert victim.wait() < chat_server["started_at"]  # I4: only once the victim is gone
    assert served_s < 2 * grace_s  # two graces before
    print(f"preemptor served in {served_s:.1f}s; SIGKILL {killed_after_s:.1f}s after SIGTERM")
