"""The gateway's port is a front door: bounded heads, connections and bodies, API keys,
the Host check and the simple-request rule; and its OpenAI surface (model retrieval,
aliases, multipart uploads, streamed bodies). Through a real gateway process, a real
controller and, where a model must answer, a real agent and test model servers."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .agents import AgentProcess, env_for, worker_state
from .conftest import Server, burst_answers, burst_while_stopped, wait_for
from .gateways import LISTENING, GatewayProcess, chat, metric, model_entry

pytestmark = pytest.mark.timeout(180)

KEYS = ("key-one-0123456789", "key-two-9876543210")
BOUNDS = 'header_timeout = "1s"\nmax_connections = 20\n'


class Port:
    """A controller, and gateways (and an agent) a test starts against it."""

    def __init__(self, server: Server, runtime: Path, record: Path) -> None:
        self.server = server
        self.runtime = runtime
        self.record = record
        self.started: list[GatewayProcess | AgentProcess] = []

    def gateway(self, settings: str = "", models: str = "") -> GatewayProcess:
        models = models or model_entry("chat", self.record, vram="4G", aliases=["gpt-4o-mini"])
        config = f"[gateway]\n{settings}\n{models}"
        gateway = GatewayProcess(self.server.url, self.server.admin_token, self.runtime, config)
        self.started.append(gateway.start())
        return gateway

    def agent(self) -> None:
        token = self.server.admin_token
        agent = AgentProcess(self.server.url, token, "box", self.runtime, "1x24G:sm_86")
        self.started.append(agent.start())
        with self.server.client() as admin:
            wait_for(lambda: worker_state(admin, "box") == "online", what="box online")


@pytest.fixture
def port(start_server: Callable[..., Server], tmp_path: Path) -> Iterator[Port]:
    record = tmp_path / "record"
    record.mkdir()
    found = Port(start_server(), tmp_path / "rt", record)
    yield found
    for process in reversed(found.started):
        process.stop()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _answer(sock: socket.socket, deadline_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (or a reset)."""
    sock.settimeout(deadline_s)
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def _rss_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])


def _error(answer: httpx.Response) -> dict[str, Any]:
    """The OpenAI-shaped error of an answer (its type and code checked present)."""
    error: dict[str, Any] = answer.json()["error"]
    assert set(error) >= {"message", "type", "code"}, error
    return error


# ---------------------------------------------------------------------------- heads


def test_an_oversized_head_and_too_many_headers_are_refused_with_431(port: Port) -> None:
    gateway = port.gateway(BOUNDS)
    with _connect(gateway.url) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
            for _ in range(16):  # 1 MiB in all, unless the gateway stops reading first
                sock.sendall(b"x" * 65536)
        answer = _answer(sock)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 ")
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(200))
    with _connect(gateway.url) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n" + headers + b"\r\n")
        assert _answer(sock).startswith(b"HTTP/1.1 431 ")
    assert httpx.get(gateway.url + "/healthz").status_code == 200


def test_a_body_that_comes_in_the_heads_read_is_not_counted_as_head(port: Port) -> None:
    """The head limit (64 KiB) counts the head only: a body sent with it is the body's."""
    gateway = port.gateway(BOUNDS)
    body = b'{"model": "nope", "input": "' + b"x" * 1_000_000 + b'"}'
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
    head += b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    with _connect(gateway.url) as sock:
        sock.sendall(head + body)
        answer = _answer(sock)
    assert answer.startswith(b"HTTP/1.1 404 "), answer[:200]  # the model is unknown
    assert b'"model_not_found"' in answer


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(
    port: Port,
) -> None:
    gateway = port.gateway(BOUNDS)
    with _connect(gateway.url) as sock:
        answer = _answer(sock, deadline_s=30)  # the timeout is 1 s: closed well before
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")


def test_connections_beyond_the_cap_are_answered_503_and_closed(port: Port) -> None:
    gateway = port.gateway('header_timeout = "5s"\nmax_connections = 20\n')
    opened = [_connect(gateway.url) for _ in range(20)]
    try:
        with _connect(gateway.url) as extra:
            assert _answer(extra).startswith(b"HTTP/1.1 503 ")  # at once, then closed
    finally:
        for sock in opened:
            sock.close()
    wait_for(lambda: _healthy(gateway.url), 20, "the gateway to answer again")


def test_a_burst_while_the_gateway_is_stopped_is_refused_at_accept(port: Port) -> None:
    """The gateway alone, on uvloop (which accepts in libuv, not through the listening
    socket): 200 connections arrive while it is stopped (SIGSTOP) under a limit of 128
    open files; the cap is 20. Each one beyond the cap is answered 503, and it answers
    again once they are gone."""
    gateway = port.gateway(BOUNDS)
    assert gateway.proc is not None
    answers = burst_while_stopped(gateway.proc.pid, gateway.url)
    assert answers.count(b"HTTP/1.1 503 ") >= 200 - 20  # the 20 within the cap: 408 or 503
    assert set(answers) <= {b"HTTP/1.1 503 ", b"HTTP/1.1 408 ", b""}
    wait_for(lambda: _healthy(gateway.url), 20, "the gateway to answer again")


