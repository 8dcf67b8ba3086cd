"""The gateway as a real process between callers and real model server processes,
with a real controller and agent (fake probe: the servers' memory follows them)."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from ..gateway.test_estimate import write_gguf
from .agents import AgentProcess, ExitWatch, worker_state
from .conftest import SRC, Server, wait_for
from .gateways import LISTENING, GatewayProcess, chat, metric, model_entry, records

pytestmark = pytest.mark.timeout(120)
BODY_HELD = "gpu_arbiter_gateway_body_bytes_held"


class Setup:
    def __init__(self, server: Server, runtime: Path, record: Path) -> None:
        self.server = server
        self.runtime = runtime
        self.record = record
        self.admin = server.client()
        self.started: list[GatewayProcess | AgentProcess] = []

    def agent(self, spec: str = "1x24G:sm_86", *extra: str) -> AgentProcess:
        token = self.server.admin_token
        agent = AgentProcess(self.server.url, token, "box", self.runtime, spec, *extra)
        self.started.append(agent.start())
        wait_for(lambda: worker_state(self.admin, "box") == "online", what="box online")
        return agent

    def gateway(self, models: str) -> GatewayProcess:
        gateway = GatewayProcess(self.server.url, self.server.admin_token, self.runtime, models)
        self.started.append(gateway.start())
        return gateway

    def held(self, model: str) -> list[dict[str, object]]:
        leases = self.admin.get("/v1/leases").json()
        return [
            lease
            for lease in leases
            if lease["holder"].startswith(f"gateway {model} ") and lease["ended_at"] is None
        ]


@pytest.fixture
def setup(start_server: Callable[..., Server], tmp_path: Path) -> Iterator[Setup]:
    record = tmp_path / "record"
    record.mkdir()
    found = Setup(start_server(), tmp_path / "rt", record)
    yield found
    for process in reversed(found.started):
        process.stop()
    found.admin.close()


def test_cold_start_warm_reuse_and_keep_alive(setup: Setup) -> None:
    setup.agent()
    models = model_entry(
        "chat", setup.record, mb=8000, vram="10G", priority="interactive",
        keep_alive="2s", aliases=["gpt-4o-mini"],
    )  # fmt: skip
    gateway = setup.gateway(models)
    assert gateway.model_state("chat")["state"] == "cold"
    with gateway.client() as client:
        first = client.post("/v1/chat/completions", json=chat("gpt-4o-mini"))
        assert first.status_code == 200, first.text
        assert first.json()["model"] == "gpt-4o-mini"  # the name it asked for
        [lease] = setup.held("chat")
        assert lease["vram_mb"] == 10240 and lease["priority"] == 800
        second = client.post("/v1/chat/completions", json=chat("chat"))
        assert second.status_code == 200
    [process] = records(setup.record, "chat")  # warm: the same server answered both
    assert "ready_at" in process
    # keep-alive: idle 2 s -> stopped and released, and cold again
    wait_for(lambda: "term_at" in records(setup.record, "chat")[0], 20, "keep-alive stop")
    wait_for(lambda: not setup.held("chat"), 10, "the lease released")
    assert gateway.model_state("chat")["state"] == "cold"
    page = httpx.get(gateway.url + "/metrics").text
    chat_ = {"model": "chat"}
    assert metric(page, "gpu_arbiter_gateway_requests_total", **chat_, status="200") == 2
    assert metric(page, "gpu_arbiter_gateway_cold_starts_total", **chat_) == 1
    assert metric(page, "gpu_arbiter_gateway_load_seconds_count", **chat_) == 1
    assert 0.2 <= metric(page, "gpu_arbiter_gateway_load_seconds_sum", **chat_) < 30  # type: ignore[operator]
    assert metric(page, "gpu_arbiter_gateway_queue_seconds_count", **chat_) == 2
    assert metric(page, "gpu_arbiter_gateway_stops_total", **chat_, reason="keep_alive") == 1
    assert metric(page, "gpu_arbiter_gateway_in_flight", **chat_) == 0
    unknown = httpx.post(gateway.url + "/v1/completions", json={"model": "nope"})
    assert unknown.status_code == 404
    assert "chat" in unknown.json()["error"]["message"]


def _post_later(
    url: str, body: dict[str, object], key: str | None = None
) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []
    headers = {"authorization": f"Bearer {key}"} if key else {}

    def post() -> None:
        answers.append(httpx.post(url, json=body, headers=headers, timeout=60))

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread, answers


def test_an_idle_model_is_reclaimed_by_another_models_request(setup: Setup) -> None:
    setup.agent()
    models = model_entry("a", setup.record, mb=15000, vram="16G", keep_alive="5m")
    models += model_entry("b", setup.record, mb=15000, vram="16G", keep_alive="5m")
    gateway = setup.gateway(models)
    with gateway.client() as client:
        assert client.post("/v1/completions", json=chat("a")).status_code == 200
        answer = client.post("/v1/completions", json=chat("b"))  # a is idle: reclaimed
        assert answer.status_code == 200, answer.text
        [a] = records(setup.record, "a")
        [b] = records(setup.record, "b")
        assert a["term_at"] < b["started_at"]  # b started only after a exited
        assert gateway.model_state("a")["state"] == "cold"
        metrics = client.get("/metrics").text
    assert 'gpu_arbiter_gateway_stops_total{model="a",reason="reclaimed"} 1.0' in metrics


def test_a_busy_model_is_preempted_by_a_more_important_one(setup: Setup) -> None:
    """The batch server does not drain on SIGTERM (it exits half a second later): the
    gateway lets its requests finish within the grace before the one SIGTERM, and what
    could not finish gets 503 naming the preemption."""
    setup.agent("1x24G:sm_86", "--grace-s", "3")  # it supervises the servers
    models = model_entry(
        "batch", setup.record, mb=15000, vram="16G", priority="batch", grace="3s",
        queue_timeout="3s", drain=False,
    )  # fmt: skip
    models += model_entry("chat", setup.record, mb=15000, vram="16G", priority="interactive")
    gateway = setup.gateway(models)
    url = gateway.url + "/v1/completions"
    long, long_answer = _post_later(url, chat("batch", tokens=1, token_s=30))
    wait_for(lambda: gateway.model_state("batch")["state"] == "busy", 30, "batch busy")
    victim = ExitWatch(records(setup.record, "batch")[0]["pid"])
    short, short_answer = _post_later(url, chat("batch", tokens=1, token_s=2.0))
    wait_for(lambda: gateway.model_state("batch")["replicas"][0]["in_flight"] == 2, 10, "two")
    asked_at = time.time()
    answer = httpx.post(url, json=chat("chat"), timeout=60)
    assert answer.status_code == 200, answer.text
    short.join(30)
    long.join(30)
    assert short_answer[0].status_code == 200, short_answer[0].text  # within the grace
    assert long_answer[0].status_code == 503  # it could not finish: 503 with the reason
    message = long_answer[0].json()["error"]["message"]
    assert "preempted for" in message and "did not finish within its 3s grace" in message
    [batch_server] = records(setup.record, "batch")
    assert batch_server["terms"] == 1  # one SIGTERM, from the gateway, after the grace
    assert batch_server["term_at"] - asked_at >= 2.5
    [chat_server] = records(setup.record, "chat")
    assert victim.wait() < chat_server["started_at"]  # I4: only after the victim exited
    page = httpx.get(gateway.url + "/metrics").text
    batch = {"model": "batch"}
    assert metric(page, "gpu_arbiter_gateway_stops_total", **batch, reason="preempted") == 1
    assert metric(page, "gpu_arbiter_gateway_requests_total", **batch, status="200") == 1
    assert metric(page, "gpu_arbiter_gateway_requests_total", **batch, status="503") == 1
    # a new batch request queues for a new lease; the warm chat (800) is not reclaimable
    # by batch (100): after queue_timeout, 503 with Retry-After and the pending reason
    late = httpx.post(url, json=chat("batch"), timeout=60)
    assert late.status_code == 503
    assert late.headers["retry-after"] == "3"
    assert "still queued for its lease after 3s" in late.json()["error"]["message"]
    wait_for(lambda: not setup.held("batch"), 10, "the queued request cancelled")


BATCH_KEY, CHAT_KEY = "batch-key-0123456789", "chat-key-0123456789"


def test_a_queued_lease_moves_up_to_an_interactive_callers_priority(setup: Setup) -> None:
    """A batch model's cold start queues behind a critical holder at the batch key's
    priority; an interactive key's request for it asks for the lease again at 800 (not
    preemptible: the controller's default there), and one server answers both."""
    setup.agent()
    holder = setup.admin.post(
        "/v1/leases", json={"vram_mb": 20480, "priority": "critical", "ttl_s": 300}
    )
    assert holder.status_code == 201, holder.text
    keys = f"""[[gateway.keys]]
key = "{BATCH_KEY}"
name = "indexer"
priority = "batch"

[[gateway.keys]]
key = "{CHAT_KEY}"
name = "chat-ui"
priority = "interactive"

"""
    models = model_entry("docs", setup.record, mb=15000, vram="16G", priority="batch")
    gateway = setup.gateway(keys + models)
    url = gateway.url + "/v1/completions"
    batch, batch_answer = _post_later(url, chat("docs"), BATCH_KEY)
    [first] = wait_for(lambda: setup.held("docs") or None, 30, "the batch lease pending")
    assert (first["state"], first["priority"], first["preemptible"]) == ("pending", 100, True)
    chat_, chat_answer = _post_later(url, chat("docs"), CHAT_KEY)

    def moved_up() -> dict[str, object] | None:
        found = setup.held("docs")
        return found[0] if len(found) == 1 and found[0]["id"] != first["id"] else None

    second = wait_for(moved_up, 30, "the lease asked for again at 800")
    assert (second["state"], second["priority"], second["preemptible"]) == ("pending", 800, False)
    ended = setup.admin.get(f"/v1/leases/{first['id']}").json()
    assert ended["state"] == "cancelled" and ended["ended_at"] is not None
    assert setup.admin.delete(f"/v1/leases/{holder.json()['id']}").status_code == 200
    for thread, answers in ((batch, batch_answer), (chat_, chat_answer)):
        thread.join(60)
        assert answers[0].status_code == 200, answers[0].text
    assert len(records(setup.record, "docs")) == 1  # one server answered both
    [lease] = setup.held("docs")
    assert lease["id"] == second["id"] and lease["priority"] == 800


