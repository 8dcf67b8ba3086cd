"""One front door for every host: several hosts on this machine (each an agent with
its own worker name and simulated GPUs, and a gateway on its own loopback address),
one real controller, the test model server (tests/integration/model_server.py) as each
model's server, and the ``openai`` SDK or httpx as the caller."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .agents import worker_state
from .cluster import Host, cluster_leases, model_leases, routable, served_by
from .conftest import Server, wait_for
from .gateways import chat, model_entry, records

pytestmark = pytest.mark.timeout(180)


class Cluster:
    def __init__(self, server: Server, root: Path) -> None:
        self.server = server
        self.root = root
        self.record = root / "record"
        self.record.mkdir(parents=True, exist_ok=True)
        self.admin = server.client()
        self.hosts: list[Host] = []

    def host(self, number: int, spec: str, models: str) -> Host:
        host = Host(self.server, self.root, number, spec, models).start(self.admin)
        self.hosts.append(host)
        return host

    def settled(self, model: str) -> None:
        """Until every front door sees every other host of ``model``."""
        wait_for(lambda: routable(self.admin, self.hosts, model), what="every host routable")

    def started(self, model: str) -> int:
        return len(records(self.record, model))


@pytest.fixture
def cluster(start_server: Callable[..., Server], tmp_path: Path) -> Iterator[Cluster]:
    found = Cluster(start_server(), tmp_path)
    yield found
    for host in reversed(found.hosts):
        host.stop()
    found.admin.close()


def _models(cluster: Cluster, **keys: object) -> str:
    keys = {"vram": "8G", "keep_alive": "60s", "aliases": ["gpt-4o-mini"], **keys}
    return model_entry("chat", cluster.record, mb=6000, **keys)  # type: ignore[arg-type]


def test_a_front_door_lists_the_clusters_state_and_a_failed_start_as_failed(
    cluster: Cluster,
) -> None:
    """gw-2's copy fails its start: gw-2 lists it failed among its hosts, with the failure
    and when it may start again, and reports it so to the controller; once gw-3's copy is
    warm, gw-2 lists the model warm (the cluster's state), while its report still says
    its own copy failed; once the failure is gone, a request starts gw-2's again."""
    broken = cluster.root / "broken"
    broken.write_text("")
    failing = model_entry("chat", cluster.record, mb=6000, vram="8G", fail_while=broken)
    door = cluster.host(2, "1x24G:sm_86", failing)
    cluster.host(3, "1x24G:sm_86", _models(cluster))
    cluster.settled("chat")

    def listed() -> dict[str, Any]:
        with door.gateway.client() as client:
            found: dict[str, Any] = client.get("/v1/models/chat").json()
        return found

    def reported() -> dict[str, Any]:
        gateways = cluster.admin.get("/v1/gateways").json()
        models = next(g for g in gateways if g["name"] == "gw-2")["models"]
        found: dict[str, Any] = next(m for m in models if m["id"] == "chat")
        return found

    with door.gateway.client() as client:
        failed = client.post("/v1/chat/completions", json=chat("chat@gw-2"))
        assert failed.status_code == 502, failed.text
        entry = listed()
        assert entry["state"] == "cold"  # gw-3 may still start it
        here = entry["hosts"][0]
        assert (here["gateway"], here["state"]) == ("gw-2", "failed")
        assert "exited with code 4" in here["failure"]
        assert here["retry_at"] > 0 and 0 <= here["retry_in_s"] <= 1.0
        wait_for(lambda: reported()["state"] == "failed", what="gw-2 reports its copy failed")
        assert "exited with code 4" in reported()["failure"]

        served = client.post("/v1/chat/completions", json=chat("chat@gw-3"))  # relayed
        assert served_by(served) == "gw-3/chat", served.text
        wait_for(lambda: listed()["state"] == "warm", what="gw-2 to list chat warm on gw-3")
        entry = listed()
        assert {k: entry[k] for k in ("id", "object", "owned_by")} == {
            "id": "chat", "object": "model", "owned_by": "gpu-arbiter",
        }  # fmt: skip
        assert isinstance(entry["created"], int)
        assert [(h["gateway"], h["worker"], h["state"], h["ready"]) for h in entry["hosts"]] == [
            ("gw-2", "box-2", "failed", 0), ("gw-3", "box-3", "warm", 1),
        ]  # fmt: skip
        assert reported()["state"] == "failed"  # its own copy, not the cluster's

        broken.unlink()
        wait_for(lambda: listed()["hosts"][0]["retry_in_s"] == 0, what="the back-off over")
        again = client.post("/v1/chat/completions", json=chat("chat@gw-2"))
        assert served_by(again) == "gw-2/chat", again.text
    assert listed()["hosts"][0]["state"] in ("warm", "busy")
    wait_for(lambda: reported()["state"] in ("warm", "busy"), what="gw-2 reports it warm")
    assert "failure" not in reported()


def test_a_cold_model_loads_where_it_fits_and_the_warm_copy_serves_every_front_door(
    cluster: Cluster,
) -> None:
    small = cluster.host(2, "1x4G:sm_86", _models(cluster))  # 8G never fits here
    large = cluster.host(3, "1x24G:sm_86", _models(cluster))
    cluster.settled("chat")
    with small.gateway.client() as client:
        first = client.post("/v1/chat/completions", json=chat("gpt-4o-mini"))
        assert first.status_code == 200, first.text
        assert served_by(first) == "gw-3/chat"
        again = client.post("/v1/chat/completions", json=chat("chat"))
        assert again.status_code == 200, again.text
        assert served_by(again) == "gw-3/chat"
        bearer = {"Authorization": "Bearer any"}  # a body of no type: not a browser's
        echo = client.post("/models/chat/some/path?x=1", content=b"raw", headers=bearer)
        assert echo.status_code == 200, echo.text  # the prefix route, relayed whole
        assert served_by(echo) == "gw-3/chat"
        assert echo.json() == {"path": "/some/path", "query": "x=1", "body": "raw"}
    with large.gateway.client() as client:
        local = client.post("/v1/chat/completions", json=chat("chat"))
        assert served_by(local) == "gw-3/chat"
    assert cluster.started("chat") == 1
    (lease,) = cluster_leases(cluster.admin, "chat")
    assert lease["worker"] == "box-3"
    assert lease["constraints"]["workers"] == ["box-2", "box-3"]
    with small.gateway.client() as client:
        routes = client.get("/admin/routes").json()["routes"]
    outcomes = [r["outcome"] for r in routes[:4]]
    assert outcomes == ["peer", "peer", "placed", "load"]  # newest first (the echo, the chat)
    assert routes[0]["to"] == routes[1]["to"] == "gw-3"  # warm there, or its load on the way
    assert routes[2]["to"] == "gw-3"
    assert "cold load of 8.0 GiB on box-3:0, 16.0 GiB left there; box-2 has" in routes[2]["why"]
    assert "a load for the cluster (gw-2, gw-3)" in routes[3]["why"]

    def reported() -> list[dict[str, object]]:
        gateways = cluster.admin.get("/v1/gateways").json()
        found: list[dict[str, object]] = next(g for g in gateways if g["name"] == "gw-2")["routes"]
        return found

    wait_for(lambda: len(reported()) >= 2, timeout_s=15, what="gw-2's routes in its report")


def test_the_openai_sdk_sees_every_model_of_the_cluster_and_names_one_hosts_copy(
    cluster: Cluster,
) -> None:
    only_here = model_entry("embed", cluster.record, mb=1000, vram="2G")
    first = cluster.host(2, "1x24G:sm_86", _models(cluster))
    second = cluster.host(3, "1x24G:sm_86", _models(cluster) + only_here)
    cluster.settled("chat")
    sdk = openai.OpenAI(base_url=first.gateway.url + "/v1", api_key="none", max_retries=0)
    listed = {m.id for m in sdk.models.list().data}
    assert {"chat", "embed", "gpt-4o-mini"} <= listed
    answer = sdk.chat.completions.with_raw_response.create(
        model="embed", messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.headers["x-served-by"] == "gw-3/embed"
    named = sdk.chat.completions.with_raw_response.create(
        model="chat@gw-2", messages=[{"role": "user", "content": "hi"}]
    )
    assert named.headers["x-served-by"] == "gw-2/chat"
    relayed = sdk.chat.completions.with_raw_response.create(
        model="chat@gw-3", messages=[{"role": "user", "content": "hi"}]
    )  # another host's copy: relayed, and served there under its own name
    assert relayed.headers["x-served-by"] == "gw-3/chat"
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="chat@gw-9", messages=[{"role": "user", "content": "hi"}])
    assert second.gateway.url  # the second host served embed


def test_a_burst_of_200_for_a_cold_model_at_two_front_doors_starts_one_server(
    cluster: Cluster,
) -> None:
    models = _models(cluster, max_parallel=8, load_s=1.0)
    doors = [cluster.host(2, "1x24G:sm_86", models), cluster.host(3, "1x24G:sm_86", models)]
    cluster.settled("chat")

    def call(i: int) -> tuple[int, str]:
        url = doors[i % 2].gateway.url
        with httpx.Client(base_url=url, timeout=120) as client:
            answer = client.post("/v1/chat/completions", json=chat("chat"))
            return answer.status_code, served_by(answer)

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(call, range(200)))
    assert [status for status, _ in answers] == [200] * 200
    assert len({by for _, by in answers}) == 1
    assert cluster.started("chat") == 1


