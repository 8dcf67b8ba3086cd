"""The cluster's catalogue, end to end: a real controller, three hosts on this machine
(each a real agent with simulated GPUs and a real gateway on its own loopback address,
started with a ``[gateway]`` table only) and llama.cpp's real server on a tiny GGUF
model. An apply makes every front door serve the model; an add, a remove and a change
while callers stream through the doors fail no request; a host's own ``[models.chat]``
wins over the catalogue's there, and ``gpu-arbiter models`` says so; a standby
controller that takes over keeps the catalogue, and the gateways follow it."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from .cluster import Host
from .conftest import Server, wait_for
from .gateways import chat
from .test_cli import cli
from .test_gateway_llama import llama_entry
from .test_ha import Controllers, controllers, leader_of, role

__all__ = ["controllers"]

pytestmark = pytest.mark.timeout(300)

SPEC = "1x24G:sm_86"
CALLERS = 16


class Cluster:
    """Hosts 2..N of one controller, their gateways given no model of their own."""

    def __init__(self, server: Server, root: Path, llama: Path, models: Path) -> None:
        self.server = server
        self.root = root
        self.llama = llama
        self.gguf = models / "tiny-chat.gguf"
        self.admin = server.client()
        self.hosts: list[Host] = []

    def start(self, *numbers: int, own: str = "", controllers: str | None = None) -> None:
        for number in numbers:
            host = Host(self.server, self.root, number, SPEC, own if number == 2 else "",
                        controllers)  # fmt: skip
            self.hosts.append(host.start(self.admin))

    def entry(self, name: str, ctx: int = 512, **keys: Any) -> str:
        keys = {"vram": "1G", "keep_alive": "5m", **keys}
        return llama_entry(name, self.llama, self.gguf, ctx=ctx, **keys)[0]

    def apply(self, text: str, admin: httpx.Client | None = None) -> int:
        answer = (admin or self.admin).put("/v1/catalogue", json={"text": text, "file": "c.toml"})
        assert answer.status_code == 201, answer.text
        revision: int = answer.json()["revision"]
        return revision

    def listed(self, model: str) -> bool:
        """Whether every door lists ``model``."""
        return all(model in listing(host) for host in self.hosts)

    def pids(self, model: str) -> set[int]:
        """The pids of ``model``'s servers, on every host."""
        found = set()
        for host in self.hosts:
            entry = listing(host).get(model) or {}
            found |= {int(r["pid"]) for r in entry.get("replicas") or () if r.get("pid")}
        return found


def listing(host: Host) -> dict[str, dict[str, Any]]:
    with host.gateway.client() as client:
        return {m["id"]: m for m in client.get("/v1/models").json()["data"]}


@pytest.fixture
def cluster(
    start_server: Callable[..., Server], tmp_path: Path, llama_server: Path, tiny_models: Path
) -> Iterator[Cluster]:
    found = Cluster(start_server(), tmp_path, llama_server, tiny_models)
    yield found
    for host in reversed(found.hosts):
        host.stop()
    found.admin.close()


def ask(host: Host, model: str) -> httpx.Response:
    with host.gateway.client() as client:
        return client.post("/v1/chat/completions", json=chat(model, max_tokens=4))


def stream(host: Host, model: str, begun: threading.Event | None = None) -> str | None:
    """One streamed chat completion through ``host``'s door: None when it completed, else
    what went wrong; ``begun`` is set once its answer's head came (it is being served)."""
    body = chat(model, max_tokens=8, stream=True)
    try:
        with (
            host.gateway.client() as client,
            client.stream("POST", "/v1/chat/completions", json=body) as answer,
        ):
            if begun is not None:
                begun.set()
            text = answer.read().decode(errors="replace")
    except httpx.HTTPError as error:
        return f"{host.gateway.name}: {error.__class__.__name__}: {error}"
    if answer.status_code != 200 or '"error"' in text or "data: [DONE]" not in text:
        return f"{host.gateway.name}: {answer.status_code}: {text[-300:]}"
    return None