def test_after_a_load_the_measured_peak_replaces_a_lower_estimate(
    setup: Setup, tmp_path: Path
) -> None:
    """vram = "auto": the first lease asks for the estimate from the model file; the
    server then takes more (the probe sees 3000 MiB in its process group), and the next
    lease asks for that."""
    setup.agent()
    model = tmp_path / "m.gguf"
    write_gguf(model)
    models = model_entry(
        "chat", setup.record, mb=3000, model_file=str(model), ctx=8192, keep_alive="3s"
    )
    gateway = setup.gateway(models)
    with gateway.client() as client:
        assert client.post("/v1/completions", json=chat("chat")).status_code == 200
        [first] = setup.held("chat")
        assert first["vram_mb"] == 529  # weights 8 + KV cache 8 + overhead 513
        wait_for(lambda: gateway.model_state("chat")["vram_mb"] == 3000, 20, "the peak")
        wait_for(lambda: not setup.held("chat"), 20, "the keep-alive stop")
        assert client.post("/v1/completions", json=chat("chat")).status_code == 200
        [second] = setup.held("chat")
    assert second["vram_mb"] == 3000


def test_streaming_passes_each_chunk_at_once_and_a_disconnect_cancels(setup: Setup) -> None:
    setup.agent()
    gateway = setup.gateway(model_entry("chat", setup.record, vram="4G"))
    hold = setup.record / "hold"
    body = chat("chat", stream=True, tokens=4, hold=str(hold))
    with gateway.client() as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))  # cold: comments
            assert '"t0"' in first  # before the server has sent the rest: it waits on hold
            hold.write_text("go")
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and len(rest) == 4
        slow = chat("chat", stream=True, tokens=100, token_s=0.05)
        with client.stream("POST", "/v1/chat/completions", json=slow) as stream:
            next(line for line in stream.iter_lines() if line)
        # the caller went away: the model server's request is cancelled
        wait_for(lambda: client.get("/models/chat/stats").json()["cancelled"] == 1, 10)
        bearer = {"Authorization": "Bearer any"}  # a body of no type: not a browser's
        echo = client.post("/models/chat/some/path?x=1", content=b"raw", headers=bearer)
        assert echo.json() == {"path": "/some/path", "query": "x=1", "body": "raw"}