def test_a_front_door_killed_during_the_load_leaves_the_load_serving(cluster: Cluster) -> None:
    door = cluster.host(2, "1x4G:sm_86", _models(cluster, load_s=3.0))
    server = cluster.host(3, "1x24G:sm_86", _models(cluster, load_s=3.0))
    cluster.settled("chat")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            lambda: httpx.post(
                door.gateway.url + "/v1/chat/completions", json=chat("chat"), timeout=60
            )
        )
        wait_for(lambda: cluster.started("chat") == 1, what="the load to start on box-3")
        door.gateway.kill()
        with pytest.raises(httpx.TransportError):
            pending.result()
    with server.gateway.client() as client:
        answer = client.post("/v1/chat/completions", json=chat("chat"))
    assert answer.status_code == 200, answer.text
    assert served_by(answer) == "gw-3/chat"
    assert cluster.started("chat") == 1


def test_a_host_killed_with_sigkill_leaves_routing_and_its_model_loads_elsewhere(
    cluster: Cluster,
) -> None:
    models = _models(cluster, ttl="3s")
    first = cluster.host(2, "1x24G:sm_86", models)
    doomed = cluster.host(3, "1x24G:sm_86", models)
    cluster.settled("chat")
    with doomed.gateway.client() as client:
        answer = client.post("/v1/chat/completions", json=chat("chat@gw-3"))
        assert served_by(answer) == "gw-3/chat"
    (server_record,) = records(cluster.record, "chat")
    doomed.kill()
    os.kill(server_record["pid"], signal.SIGKILL)  # the host lost its power: all of it
    wait_for(lambda: worker_state(cluster.admin, "box-3") == "offline", what="box-3 offline")
    with first.gateway.client() as client:
        after = client.post("/v1/chat/completions", json=chat("chat"))
    assert after.status_code == 200, after.text
    assert served_by(after) == "gw-2/chat"

    def on_box_3(*states: str) -> list[dict[str, object]]:
        leases = cluster.admin.get("/v1/leases").json()
        return [
            lease
            for lease in leases
            if lease["worker"] == "box-3" and lease["ended_at"] is None
            and (not states or lease["state"] in states)
        ]  # fmt: skip

    # past its TTL the lease is no longer held for use: revoked, its memory kept (I4)
    # until the host's agent says the process is gone
    wait_for(lambda: not on_box_3("loading", "active"), timeout_s=3.0 + 10.0, what="revoked")
    doomed.agent.start()  # the host is back: its agent finds nothing of the lease running
    wait_for(lambda: not on_box_3(), timeout_s=30.0, what="box-3's lease released")


