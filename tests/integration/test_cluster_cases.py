"""The cluster's front doors in harder cases: two priorities contending for one host, a
standby controller taking over while requests are routed, a model whose server cannot
start (every request ends, nothing stays held), and a caller hanging up during a load
others wait for. Real controllers, agents and gateways on 127.0.0.N, the test model
server (tests/integration/model_server.py) as every model's server."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .cluster import Host, cluster_leases, routable, served_by
from .conftest import Server, wait_for
from .gateways import chat, metric, model_entry, records
from .test_cluster import Cluster, cluster
from .test_gateway_lifecycle import alive
from .test_ha import Controllers, leader_of, role

__all__ = ["cluster"]  # the fixture, shared with test_cluster.py

pytestmark = pytest.mark.timeout(180)


def _held(admin: httpx.Client) -> list[dict[str, Any]]:
    return [lease for lease in admin.get("/v1/leases").json() if lease["ended_at"] is None]


def _events(response: httpx.Response, first: threading.Event) -> list[dict[str, Any]]:
    """The JSON payloads of an event stream's ``data:`` lines (``[DONE]`` left out);
    ``first`` is set once one came."""
    found = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            found.append(json.loads(line[6:]))
            first.set()
    return found


# ---------------------------------------------------------------- priorities contending


def test_an_interactive_model_preempts_a_batch_one_on_the_only_host_it_fits(
    cluster: Cluster,
) -> None:
    models = "".join(
        model_entry(name, cluster.record, mb=12000, priority=priority, vram="14G", grace="1s")
        for name, priority in (("chat", "batch"), ("urgent", "interactive"))
    )
    cluster.host(2, "1x24G:sm_86", models)
    door = cluster.host(3, "1x4G:sm_86", models)  # too small for either
    cluster.settled("chat")
    cluster.settled("urgent")

    with concurrent.futures.ThreadPoolExecutor(1) as pool, door.gateway.client() as client:
        long = chat("chat", stream=True, tokens=2000, token_s=0.05)  # 100 s if left alone

        flowing = threading.Event()

        def stream_chat() -> tuple[httpx.Response, list[dict[str, Any]]]:
            with client.stream("POST", "/v1/chat/completions", json=long) as answer:
                return answer, _events(answer, flowing)

        streaming = pool.submit(stream_chat)
        assert flowing.wait(60), "chat never streamed a token"
        (busy,) = cluster_leases(cluster.admin, "chat")
        assert (busy["worker"], busy["priority"]) == ("box-2", 100)

        with door.gateway.client() as other:
            urgent = other.post("/v1/chat/completions", json=chat("urgent"))
        assert urgent.status_code == 200, urgent.text
        assert served_by(urgent) == "gw-2/urgent"
        assert urgent.json()["model"] == "urgent"

        answer, events = streaming.result(timeout=60)  # cut, never left hanging
    assert answer.status_code == 200  # the stream had begun before the preemption
    assert events, "no event at all"
    final = events[-1]
    assert "error" in final, f"the stream of chat ended without an error event: {final}"
    assert final["error"]["status"] == 503, final
    assert "chat" in final["error"]["message"]
    assert any(e.get("model") == "chat" for e in events[:-1])  # it had streamed tokens

    (lease,) = cluster_leases(cluster.admin, "urgent")
    assert lease["worker"] == "box-2"
    assert lease["priority"] == 800
    revoked = cluster.admin.get(f"/v1/leases/{busy['id']}").json()
    assert revoked["ended_at"] is not None, revoked
    assert revoked["preempted_for"] == lease["id"], revoked
    assert cluster.started("urgent") == 1


# ---------------------------------------------------------------- a standby takes over


@pytest.fixture
def controllers(tmp_path: Path, postgres_dsn: str) -> Iterator[Controllers]:
    made = Controllers(tmp_path / "controllers", postgres_dsn)
    yield made
    made.stop()


def _online_since(admin: httpx.Client, worker: str, since: float) -> bool:
    """Whether ``worker`` is online with a heartbeat after ``since`` (at this controller)."""
    found = admin.get(f"/v1/workers/{worker}").json()
    return bool(found["state"] == "online" and (found["last_heartbeat_at"] or 0) > since)


def _start_controller(controllers: Controllers, name: str) -> Server:
    """A controller on the shared database, with no simulated worker of its own."""
    server = Server(controllers.root / name, "--store", controllers.dsn, "--leader-ttl-s", "1.5")
    controllers.started.append(server)  # stopped at the end even if its start fails
    return server.start(ready=False)


def test_a_standby_takes_over_and_the_front_doors_go_on_routing(
    controllers: Controllers, tmp_path: Path
) -> None:
    first = _start_controller(controllers, "a")
    leader_of(first)
    second = _start_controller(controllers, "b")
    wait_for(lambda: role(second) == "standby", 20, "the second to stand by")
    both = f"{first.url},{second.url}"
    record = tmp_path / "record"
    record.mkdir()
    models = model_entry("chat", record, mb=6000, vram="8G", keep_alive="120s", ttl="3s")
    models += model_entry("embed", record, mb=1000, vram="2G", keep_alive="120s", ttl="3s")
    hosts: list[Host] = []
    try:
        with first.client() as admin:
            for number, spec in ((2, "1x4G:sm_86"), (3, "1x24G:sm_86")):
                host = Host(first, tmp_path, number, spec, models, controllers=both)
                hosts.append(host)
                host.start(admin)
            wait_for(lambda: routable(admin, hosts, "chat"), what="every host routable")
        door = hosts[0]
        with door.gateway.client() as client:
            warm = client.post("/v1/chat/completions", json=chat("chat"))
        assert warm.status_code == 200, warm.text
        assert served_by(warm) == "gw-3/chat"
        with first.client() as admin:
            (before,) = cluster_leases(admin, "chat")

        first.kill9()
        killed_at = time.time()
        assert leader_of(second, timeout_s=30) is second
        with second.client(token=first.admin_token) as admin:
            for worker in ("box-2", "box-3"):
                wait_for(
                    partial(_online_since, admin, worker, killed_at),
                    30,
                    f"{worker} at the new leader",
                )

            def served(model: str) -> httpx.Response | None:
                with door.gateway.client(timeout=30) as client:
                    answer = client.post("/v1/chat/completions", json=chat(model))
                return answer if answer.status_code == 200 else None

            after = wait_for(lambda: served("chat"), 60, "chat served after the failover")
            assert served_by(after) == "gw-3/chat"
            # its holder renews it at the new leader (a renewal before the kill ends by
            # killed_at + its TTL of 3 s)
            wait_for(
                lambda: (
                    admin.get(f"/v1/leases/{before['id']}").json()["expires_at"] > killed_at + 3
                ),
                30,
                "the warm lease renewed at the new leader",
            )
            # a cold load asked of the new leader through the front door
            cold = wait_for(lambda: served("embed"), 60, "embed loaded after the failover")
            assert served_by(cold) in ("gw-2/embed", "gw-3/embed")
            (embed_lease,) = cluster_leases(admin, "embed")
            assert embed_lease["token"] > before["token"]
            (still,) = cluster_leases(admin, "chat")
            assert still["id"] == before["id"]
        assert len(records(record, "chat")) == 1  # the warm replica served throughout
    finally:
        for host in reversed(hosts):
            host.stop()


def _sdk_chat(url: str, streamed: bool) -> tuple[str, str]:
    """One request for ``chat`` by the ``openai`` SDK at front door ``url``: ("answer",
    its text) or ("error", the status and message the SDK raised)."""
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "hi"}
    ]
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=150) as sdk:
        try:
            if streamed:
                stream = sdk.chat.completions.create(model="chat", messages=messages, stream=True)
                return "answer", " ".join(c.choices[0].delta.content or "" for c in stream)
            raw = sdk.chat.completions.with_raw_response.create(model="chat", messages=messages)
            return "answer", str(raw.http_response.json()["choices"][0]["text"])
        except openai.APIStatusError as error:
            return "error", f"{error.status_code} {error.message}"
        except openai.APIError as error:  # an error event after the stream's head
            return "error", f"{(error.body or {}).get('status')} {error.message}"


@pytest.mark.parametrize("moment", ["pending", "loading"])
def test_a_standby_taking_over_mid_load_leaves_every_waiting_request_an_ending(
    controllers: Controllers, tmp_path: Path, moment: str
) -> None:
    """The leader is SIGKILLed while six requests (two streamed) at two front doors wait
    for the cluster's cold load of a model: ``pending`` (both hosts it fits full) or
    granted with its server ``loading`` (until the test lets it be ready). Each request
    is answered by the one server started for the model (its front door asks for the
    stored load again at the new leader); the new leader's leases are what runs; once
    the hosts stop, no server runs and no lease is held."""
    first = _start_controller(controllers, "a")
    leader_of(first)
    second = _start_controller(controllers, "b")
    wait_for(lambda: role(second) == "standby", 20, "the second to stand by")
    both = f"{first.url},{second.url}"
    record = tmp_path / "record"
    record.mkdir()
    loaded = tmp_path / "loaded"  # the server loads until this file exists
    keys = {"keep_alive": "120s", "ttl": "30s", "queue_timeout": "120s"}
    models = model_entry("chat", record, mb=6000, vram="8G", ready_when=loaded, **keys)
    hosts: list[Host] = []
    try:
        with first.client() as admin:
            for number, spec in ((2, "1x24G:sm_86"), (3, "1x24G:sm_86"), (4, "1x4G:sm_86")):
                host = Host(first, tmp_path, number, spec, models, controllers=both)
                hosts.append(host)
                host.start(admin)
            wait_for(lambda: routable(admin, hosts, "chat"), what="every host routable")
            blockers = [_block(admin, w) for w in ("box-2", "box-3")] if moment == "pending" else []
        doors = (hosts[0], hosts[2])  # gw-4's host is too small: a front door only
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            calls = [
                pool.submit(_sdk_chat, doors[i % 2].gateway.url, streamed=i < 2) for i in range(6)
            ]
            wait_for(
                lambda: all(_routed(door, "chat") >= 3 for door in doors),
                what="every request waiting for the load",
            )
            if moment == "loading":
                wait_for(lambda: records(record, "chat"), what="the server to start")
            with first.client() as admin:
                (load,) = cluster_leases(admin, "chat")
            assert load["state"] == moment, load
            first.kill9()
            assert leader_of(second, timeout_s=30) is second
            with second.client(token=first.admin_token) as admin:
                for blocker in blockers:
                    admin.delete(f"/v1/leases/{blocker}")
                loaded.write_text("")
                ended = [call.result(timeout=170) for call in calls]
                assert ended == [("answer", "t0 t1 t2")] * 6, ended
                (server,) = records(record, "chat")
                (lease,) = _held(admin)  # the blockers gone, only what runs is held
                assert lease["metadata"]["cluster_model"] == "chat", lease
                assert lease["state"] == "active" and lease["id"] == load["id"]  # the one load
                serving = next(h for h in hosts if h.worker == lease["worker"])
                replicas = serving.gateway.model_state("chat")["replicas"]
                assert [(r["lease"], r["pid"]) for r in replicas] == [(lease["id"], server["pid"])]
                assert alive(server["pid"])
        for host in reversed(hosts):
            host.stop()
        hosts.clear()
        assert not alive(server["pid"])
        with second.client(token=first.admin_token) as admin:
            wait_for(lambda: not _held(admin), 30, "every lease released")
    finally:
        for host in reversed(hosts):
            host.stop()


# ---------------------------------------------------------------- every request ends


def _failing_entry(name: str, vram: str) -> str:
    """A model whose server exits with code 3 as it starts."""
    command = [sys.executable, "-c", "import sys; sys.exit(3)", "{port}"]
    lines = [f"[models.{name}]", f"command = {json.dumps(command)}"]
    lines += [f'vram = "{vram}"', 'queue_timeout = "60s"', 'grace = "1s"']
    return "\n".join(lines) + "\n"


def test_40_requests_for_a_model_that_cannot_start_each_get_a_clear_error(
    cluster: Cluster,
) -> None:
    models = _failing_entry("broken", "8G")
    doors = [cluster.host(2, "1x24G:sm_86", models), cluster.host(3, "1x24G:sm_86", models)]
    cluster.settled("broken")

    def call(i: int) -> httpx.Response:
        url = doors[i % 2].gateway.url
        with httpx.Client(base_url=url, timeout=90) as client:
            return client.post("/v1/chat/completions", json=chat("broken"))

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(call, range(40)))
    for answer in answers:
        assert answer.status_code in (502, 503), answer.text
        assert answer.headers["content-type"].startswith("application/json"), answer.headers
        error = answer.json()["error"]
        assert isinstance(error["message"], str) and error["message"], answer.text
    assert any(a.status_code == 502 for a in answers)  # the failed start was told
    wait_for(lambda: not _held(cluster.admin), 30, "every lease released")


# ---------------------------------------------------------------- a caller hangs up


def _hang_up_later(url: str, model: str) -> socket.socket:
    """A request for ``model`` at gateway ``url`` whose caller will hang up: the socket,
    the request sent."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(chat(model)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(head + body)
    return sock