def test_a_crash_is_a_502_and_restarts_back_off(setup: Setup) -> None:
    setup.agent()
    gateway = setup.gateway(model_entry("chat", setup.record, vram="4G"))
    with gateway.client() as client:
        assert client.post("/v1/completions", json=chat("chat")).status_code == 200
        crashed = client.post("/v1/completions", json=chat("chat", crash=True))
        assert crashed.status_code == 502
        assert "exited with code 3" in crashed.json()["error"]["message"]
        wait_for(lambda: not setup.held("chat"), 10, "the lease released")
        # the 503 while it backs off is timed on a virtual clock in
        # tests/gateway/test_replica.py; here, under any load: no restart by itself
        listed = gateway.model_state("chat")
        assert listed["state"] == "failed"  # until a start loads, with the failure
        assert "exited with code 3" in listed["failure"]
        wait_for(lambda: gateway.model_state("chat")["retry_in_s"] == 0, 10, "back-off over")
        assert len(records(setup.record, "chat")) == 1
        assert client.post("/v1/completions", json=chat("chat")).status_code == 200
    assert len(records(setup.record, "chat")) == 2


def test_a_full_replica_makes_the_next_request_ask_for_another(setup: Setup) -> None:
    setup.agent("2x24G:sm_86")
    models = model_entry("chat", setup.record, vram="20G", max_parallel=1, replicas=2)
    gateway = setup.gateway(models)
    holds = [setup.record / f"hold-{i}" for i in range(3)]
    url = gateway.url + "/v1/chat/completions"
    started = [_post_later(url, chat("chat", stream=True, hold=str(hold))) for hold in holds]
    # two replicas, each its own lease (20G each: on two GPUs), never a third
    wait_for(lambda: len(setup.held("chat")) == 2, 30, "two leases")
    wait_for(lambda: len(records(setup.record, "chat")) == 2, 30, "two servers")
    assert sorted(g for lease in setup.held("chat") for g in lease["gpus"]) == ["box:0", "box:1"]
    for hold in holds:
        hold.write_text("go")
    for thread, answers in started:
        thread.join(30)
        assert answers[0].status_code == 200
        assert answers[0].text.endswith("data: [DONE]\n\n")
    assert len(records(setup.record, "chat")) == 2