def test_a_host_killed_with_sigkill_is_routed_around_at_once_with_the_default_settings(
    cluster: Cluster,
) -> None:
    """Kill box-3 whole (agent, gateway, model server) with the default TTL and without
    waiting for it to go offline: the first request at box-2's door is refused a
    connection by gw-3, leaves it out and loads the model on box-2 (box-3's lease keeps
    its memory, I4, and is not joined), served within seconds, not once the dead host's
    lease lapses. The time from the kill to that answer is printed."""
    models = _models(cluster)
    survivor = cluster.host(2, "1x24G:sm_86", models)
    doomed = cluster.host(3, "1x24G:sm_86", models)
    cluster.settled("chat")
    with doomed.gateway.client() as client:
        answer = client.post("/v1/chat/completions", json=chat("chat@gw-3"))
        assert served_by(answer) == "gw-3/chat"
    (server_record,) = records(cluster.record, "chat")
    with survivor.gateway.client() as client:
        wait_for(
            lambda: (
                served_by(client.post("/v1/chat/completions", json=chat("chat"))) == "gw-3/chat"
            ),
            what="gw-2's door to route chat to gw-3",
        )
        doomed.kill()
        os.kill(server_record["pid"], signal.SIGKILL)
        killed = time.monotonic()
        after = client.post("/v1/chat/completions", json=chat("chat"))
        took = time.monotonic() - killed
    print(f"kill -> first answer at the survivor's door: {took:.2f}s ({after.status_code})")
    assert after.status_code == 200, after.text
    assert served_by(after) == "gw-2/chat"