def test_a_burst_of_requests_to_the_stopped_gateway_is_answered_503_and_closed_not_reset(
    port: Port,
) -> None:
    """As above, each connection sending the start of a request's head before the
    gateway runs again: each one beyond the cap reads its 503 and then a close, not a
    reset (the protocol's refusal lingers for the request's unread bytes)."""
    gateway = port.gateway(BOUNDS)
    assert gateway.proc is not None
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # still being sent
    answers = burst_answers(gateway.proc.pid, gateway.url, request=head)
    assert [status for status, _ in answers].count(b"HTTP/1.1 503 ") >= 200 - 20
    assert {status for status, _ in answers} <= {b"HTTP/1.1 503 ", b"HTTP/1.1 408 "}
    assert not any(reset for _, reset in answers)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_beside_the_controller_connections_to_the_gateway_never_starve_the_controller(
    tmp_path: Path,
) -> None:
    """``serve --local --models`` under a 256-descriptor limit: 400 idle connections to
    the gateway leave the controller reachable (they took the whole process before),
    even when they all arrive while the process is stopped (SIGSTOP), as a burst that
    comes while its loop is busy: the listener refuses them at accept."""
    models = tmp_path / "models.toml"
    record = tmp_path / "record"
    record.mkdir()
    models.write_text("[gateway]\nport = 0\n" + model_entry("chat", record, vram="4G"))
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "gpu_arbiter", "serve", "--local", "--simulate", "1x24G"]
    command += ["--models", str(models), "--port", "0", "--state-dir", str(tmp_path / "state")]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=out, env=env_for(tmp_path / "rt"),
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)),
        )  # fmt: skip
    opened: list[socket.socket] = []
    try:
        found = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
        [controller] = wait_for(lambda: found.findall(log.read_text()), 30, "the controller")
        [gateway] = wait_for(lambda: LISTENING.findall(log.read_text()), 30, "the gateway")
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            for _ in range(400):  # the kernel completes each: they wait to be accepted
                with contextlib.suppress(OSError):
                    opened.append(_connect(f"http://127.0.0.1:{gateway}"))
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        for _ in range(5):
            answer = httpx.get(f"http://127.0.0.1:{controller}/healthz", timeout=10)
            assert answer.status_code == 200
        assert proc.poll() is None
        assert "out of system resource" not in log.read_text()  # no accept failed (EMFILE)
    finally:
        for sock in opened:
            sock.close()
        proc.terminate()
        proc.wait(timeout=30)


# ---------------------------------------------------------------------------- bodies


def _post_body(url: str, size: int, results: list[int | str], key: str = "") -> None:
    """POSTs a JSON body of ``size`` bytes naming model ``chat`` at its end; records the
    status and code of the answer (or the error when the gateway cut the upload)."""
    filler = b'{"input": "' + b"x" * (size - 40) + b'", "model": "chat"}'
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        answer = httpx.post(url + "/v1/embeddings", content=filler, headers=headers, timeout=60)
        code = answer.json()["error"]["code"] if answer.status_code >= 400 else ""
        results.append(f"{answer.status_code} {code}".strip())
    except httpx.HTTPError as error:  # the gateway answered and closed before all was sent
        results.append(type(error).__name__)


def test_bodies_over_the_buffered_budget_are_refused_503_and_memory_stays_bounded(
    port: Port,
) -> None:
    """No agent: each request whose body was read waits in the queue, holding its body.
    Eight 40 MB bodies against 64 MiB in all: at most one is held, the others get 503
    ``overloaded`` with Retry-After, and the process does not grow by their sum."""
    settings = 'max_body_bytes = "48M"\nmax_buffered_bytes = "64M"\n'
    models = model_entry("chat", port.record, vram="4G", queue_timeout="4s")
    gateway = port.gateway(settings, models)
    assert gateway.proc is not None
    before = _rss_kb(gateway.proc.pid)
    results: list[int | str] = []
    peak = [0]
    senders = [
        threading.Thread(target=_post_body, args=(gateway.url, 40 << 20, results)) for _ in range(8)
    ]
    for sender in senders:
        sender.start()
    while any(sender.is_alive() for sender in senders):
        peak[0] = max(peak[0], _rss_kb(gateway.proc.pid))
        time.sleep(0.05)
    assert sorted(results).count("503 overloaded") >= 6, results
    assert all(r in ("503 overloaded", "503 unavailable") for r in results), results
    assert peak[0] - before < 200 * 1024  # the eight bodies are 320 MB; 64 MiB may be held
    with httpx.Client(base_url=gateway.url) as client:  # all given back to the budget
        assert metric(client.get("/metrics").text, "gpu_arbiter_gateway_body_bytes_held") == 0
        overloaded = client.post("/v1/embeddings", json={"model": "chat", "input": "x"})
    assert overloaded.status_code == 503  # the queue's: no agent, no replica in 4 s
    assert _error(overloaded)["code"] == "unavailable"
    assert overloaded.headers["retry-after"]