def _routed(host: Host, model: str) -> float:
    with host.gateway.client() as client:
        text = client.get("/metrics").text
    return sum(
        metric(text, "gpu_arbiter_gateway_routes_total", model=model, outcome=outcome) or 0.0
        for outcome in ("local", "peer", "load")
    )


def _block(admin: httpx.Client, worker: str) -> str:
    """A lease of 20 GiB on ``worker`` (left loading: its GPU's load gate is held too)."""
    made = admin.post(
        "/v1/leases",
        json={"vram_mb": 20480, "holder": "blocker", "constraints": {"worker": worker}},
    )
    assert made.status_code == 201, made.text
    lease_id: str = made.json()["id"]
    return lease_id


@pytest.mark.parametrize("moment", ["pending", "granted", "started"])
def test_a_caller_hanging_up_during_the_load_leaves_it_to_the_others(
    cluster: Cluster, moment: str
) -> None:
    """``pending``: the caller whose front door asked for the load hangs up while the
    load still waits for memory; ``granted``: once it is placed; ``started``: while its
    server loads."""
    models = model_entry("chat", cluster.record, mb=6000, vram="8G", load_s=2.0)
    first = cluster.host(2, "1x24G:sm_86", models)
    second = cluster.host(3, "1x24G:sm_86", models)
    cluster.settled("chat")
    blockers = [_block(cluster.admin, h.worker) for h in (first, second)]
    if moment != "pending":
        for blocker in blockers:
            cluster.admin.delete(f"/v1/leases/{blocker}")
    leaving = _hang_up_later(first.gateway.url, "chat")
    try:
        (load,) = wait_for(lambda: cluster_leases(cluster.admin, "chat"), what="the load")
        if moment == "started":
            wait_for(lambda: cluster.started("chat") == 1, what="the server to start")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(
                lambda: httpx.post(
                    second.gateway.url + "/v1/chat/completions", json=chat("chat"), timeout=90
                )
            )
            wait_for(lambda: _routed(second, "chat") >= 1, what="the second caller waiting")
            leaving.close()  # mid-load: the server is not ready yet
            if moment == "pending":
                assert cluster.admin.get(f"/v1/leases/{load['id']}").json()["state"] == "pending"
                assert cluster.started("chat") == 0
                for blocker in blockers:
                    cluster.admin.delete(f"/v1/leases/{blocker}")
            assert not any(r.get("ready_at") for r in records(cluster.record, "chat"))
            answer = waiting.result(timeout=90)
    finally:
        leaving.close()
    assert answer.status_code == 200, answer.text
    assert served_by(answer) in ("gw-2/chat", "gw-3/chat")
    (server,) = records(cluster.record, "chat")
    assert "term_at" not in server  # its load was not stopped by the hang-up
    (lease,) = cluster_leases(cluster.admin, "chat")
    assert lease["state"] == "active"