def test_a_frozen_gateway_is_routed_around_and_its_relays_end_with_a_504_default_settings(
    cluster: Cluster,
) -> None:
    """SIGSTOP gw-3's gateway for 20 s (its port still accepts; its agent and model
    server run on) with the default settings, while gw-2's door routes chat to it: gw-2's
    own liveness check sees the freeze, new requests load chat on box-2 and are served
    there, the requests relayed to gw-3 meanwhile (a stream begun before the freeze,
    plain requests after it) end with a 504 naming the host, none is sent elsewhere
    after its body left; after SIGCONT gw-3 is routable again. The times from the freeze
    to the first request routed elsewhere and to the 504s are printed."""
    models = _models(cluster)
    survivor = cluster.host(2, "1x24G:sm_86", models)
    frozen = cluster.host(3, "1x24G:sm_86", models)
    cluster.settled("chat")
    with frozen.gateway.client() as client:
        assert served_by(client.post("/v1/chat/completions", json=chat("chat@gw-3"))) == (
            "gw-3/chat"
        )
    door = survivor.gateway.client(timeout=120.0)
    wait_for(
        lambda: served_by(door.post("/v1/chat/completions", json=chat("chat"))) == "gw-3/chat",
        what="gw-2's door to route chat to gw-3",
    )
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=40)
    began = concurrent.futures.Future[None]()

    def stream() -> tuple[int, str]:
        body = chat("chat", stream=True, tokens=400, token_s=0.1)  # 40 s if left alone
        with door.stream("POST", "/v1/chat/completions", json=body) as answer:
            lines = []
            for line in answer.iter_lines():
                if line.startswith("data: ") and not began.done():
                    began.set_result(None)
                lines.append(line)
            return answer.status_code, "\n".join(lines)

    def plain() -> tuple[float, float, int, str]:
        sent = time.monotonic()
        answer = door.post("/v1/chat/completions", json=chat("chat"))
        text = answer.text if answer.status_code != 200 else served_by(answer)
        return sent, time.monotonic(), answer.status_code, text

    streaming = pool.submit(stream)
    began.result(timeout=60.0)
    pid = frozen.gateway.proc.pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        sent = []
        while time.monotonic() - frozen_at < 16.0:
            sent.append(pool.submit(plain))
            time.sleep(0.5)
        answers = [f.result(timeout=120.0) for f in sent]
        stream_status, stream_text = streaming.result(timeout=120.0)
        wait_for(lambda: time.monotonic() - frozen_at >= 20.0, what="20 s of freeze")
    finally:
        os.kill(pid, signal.SIGCONT)
    pool.shutdown()
    here = [(s, status) for s, _, status, by in answers if by == "gw-2/chat"]
    elsewhere = [s - frozen_at for s, status in here if status == 200]
    cut = [(s - frozen_at, e - frozen_at) for s, e, status, _ in answers if status == 504]
    print(f"freeze -> first request routed elsewhere: {min(elsewhere):.2f}s; "
          f"504s at {[round(e, 1) for _, e in cut]} s; {len(answers)} requests")  # fmt: skip
    for _, _, status, text in answers:
        assert status in (200, 504), text
        if status == 504:
            assert "gw-3 (box-3)" in text and "liveness check" in text, text
            assert "not sent again" in text, text
        else:
            assert text in ("gw-2/chat", "gw-3/chat"), text
    assert elsewhere, answers
    assert stream_status == 200
    final = [line for line in stream_text.splitlines() if line.startswith("data: {")][-1]
    error = json.loads(final.removeprefix("data: "))["error"]
    assert error["status"] == 504 and "gw-3 (box-3)" in error["message"], error
    # none was sent twice: box-2's server (chat's second) served exactly the requests
    # gw-2's door answered from it, no cut one among them
    first_server, second_server = records(cluster.record, "chat")
    assert first_server["pid"] != second_server["pid"]
    assert _served(second_server["pid"]) == len(elsewhere)
    wait_for(
        lambda: door.post("/v1/chat/completions", json=chat("chat@gw-3")).status_code == 200,
        what="gw-3 answers again and is routable from gw-2's door",
    )
    door.close()