def test_two_models_that_cannot_share_a_gpu_alternate_under_load(setup: Setup) -> None:
    setup.agent()
    models = model_entry("a", setup.record, mb=15000, vram="16G", load_s=0.3)
    models += model_entry("b", setup.record, mb=15000, vram="16G", load_s=0.3)
    gateway = setup.gateway(models)
    statuses: list[int] = []

    def caller(first: str) -> None:
        order = [first, "b" if first == "a" else "a"] * 2
        with gateway.client() as client:
            for model in order:
                answer = client.post("/v1/completions", json=chat(model, tokens=2, token_s=0.05))
                statuses.append(answer.status_code)

    threads = [threading.Thread(target=caller, args=(m,)) for m in ("a", "b", "a")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert statuses == [200] * 12
    assert len(records(setup.record, "a") + records(setup.record, "b")) >= 3  # they alternated
    # Never both at once: a model's lease ends only once its server's process group is gone
    # (I4), so leases that never overlap mean servers that never did. (A server's own record
    # cannot say when it ended if it was killed after its grace.)
    leases = sorted(
        (lease["granted_at"], lease["ended_at"] or float("inf"), lease["holder"].split()[1])
        for lease in setup.admin.get("/v1/leases", params={"limit": 1000}).json()
        if lease["holder"].startswith(("gateway a ", "gateway b ")) and lease["granted_at"]
    )
    assert len(leases) >= 3, leases
    for (_, ended, name), (began, _, next_name) in itertools.pairwise(leases):
        assert ended <= began, f"{name} and {next_name} held the GPU at once"
    for name in ("a", "b"):  # and each server lived within a lease of its model
        for life in records(setup.record, name):
            assert any(g <= life["started_at"] <= e for g, e, n in leases if n == name), life


def _gateway_command(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gpu_arbiter", "gateway", *args]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_a_bad_config_exits_2_naming_the_model_and_key(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text('[models.chat]\ncommand = "srv --port {port}"\nvram = "6X"\n')
    done = _gateway_command("--config", str(config))
    assert done.returncode == 2
    assert "models.chat.vram: '6X' is not a size" in done.stderr
    config.write_text('[models.chat]\ncommand = "srv -m /nowhere.gguf --port {port}"\n')
    done = _gateway_command("--config", str(config), "--check")
    assert done.returncode == 2
    assert "models.chat.vram: model file /nowhere.gguf does not exist" in done.stderr


def test_check_shows_each_models_estimate_and_its_parts(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    write_gguf(model)
    for program in ("llama-server", "embedder"):  # --check wants the programs there
        (tmp_path / program).write_text("#!/bin/sh\n")
        (tmp_path / program).chmod(0o755)
    config = tmp_path / "models.toml"
    config.write_text(
        f'[models.chat]\ncommand = "{tmp_path}/llama-server -m {model} -c 8192 --port {{port}}"\n'
        f'[models.embed]\ncommand = "{tmp_path}/embedder --port {{port}}"\nvram = "2G"\n'
    )
    done = _gateway_command("--config", str(config), "--check")
    assert done.returncode == 0, done.stderr
    assert "chat: vram 529 MiB (auto: 529 MiB = weights 8 MiB + KV cache 8 MiB " in done.stdout
    assert "embed: vram 2.0 GiB (given)" in done.stdout


def test_serve_local_runs_the_gateway_beside_the_agent(
    start_server: Callable[..., Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_ARBITER_RUNTIME_DIR", str(tmp_path / "rt"))
    record = tmp_path / "record"
    record.mkdir()
    models = tmp_path / "models.toml"
    models.write_text("[gateway]\nport = 0\n" + model_entry("chat", record, vram="4G"))
    server = start_server("--local", "--simulate", "1x24G", "--models", str(models))
    [port] = wait_for(lambda: LISTENING.findall(server.log.read_text()), 30, "the gateway")
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=chat("chat"), timeout=60)
    assert answer.status_code == 200, answer.text
    with server.client() as admin:
        [lease] = [x for x in admin.get("/v1/leases").json() if x["ended_at"] is None]
    assert lease["holder"].startswith("gateway chat #1@")
    assert len(LISTENING.findall(server.log.read_text())) == 1  # said once in the shared log


def test_a_client_gone_while_its_request_queues_gives_its_body_and_lease_back_at_once(
    setup: Setup,
) -> None:
    """The GPU is taken (another holder's 20G lease): the request queues for up to a
    minute; its client hangs up after a few seconds, and its held body and its pending
    lease are given back then, not when the queue timeout would have ended the wait."""
    setup.agent()
    taken = setup.admin.post("/v1/leases", json={"vram_mb": "20G", "holder": "other"})
    assert taken.status_code == 201, taken.text
    gateway = setup.gateway(model_entry("chat", setup.record, vram="10G", queue_timeout="60s"))
    body = json.dumps(chat("chat", padding="x" * 100_000)).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    port = int(gateway.url.rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + body)
        wait_for(lambda: len(setup.held("chat")) == 1, 20, "the request queued")
        held = metric(httpx.get(gateway.url + "/metrics").text, BODY_HELD)
        assert held is not None and held >= len(body)
    wait_for(lambda: setup.held("chat") == [], 20, "the pending lease cancelled")
    assert metric(httpx.get(gateway.url + "/metrics").text, BODY_HELD) == 0
    assert records(setup.record, "chat") == []  # never started