def test_a_streamed_request_whose_cold_load_lands_on_its_own_front_door_streams(
    cluster: Cluster,
) -> None:
    models = model_entry("chat", cluster.record, mb=6000, vram="8G", load_s=1.0)
    door = cluster.host(2, "1x24G:sm_86", models)
    cluster.host(3, "1x4G:sm_86", models)  # too small: the load lands on box-2
    cluster.settled("chat")
    body = chat("chat", stream=True)
    with (
        door.gateway.client() as client,
        client.stream("POST", "/v1/chat/completions", json=body) as answer,
    ):
        lines = list(answer.iter_lines())
    assert answer.status_code == 200
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["t0", "t1", "t2"], lines
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", lines
    (lease,) = cluster_leases(cluster.admin, "chat")
    assert lease["worker"] == "box-2"


def test_streamed_requests_for_a_model_that_cannot_start_each_end_with_an_error(
    cluster: Cluster,
) -> None:
    models = _failing_entry("broken", "8G")
    door = cluster.host(2, "1x24G:sm_86", models)
    other = cluster.host(3, "1x4G:sm_86", models)  # too small: every load lands on box-2
    cluster.settled("broken")

    def streamed(i: int) -> tuple[int, list[dict[str, Any]]]:
        url = (door, other)[i % 2].gateway.url
        body = chat("broken", stream=True)
        try:
            with (
                httpx.Client(base_url=url, timeout=90) as client,
                client.stream("POST", "/v1/chat/completions", json=body) as answer,
            ):
                if not answer.headers["content-type"].startswith("text/event-stream"):
                    answer.read()
                    return answer.status_code, [answer.json()]
                return answer.status_code, _events(answer, threading.Event())
        except httpx.RemoteProtocolError as cut:
            return 0, [{"cut": str(cut)}]

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        ended = list(pool.map(streamed, range(20)))
    for status, events in ended:  # a JSON error, or an event stream whose end is one
        assert status in (200, 502, 503), (status, events)
        error = events[-1]["error"]
        assert error["message"] and error.get("status", status) in (502, 503), events
    wait_for(lambda: not _held(cluster.admin), 30, "every lease released")