def test_a_body_over_max_body_bytes_is_413_declared_or_streamed(port: Port) -> None:
    gateway = port.gateway('max_body_bytes = "1M"\nmax_buffered_bytes = "1M"\n')
    big = b'{"model": "chat", "input": "' + b"x" * (2 << 20) + b'"}'
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        declared = client.post("/v1/embeddings", content=big, headers=_JSON)
        assert declared.status_code == 413 and _error(declared)["code"] == "too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it comes
            for start in range(0, len(big), 65536):
                yield big[start : start + 65536]

        try:
            streamed = client.post("/v1/embeddings", content=chunks(), headers=_JSON)
            assert streamed.status_code == 413 and _error(streamed)["code"] == "too_large"
        except httpx.WriteError:
            pass  # answered and closed before the upload ended
        assert client.get("/healthz").status_code == 200


_JSON = {"Content-Type": "application/json"}


# ---------------------------------------------------------------------------- access


def test_cross_site_requests_and_a_foreign_host_are_refused_and_start_nothing(
    port: Port,
) -> None:
    gateway = port.gateway('allowed_hosts = ["gpu.example"]\n')
    body = json.dumps(chat("chat")).encode()
    url = gateway.url + "/v1/chat/completions"
    for headers in (
        {"Content-Type": "text/plain"},  # <form enctype=text/plain>, or fetch
        {"Content-Type": "application/x-www-form-urlencoded"},  # a plain <form>
        {"Content-Type": "multipart/form-data; boundary=x"},  # <form enctype=multipart>
        {},  # fetch(url, {method: "POST", mode: "no-cors"})
    ):
        answer = httpx.post(url, content=body, headers=headers)
        assert answer.status_code == 415, headers
        assert _error(answer)["code"] == "unsupported_media_type"
    evil = {"Host": "attacker.example", **_JSON}
    rebound = httpx.post(url, content=body, headers=evil)
    assert rebound.status_code == 421 and _error(rebound)["code"] == "misdirected_request"
    assert httpx.get(gateway.url + "/v1/models", headers=evil).status_code == 421
    named = httpx.get(gateway.url + "/v1/models", headers={"Host": "GPU.example:8080"})
    assert named.status_code == 200
    assert gateway.model_state("chat")["state"] == "cold"  # nothing was started
    assert not list(port.record.iterdir())


def test_a_request_with_two_host_headers_is_refused_400_whichever_comes_last(
    port: Port,
) -> None:
    """RFC 9112 (3.2): more than one Host is a 400. Judged by the last one, a foreign
    name first slipped past the Host check (a proxy in front may route by the first)."""
    gateway = port.gateway()
    for hosts in (("attacker.example", "127.0.0.1"), ("127.0.0.1", "attacker.example")):
        with _connect(gateway.url) as sock:
            lines = "".join(f"Host: {host}\r\n" for host in hosts)
            sock.sendall(f"GET /v1/models HTTP/1.1\r\n{lines}Connection: close\r\n\r\n".encode())
            answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 400 "), (hosts, answer)
        assert answer.endswith(b"more than one Host header")
    with _connect(gateway.url) as sock:  # one Host: answered as ever
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert _answer(sock).startswith(b"HTTP/1.1 200 ")