def test_a_host_killed_mid_load_and_mid_stream_ends_each_request_naming_it(
    cluster: Cluster,
) -> None:
    """Default settings. gw-2 (box-2, too small for chat) is the door. (1) A stream
    relayed to gw-3 when box-3 is killed whole ends with a final error event naming the
    host; the next request loads chat on box-4 and is served. (2) Stopped there, chat's
    next load lands on box-3 or box-4 and that host is killed while chat loads: each
    request waiting for it (plain and streamed) ends with an answer from the other host
    or an error naming the lost one; the lost host's lease keeps its memory (I4) and is
    not joined by the next load."""
    models = _models(cluster, load_s=3.0)
    door = cluster.host(2, "1x4G:sm_86", models)
    hosts = {3: cluster.host(3, "1x24G:sm_86", models), 4: cluster.host(4, "1x24G:sm_86", models)}
    cluster.settled("chat")
    client = door.gateway.client(timeout=120.0)

    # (1) mid-stream
    with hosts[3].gateway.client() as own:
        assert served_by(own.post("/v1/chat/completions", json=chat("chat@gw-3"))) == "gw-3/chat"
    began = concurrent.futures.Future[None]()

    def stream() -> str:
        body = chat("chat", stream=True, tokens=400, token_s=0.05)
        with client.stream("POST", "/v1/chat/completions", json=body) as answer:
            assert answer.status_code == 200
            lines = []
            for line in answer.iter_lines():
                if line.startswith("data: ") and not began.done():
                    began.set_result(None)
                lines.append(line)
            return "\n".join(lines)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)
    streaming = pool.submit(stream)
    began.result(timeout=60.0)
    (server,) = records(cluster.record, "chat")
    hosts[3].kill()
    os.kill(server["pid"], signal.SIGKILL)
    final = [line for line in streaming.result(timeout=60).splitlines() if "error" in line][-1]
    error = json.loads(final.removeprefix("data: "))["error"]
    assert "gw-3 (box-3)" in error["message"], error
    after = client.post("/v1/chat/completions", json=chat("chat"))
    assert after.status_code == 200, after.text
    assert served_by(after) == "gw-4/chat"

    # (2) mid-load: chat stopped on box-4 and its next load's host killed while it loads
    hosts[3].agent.start()
    hosts[3].gateway.start()
    cluster.settled("chat")
    with hosts[4].gateway.client() as own:
        assert own.post("/admin/models/chat/unload", json={}).status_code == 200
    wait_for(lambda: not [x for x in model_leases(cluster.admin, "chat")
                          if x["worker"] == "box-4"], what="box-4's chat ended")  # fmt: skip
    bodies = [chat("chat"), chat("chat", stream=True), chat("chat")]
    started = len(records(cluster.record, "chat"))

    def ask(body: dict[str, Any]) -> tuple[int, str]:
        if body.get("stream"):
            with client.stream("POST", "/v1/chat/completions", json=body) as answer:
                text = "".join(answer.iter_text())
                return answer.status_code, text
        answer = client.post("/v1/chat/completions", json=body)
        return answer.status_code, answer.text if answer.status_code != 200 else served_by(answer)

    asked = [pool.submit(ask, body) for body in bodies]
    wait_for(lambda: len(records(cluster.record, "chat")) > started, what="chat's next load")
    loading = wait_for(
        lambda: [x["worker"] for x in model_leases(cluster.admin, "chat") if x["worker"]],
        what="the lease of chat's next load",
    )
    assert len(set(loading)) == 1, loading
    lost = int(loading[0].removeprefix("box-"))
    other = 7 - lost
    hosts[lost].kill()
    for record in records(cluster.record, "chat")[started:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(record["pid"], signal.SIGKILL)
    outcomes = [f.result(timeout=120.0) for f in asked]
    print(f"box-{lost} killed while chat loaded there:", [(s, t[-120:]) for s, t in outcomes])
    for status, text in outcomes:
        if status == 200 and text.startswith("gw-"):
            assert text == f"gw-{other}/chat", text
        elif status == 200:  # a stream: served, or its final error event names the host
            assert "[DONE]" in text or f"box-{lost}" in text, text
        else:
            assert f"box-{lost}" in text or f"gw-{lost}" in text, text
    again = client.post("/v1/chat/completions", json=chat("chat"))
    assert again.status_code == 200, again.text
    assert served_by(again) == f"gw-{other}/chat"
    held = [x for x in model_leases(cluster.admin, "chat") if x["worker"] == f"box-{lost}"]
    assert held, "the lost host's lease keeps its memory until its agent confirms (I4)"
    pool.shutdown()
    client.close()


def test_a_model_whose_only_host_is_lost_is_a_503_at_the_door_naming_it_and_since_when(
    cluster: Cluster,
) -> None:
    """box-3, the only host chat fits, is killed whole (default settings): at gw-2's door
    a request for chat is a 503 with Retry-After naming the host, first as out of the
    door's reach (its gateway refused a connection), then, once the controller has it
    offline, as offline since the time of its last heartbeat (beside why the door's own
    host cannot hold it)."""
    models = _models(cluster)
    door = cluster.host(2, "1x4G:sm_86", models)
    lost = cluster.host(3, "1x24G:sm_86", models)
    cluster.settled("chat")
    lost.kill()
    with door.gateway.client() as client:
        answer = client.post("/v1/chat/completions", json=chat("chat"))
        assert answer.status_code == 503, answer.text
        assert answer.headers.get("retry-after"), answer.headers
        message = answer.json()["error"]["message"]
        assert "box-3" in message and ("gw-3" in message or "offline" in message), message
        wait_for(lambda: worker_state(cluster.admin, "box-3") == "offline", what="box-3 offline")
        last = cluster.admin.get("/v1/workers/box-3").json()["last_heartbeat_at"]
        since = time.strftime("%H:%M:%S UTC", time.gmtime(last))
        answer = client.post("/v1/chat/completions", json=chat("chat"))
    assert answer.status_code == 503, answer.text
    assert answer.headers.get("retry-after"), answer.headers
    message = answer.json()["error"]["message"]
    assert message.startswith("chat: box-2 cannot hold it (8.0 GiB"), message
    assert message.endswith(f"; box-3 is offline since {since}"), message


def _served(pid: int) -> int:
    """How many requests the test model server of process ``pid`` served (its port read
    from its command line)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    port = int(argv[argv.index(b"--port") + 1])
    return int(httpx.get(f"http://127.0.0.1:{port}/stats").json()["requests"])


def test_a_caller_that_hangs_up_while_its_load_is_pending_cancels_it(cluster: Cluster) -> None:
    """Every GPU is held by a lease chat cannot preempt, so its cluster load stays pending;
    the one caller waiting for it, a stream, hangs up: the front door withdraws the load
    and the controller cancels it within wait_for's bound (20 s, the time of one
    long-poll, LOAD_WAIT_S, which it no longer waits out), and no server ever starts."""
    door = cluster.host(2, "1x24G:sm_86", _models(cluster))
    cluster.host(3, "1x24G:sm_86", _models(cluster))
    cluster.settled("chat")
    for worker in ("box-2", "box-3"):
        held = cluster.admin.post(
            "/v1/leases",
            json={
                "vram_mb": 20000,
                "priority": 1000,
                "ttl_s": 300,
                "constraints": {"worker": worker},
            },
        )
        assert held.status_code < 300, held.text
    with (
        door.gateway.client() as client,
        client.stream("POST", "/v1/chat/completions", json=chat("chat", stream=True)) as stream,
    ):
        lines = stream.iter_lines()  # kept: a generator closed ends the connection
        assert next(line for line in lines if line.startswith(": chat"))  # it waits
        (pending,) = wait_for(
            lambda: [
                ls for ls in cluster_leases(cluster.admin, "chat") if ls["state"] == "pending"
            ],
            what="chat's load pending",
        )
    hung_up = time.monotonic()  # the client hung up
    ended = wait_for(
        lambda: (
            (found := cluster.admin.get(f"/v1/leases/{pending['id']}").json())["ended_at"] and found
        ),
        what="chat's pending load cancelled",
    )
    print(f"hang-up -> the pending load ended: {time.monotonic() - hung_up:.2f}s")
    assert (ended["state"], ended["end_reason"]) == ("cancelled", "cancelled"), ended
    assert cluster.started("chat") == 0


def test_a_draining_host_gets_no_new_request_while_its_own_finish(cluster: Cluster) -> None:
    """``drain box-3`` while chat is served there, a stream in flight on it: new requests
    at every door, box-3's own included, go to box-2 (box-3's lease is not the model's
    load any more, I4 keeping its memory until it ends), the stream finishes, then
    box-3's replica ends, its lease is released and the drain completes. (At gw-2 the
    model is cold and box-3 out: gw-2 loads it as the only host that may run it.)"""
    first = cluster.host(2, "1x24G:sm_86", _models(cluster))
    draining = cluster.host(3, "1x24G:sm_86", _models(cluster))
    cluster.settled("chat")
    with draining.gateway.client() as client:
        warm = client.post("/v1/chat/completions", json=chat("chat@gw-3"))
        assert served_by(warm) == "gw-3/chat"
    (box_3,) = records(cluster.record, "chat")
    hold = cluster.root / "let-the-stream-end"
    body = chat("chat@gw-3", stream=True, tokens=4, hold=str(hold))
    with (
        draining.gateway.client() as client,
        client.stream("POST", "/v1/chat/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # it runs there
        drained = cluster.admin.post("/v1/workers/box-3/drain", json={})
        assert drained.status_code in (200, 202), drained.text
        for door in (first, draining):
            with door.gateway.client() as other:
                moved = wait_for(
                    lambda: (
                        (r := other.post("/v1/chat/completions", json=chat("chat")))
                        and served_by(r) == "gw-2/chat"
                        and r
                    ),
                    what=f"requests at {door.gateway.url} served by gw-2",
                )
            assert moved.status_code == 200
        assert worker_state(cluster.admin, "box-3") == "draining"  # the stream still runs
        hold.touch()
        rest = list(lines)
    assert "data: [DONE]" in rest, rest
    assert sum(1 for line in rest if line.startswith("data: {")) == 3  # every token came
    wait_for(lambda: worker_state(cluster.admin, "box-3") == "drained", what="box-3 drained")

    def ended() -> bool:
        return any(r["pid"] == box_3["pid"] and r.get("term_at") for r in records(
            cluster.record, "chat"))  # fmt: skip

    wait_for(ended, what="box-3's chat server stopped")
    assert {lease["worker"] for lease in model_leases(cluster.admin, "chat")} == {"box-2"}


def test_a_load_granted_while_no_front_door_forwards_is_adopted_by_its_host(
    cluster: Cluster,
) -> None:
    """The front door that asked for the load is gone before it forwarded any request
    there: the controller hands the lease to the gateway beside its worker, which starts
    the server under it, and the next request anywhere is served by it."""
    door = cluster.host(2, "1x4G:sm_86", _models(cluster))
    cluster.host(3, "1x24G:sm_86", _models(cluster))
    cluster.settled("chat")
    asked = cluster.admin.post(
        "/v1/gateways/gw-2/loads", params={"wait": 10}, json={"model": "chat"}
    )  # as gw-2 would, and then nothing more from it
    assert asked.status_code == 200, asked.text
    assert asked.json()["state"] == "loading" and asked.json()["worker"] == "box-3"
    lease_id = asked.json()["id"]

    def active() -> bool:
        return bool(cluster.admin.get(f"/v1/leases/{lease_id}").json()["state"] == "active")

    wait_for(active, what="gw-3 to adopt the lease and load chat under it")
    assert cluster.started("chat") == 1
    with door.gateway.client() as client:
        answer = client.post("/v1/chat/completions", json=chat("chat"))
    assert served_by(answer) == "gw-3/chat"
    assert cluster.started("chat") == 1
    assert [lease["id"] for lease in cluster_leases(cluster.admin, "chat")] == [lease_id]


def test_a_load_for_a_model_no_routable_gateway_declares_is_a_404_naming_it(
    cluster: Cluster,
) -> None:
    cluster.host(2, "1x24G:sm_86", _models(cluster))
    cluster.settled("chat")
    missing = cluster.admin.post("/v1/gateways/gw-2/loads", json={"model": "nope"})
    assert missing.status_code == 404
    assert "nope" in missing.json()["error"]["message"]
    bad = cluster.admin.post("/v1/gateways/gw-2/loads", json={"model": "chat", "replicas": 0})
    assert bad.status_code == 422
    assert "replicas" in bad.text
    unknown = cluster.admin.post("/v1/gateways/gw-9/loads", json={"model": "chat"})
    assert unknown.status_code == 404
    assert cluster_leases(cluster.admin, "chat") == []


def test_replicas_grow_under_queueing_and_the_one_beyond_min_goes_first(
    cluster: Cluster,
) -> None:
    """``replicas = {min = 1, max = 2}``: requests queue at gw-2 for its busy replica, so
    a second replica is asked for the cluster and placed by the arbiter where it fits
    (box-3: box-2 cannot hold two); new requests then go there. Once quiet, the second
    is marked idle at once (the arbiter's to reclaim first) and stops at keep_alive,
    while the first keeps its lease busy-marked until idle_after."""
    models = _models(cluster, vram="14G", max_parallel=1, keep_alive="4s", idle_after="60s")
    models += "replicas = { min = 1, max = 2 }\n"
    first = cluster.host(2, "1x24G:sm_86", models)
    cluster.host(3, "1x24G:sm_86", models)
    cluster.settled("chat")
    with first.gateway.client() as client:
        warm = client.post("/v1/chat/completions", json=chat("chat@gw-2"))
        assert served_by(warm) == "gw-2/chat"

    def slow(token_s: float) -> str:
        with httpx.Client(base_url=first.gateway.url, timeout=60) as client:
            answer = client.post("/v1/chat/completions", json=chat("chat", token_s=token_s))
            assert answer.status_code == 200, answer.text
            return served_by(answer)

    def second_ready_in_view() -> bool:
        """gw-2's view of the cluster shows gw-3's replica ready (it follows gw-3's
        reports: the controller's leases alone say nothing of what gw-2 routes by)."""
        with first.gateway.client() as client:
            models = client.get("/v1/models").json()["data"]
        hosts = next(m for m in models if m["id"] == "chat").get("hosts", [])
        return any(h["gateway"] == "gw-3" and h["state"] in ("warm", "busy") for h in hosts)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        # the queued four keep gw-2's one slot busy about 12 s: the later ones, sent once
        # gw-2 sees gw-3's replica ready, find gw-2 full and gw-3 free, however slow
        # the machine is to start the second replica
        queued = [pool.submit(slow, 1.0) for _ in range(4)]  # three tokens, 1 s each
        wait_for(lambda: cluster.started("chat") == 2, timeout_s=30, what="a second replica")
        wait_for(lambda: len(model_leases(cluster.admin, "chat")) == 2, what="two leases")
        wait_for(second_ready_in_view, timeout_s=30, what="gw-2 to see gw-3's replica ready")
        later = [pool.submit(slow, 0.3) for _ in range(4)]
        servers = {f.result() for f in queued + later}
    assert servers == {"gw-2/chat", "gw-3/chat"}
    leases = {lease["worker"]: lease for lease in model_leases(cluster.admin, "chat")}
    assert set(leases) == {"box-2", "box-3"}
    assert leases["box-3"]["metadata"]["replica"] == 2

    def marks() -> dict[str, bool]:
        return {lease["worker"]: lease["idle"] for lease in model_leases(cluster.admin, "chat")}

    wait_for(lambda: marks().get("box-3") is True, what="the second replica marked idle")
    assert marks()["box-2"] is False  # the first one is no cache before idle_after
    wait_for(lambda: "box-3" not in marks(), timeout_s=20, what="the second one stopped")


def _keys(key: str, priority: str) -> str:
    return f'[[gateway.keys]]\nkey = "{key}"\nname = "{key[:8]}"\npriority = "{priority}"\n\n'


def test_api_keys_apply_at_the_front_door_and_its_priority_travels_with_the_request(
    cluster: Cluster,
) -> None:
    """The front door checks its own keys; the serving gateway takes the peer's word for
    them (it has other keys), and the key's priority is the cold load's where higher than
    the model's (a batch key's is not: the model's own is asked). A caller can
    neither pass as a peer nor raise its priority with the peers' headers."""
    door_key, other_key = "sk-door-indexer-key", "sk-another-hosts-key"
    door = cluster.host(2, "1x4G:sm_86", _keys(door_key, "batch") + _models(cluster))
    serving = cluster.host(3, "1x24G:sm_86", _keys(other_key, "critical") + _models(cluster))
    cluster.settled("chat")
    body = chat("chat")
    refused = httpx.post(door.gateway.url + "/v1/chat/completions", json=body, timeout=30)
    assert refused.status_code == 401
    with door.gateway.client() as client:
        raised = {"x-arbiter-priority": "1000", "x-arbiter-via": "gw-3"}
        answer = client.post("/v1/chat/completions", json=body, headers=raised)
    assert answer.status_code == 200, answer.text
    assert served_by(answer) == "gw-3/chat"
    (lease,) = cluster_leases(cluster.admin, "chat")
    assert lease["priority"] == 500  # the model's: the key's batch (100) never lowers it,
    # and the header's 1000 is not a caller's to give
    direct = httpx.post(
        serving.gateway.url + "/v1/chat/completions", json=body, timeout=30,
        headers={"authorization": f"Bearer {door_key}"},
    )  # fmt: skip
    assert direct.status_code == 401  # the door's key is the door's only
    forged = httpx.post(
        serving.gateway.url + "/v1/chat/completions", json=body, timeout=30,
        headers={"x-arbiter-peer": "not-a-signed-header"},
    )  # fmt: skip
    assert forged.status_code == 403
    assert forged.json()["error"]["code"] == "invalid_peer"
    assert cluster.started("chat") == 1


def test_a_front_door_stopping_gives_its_relays_the_grace_then_ends_them_with_an_error(
    cluster: Cluster,
) -> None:
    """SIGTERM to a front door while it relays a stream from another host: the stream
    goes on for the grace, then ends with a final error event naming the stop; the
    serving host's replica is untouched. A stream that waited for the cold load before
    its head went out says who served it in a comment line."""
    door = cluster.host(2, "1x4G:sm_86", _models(cluster, grace="1s"))
    serving = cluster.host(3, "1x24G:sm_86", _models(cluster))
    cluster.settled("chat")
    body = chat("chat", stream=True)
    with (
        door.gateway.client() as client,
        client.stream("POST", "/v1/chat/completions", json=body) as cold,
    ):
        lines = list(cold.iter_lines())
    assert ": served by gw-3/chat" in lines, lines
    assert "data: [DONE]" in lines
    slow = chat("chat", stream=True, tokens=40, token_s=0.25)
    with (
        door.gateway.client() as client,
        client.stream("POST", "/v1/chat/completions", json=slow) as answer,
    ):
        assert answer.headers["x-served-by"] == "gw-3/chat"
        got = answer.iter_lines()
        assert next(line for line in got if line.startswith("data: {"))
        assert door.gateway.proc is not None
        door.gateway.proc.send_signal(signal.SIGTERM)
        rest = list(got)
    events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert "error" in events[-1], rest
    assert events[-1]["error"]["status"] == 503
    assert "stopping" in events[-1]["error"]["message"]
    assert sum(1 for e in events if "choices" in e) < 39  # cut, not finished
    assert door.gateway.proc.wait(30) == 0
    assert serving.gateway.model_state("chat")["state"] in ("warm", "busy")
    assert cluster.started("chat") == 1


def test_a_named_hosts_copy_is_served_from_every_door_and_one_out_is_named(
    cluster: Cluster,
) -> None:
    """``chat@gw-3`` at gw-2's door is served by gw-3 (the relayed body still names it,
    and gw-3 takes its own name off), its answer naming the model as asked, each chunk
    of a stream too; a gateway no live one is called is a 404 naming it, and gw-3 while
    its worker drains a 503 naming it and why, at either door."""
    door = cluster.host(2, "1x24G:sm_86", _models(cluster))
    named = cluster.host(3, "1x24G:sm_86", _models(cluster))
    cluster.settled("chat")
    with door.gateway.client() as client:
        answer = client.post("/v1/chat/completions", json=chat("chat@gw-3"))
        assert answer.status_code == 200, answer.text
        assert served_by(answer) == "gw-3/chat"
        assert answer.json()["model"] == "chat@gw-3"
        alias = client.post("/v1/chat/completions", json=chat("gpt-4o-mini@gw-3"))
        assert served_by(alias) == "gw-3/chat"
        assert alias.json()["model"] == "gpt-4o-mini@gw-3"
        body = chat("chat@gw-3", stream=True, tokens=3)
        with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
        assert [json.loads(line[6:])["model"] for line in lines] == ["chat@gw-3"] * 3
        missing = client.post("/v1/chat/completions", json=chat("chat@gw-9"))
        assert missing.status_code == 404
        assert "gw-9" in missing.json()["error"]["message"]
    assert cluster.started("chat") == 1  # gw-2 loaded none of its own
    drained = cluster.admin.post("/v1/workers/box-3/drain", json={})
    assert drained.status_code in (200, 202), drained.text
    for front in (door, named):
        with front.gateway.client() as client:
            refused = wait_for(
                lambda: (
                    (r := client.post("/v1/chat/completions", json=chat("chat@gw-3")))
                    and r.status_code == 503
                    and r
                ),
                what=f"chat@gw-3 refused at {front.gateway.url}",
            )
        message = refused.json()["error"]["message"]
        assert "gw-3" in message and "box-3 is drain" in message, message
        assert refused.headers["retry-after"]