def test_an_apply_makes_every_door_serve_the_model(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start(2, 3, 4)
    assert ask(cluster.hosts[0], "chat").status_code == 404  # no model yet
    path = tmp_path / "catalogue.toml"
    path.write_text(cluster.entry("chat"))
    applied = cli(cluster.server, "catalogue", "apply", str(path))
    assert applied.returncode == 0, applied.stderr
    wait_for(lambda: cluster.listed("chat"), 30, "every door to list chat")
    for host in cluster.hosts:
        answer = ask(host, "chat")
        assert answer.status_code == 200, f"{host.gateway.name}: {answer.text}"


def test_an_add_a_remove_and_a_change_while_callers_stream_fail_no_request(
    cluster: Cluster,
) -> None:
    """The callers stream ``chat``, which stays; ``old`` is asked apart: its requests
    begun before its removal complete, and a door answers 404 once it learned of it."""
    cluster.start(2, 3, 4)
    cluster.apply(cluster.entry("chat") + cluster.entry("old"))
    wait_for(lambda: cluster.listed("chat") and cluster.listed("old"), 30, "chat and old")
    for host in cluster.hosts:
        assert ask(host, "chat").status_code == 200 and ask(host, "old").status_code == 200

    stop = threading.Event()
    failures: list[str] = []
    done = [0]

    def caller(number: int) -> None:
        while not stop.is_set():
            failed = stream(cluster.hosts[number % len(cluster.hosts)], "chat")
            if failed is not None:
                failures.append(failed)
            done[0] += 1

    with ThreadPoolExecutor(CALLERS + 4) as pool:
        callers = [pool.submit(caller, n) for n in range(CALLERS)]
        try:
            # added: every door serves it
            cluster.apply(cluster.entry("chat") + cluster.entry("old") + cluster.entry("new"))
            wait_for(lambda: cluster.listed("new"), 30, "every door to list new")
            for host in cluster.hosts:
                assert ask(host, "new").status_code == 200

            # removed: what began before completes; what begins after a door learned, 404
            begun = {host.number: threading.Event() for host in cluster.hosts}
            before = [pool.submit(stream, h, "old", begun[h.number]) for h in cluster.hosts]
            for one in begun.values():
                assert one.wait(60)
            revision = cluster.apply(cluster.entry("chat") + cluster.entry("new"))
            assert [request.result() for request in before] == [None] * len(before)
            for host in cluster.hosts:
                gone = wait_for(
                    lambda h=host: (a := ask(h, "old")).status_code == 404 and a,
                    30, f"{host.gateway.name} to refuse old",
                )  # fmt: skip
                message = gone.json()["error"]["message"]
                assert f"removed by catalogue revision {revision}" in message, message

            # what the server runs changed (its context): new servers, one at a time
            pids = wait_for(lambda: cluster.pids("chat"), 30, "chat's servers")
            cluster.apply(cluster.entry("chat", ctx=1024) + cluster.entry("new"))
            wait_for(
                lambda: (now := cluster.pids("chat")) and not now & pids, 90,
                "chat's servers replaced",
            )  # fmt: skip

            # in place (keep_alive, max_parallel): the same servers
            pids = cluster.pids("chat")
            changed = cluster.entry("chat", ctx=1024, keep_alive="10m", max_parallel=2)
            cluster.apply(changed + cluster.entry("new"))
            wait_for(
                lambda: all(listing(h)["chat"]["max_parallel"] == 2 for h in cluster.hosts), 30,
                "the change in place at every door",
            )  # fmt: skip
            assert pids <= cluster.pids("chat")
            served = done[0]
            wait_for(lambda: done[0] > served + CALLERS, 60, "the callers to go on")
        finally:
            stop.set()
        for one in callers:
            one.result()
    assert failures == []


def test_a_hosts_own_model_wins_there_and_models_shows_the_conflict(
    cluster: Cluster, tmp_path: Path
) -> None:
    """And a ``vram = "auto"`` model whose file no host has is left out of every host's
    share, the rest served, and ``gpu-arbiter models`` says why."""
    own = cluster.entry("chat", aliases=["mine"])
    cluster.start(2, 3, own=own)
    nowhere = tmp_path / "nowhere.gguf"
    ghost = llama_entry("ghost", cluster.llama, nowhere, vram="auto")[0]
    revision = cluster.apply(cluster.entry("chat") + ghost)
    door, other = cluster.hosts
    wait_for(lambda: cluster.listed("chat"), 30, "every door to list chat")
    assert listing(door)["chat"]["aliases"] == ["mine"]  # its own, not the catalogue's
    assert listing(other)["chat"]["aliases"] == []
    assert ask(door, "mine").status_code == 200

    def conflicts() -> list[dict[str, str]]:
        found = {g["name"]: g for g in cluster.admin.get("/v1/gateways").json()}
        return list(found.get(door.gateway.name, {}).get("conflicts") or [])

    over = f"catalogue revision {revision}"
    expected = [{"model": "chat", "kept": "own file", "over": over}]
    assert wait_for(lambda: conflicts() == expected and conflicts(), 30, "the conflict reported")
    assert "ghost" not in listing(door) and "ghost" not in listing(other)

    def left_out() -> dict[str, list[dict[str, str]]]:
        return {g["name"]: g.get("left_out") for g in cluster.admin.get("/v1/gateways").json()}

    why = f'vram = "auto" cannot be estimated on this host: model file {nowhere} does not exist'
    expected_left = {h.gateway.name: [{"model": "ghost", "why": why}] for h in cluster.hosts}
    wait_for(lambda: left_out() == expected_left, 30, "the model left out reported")
    shown = cli(cluster.server, "models")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    line = f"conflict: {door.gateway.name} ({door.gateway.url}): chat: own file kept over {over}"
    assert line in lines, shown.stdout
    for host in cluster.hosts:
        assert f"left out: {host.gateway.name} ({host.gateway.url}): ghost: {why}" in lines


def test_a_standby_that_takes_over_keeps_the_catalogue_and_the_gateways_follow_it(
    controllers: Controllers, tmp_path: Path, llama_server: Path, tiny_models: Path
) -> None:
    first = controllers.start("a")
    leader_of(first)
    second = controllers.start("b")
    wait_for(lambda: role(second) == "standby", 20, "the second to stand by")
    cluster = Cluster(first, tmp_path, llama_server, tiny_models)
    try:
        cluster.start(2, controllers=f"{first.url},{second.url}")
        cluster.apply(cluster.entry("chat"))
        wait_for(lambda: cluster.listed("chat"), 30, "the door to list chat")

        first.kill9()
        assert leader_of(second, timeout_s=30) is second
        with second.client(token=first.admin_token) as admin:
            assert admin.get("/v1/catalogue").json()["revision"] == 1
            cluster.apply(cluster.entry("chat") + cluster.entry("new"), admin)
        wait_for(lambda: cluster.listed("new"), 60, "the door to follow the new leader")
        assert ask(cluster.hosts[0], "new").status_code == 200
    finally:
        for host in cluster.hosts:
            host.stop()
        cluster.admin.close()


def test_a_catalogue_models_file_is_copied_to_the_host_that_may_run_it(cluster: Cluster) -> None:
    """A catalogue model naming its file (size, sha256) that only box-3 may run: gw-2
    holds the file (put there by hand) and, though it does not run the model, serves it
    to its peers; gw-3 copies it before it asks for its lease, and serves the model to a
    caller at gw-2's door."""
    data = cluster.gguf.read_bytes()
    held = cluster.root / "host-2" / "state" / "models"
    held.mkdir(parents=True)
    (held / "chat.gguf").write_bytes(data)
    cluster.start(2, 3)
    sha256 = hashlib.sha256(data).hexdigest()
    file = f'{{ name = "chat.gguf", size = {len(data)}, sha256 = "{sha256}" }}'
    entry = cluster.entry("chat").replace(str(cluster.gguf), "{file}")
    cluster.apply(entry + f'file = {file}\nhosts = ["box-3"]\n')
    expected = [
        {"name": "chat.gguf", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    ]
    wait_for(lambda: _files(cluster.admin, "gw-2") == expected, 30, "gw-2 to report the file")
    wait_for(lambda: cluster.listed("chat"), 30, "both doors to list chat")
    assert "chat" in _reported(cluster.admin, "gw-3")
    assert "chat" not in _reported(cluster.admin, "gw-2")  # its host may not run it
    answer = ask(cluster.hosts[0], "chat")
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-served-by"] == "gw-3/chat"
    copied = cluster.root / "host-3" / "state" / "models" / "chat.gguf"
    assert copied.read_bytes() == data


def _files(admin: httpx.Client, gateway: str) -> list[dict[str, Any]]:
    found = next((g for g in admin.get("/v1/gateways").json() if g["name"] == gateway), {})
    return list(found.get("files") or [])


def _reported(admin: httpx.Client, gateway: str) -> set[str]:
    """The models ``gateway`` serves itself, as it reports them to the controller."""
    found = next((g for g in admin.get("/v1/gateways").json() if g["name"] == gateway), {})
    return {str(m["id"]) for m in found.get("models") or ()}