def test_api_keys_each_key_works_and_nothing_else_does(port: Port) -> None:
    port.agent()
    keys = f'api_keys = ["{KEYS[0]}"]\n[[gateway.keys]]\nkey = "{KEYS[1]}"\nname = "ui"\n'
    gateway = port.gateway(keys)
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        none = client.post("/v1/chat/completions", json=chat("chat"))
        wrong = client.post("/v1/chat/completions", json=chat("chat"), headers=_bearer("x" * 18))
        for answer in (none, wrong):
            assert answer.status_code == 401
            assert _error(answer) | {"message": ""} == {
                "message": "", "type": "invalid_request_error", "code": "invalid_api_key",
            }  # fmt: skip
        assert client.get("/metrics").status_code == 401  # with keys, metrics need one
        assert client.get("/v1/models").status_code == 401
        assert client.get("/healthz").status_code == 200  # a load balancer has no key
        for key in KEYS:
            answer = client.post("/v1/chat/completions", json=chat("chat"), headers=_bearer(key))
            assert answer.status_code == 200, answer.text
        form = {"Content-Type": "text/plain", **_bearer(KEYS[0])}  # a key: not a browser
        assert client.post("/models/chat/x", content=b"raw", headers=form).status_code == 200
        assert client.get("/metrics", headers=_bearer(KEYS[1])).status_code == 200
    assert KEYS[0] not in gateway.log.read_text() and KEYS[1] not in gateway.log.read_text()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_beyond_loopback_without_keys_the_gateway_refuses_to_start(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    command = json.dumps([sys.executable, "{port}"])  # a program that exists: no warning
    config.write_text(f'[models.chat]\ncommand = {command}\nvram = "1G"\n')
    for args, listens in ((["--host", "0.0.0.0"], "0.0.0.0"), ([], "::")):
        if not args:
            config.write_text('[gateway]\nhost = "::"\n' + config.read_text())
        gateway = [sys.executable, "-m", "gpu_arbiter", "gateway", "--config", str(config)]
        env = env_for(tmp_path / "rt")
        done = subprocess.run(gateway + args, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 2, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert f"gateway.api_keys: refusing to listen on {listens} without API keys" in line


# ---------------------------------------------------------------------------- surface


def test_models_are_retrieved_by_name_or_alias_through_the_openai_sdk(port: Port) -> None:
    openai = pytest.importorskip("openai")
    gateway = port.gateway()
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused") as client:
        ids = [model.id for model in client.models.list()]
        assert ids == ["chat", "gpt-4o-mini"]
        chat_model = client.models.retrieve("chat")
        alias = client.models.retrieve("gpt-4o-mini")
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("nope")
    assert (chat_model.id, chat_model.object, chat_model.owned_by) == (
        "chat",
        "model",
        "gpu-arbiter",
    )
    assert isinstance(chat_model.created, int)
    assert (alias.id, alias.model_extra["alias_of"]) == ("gpt-4o-mini", "chat")
    assert missing.value.code == "model_not_found"


def test_a_multipart_upload_is_routed_by_its_model_field_and_relayed_whole(
    port: Port,
) -> None:
    port.agent()
    models = model_entry("chat", port.record, vram="4G") + model_entry(
        "whisper", port.record, vram="4G", aliases=["whisper-1"]
    )
    gateway = port.gateway('max_body_bytes = "8M"\nmax_buffered_bytes = "8M"\n', models)
    audio = os.urandom(3 << 20)
    boundary = "b0undary-7f3a"
    body = _form(boundary, [("file", "a.wav", audio), ("model", None, b"whisper-1")])
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}", **_bearer("any")}
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        answer = client.post("/v1/audio/transcriptions", content=body, headers=headers)
        assert answer.status_code == 200, answer.text
        found = answer.json()
        assert found["model"] == "whisper"  # the alias in the form routed it
        assert (found["bytes"], found["sha256"]) == (len(body), hashlib.sha256(body).hexdigest())
        assert found["content_type"] == headers["Content-Type"]
        no_model = _form(boundary, [("file", "a.wav", b"abc")])
        missing = client.post("/v1/audio/transcriptions", content=no_model, headers=headers)
        assert missing.status_code == 400 and _error(missing)["code"] == "no_model"


def _form(boundary: str, fields: list[tuple[str, str | None, bytes]]) -> bytes:
    parts = []
    for name, filename, value in fields:
        disposition = f'form-data; name="{name}"'
        if filename:
            disposition += f'; filename="{filename}"'
        head = f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n"
        parts.append(head.encode() + value + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


def test_a_prefix_upload_streams_through_and_a_crash_is_a_502_model_failed(
    port: Port,
) -> None:
    port.agent()
    gateway = port.gateway('max_body_bytes = "32M"\nmax_buffered_bytes = "32M"\n')
    data = os.urandom(24 << 20)

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(data), 1 << 20):
            yield data[start : start + (1 << 20)]

    with httpx.Client(base_url=gateway.url, timeout=60, headers=_bearer("any")) as client:
        streamed = client.post("/models/chat/upload", content=chunks())
        assert streamed.status_code == 200, streamed.text
        assert streamed.json()["framing"] == "chunked"  # as it came: not held, then sent
        assert streamed.json()["sha256"] == hashlib.sha256(data).hexdigest()
        sized = client.put("/models/chat/upload", content=data)
        assert sized.json()["framing"] == "length" and sized.json()["bytes"] == len(data)
        crashed = client.post("/v1/chat/completions", json=chat("chat", crash=True))
        assert crashed.status_code == 502
        assert _error(crashed)["code"] == "model_failed"
