"""The catalogue's follower on a fake controller and a virtual clock: each new revision's
share handed over once, an unreadable one skipped, the controller's absence waited out
with a bounded back-off, and a take-over followed through the client's failover."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest

from gpu_arbiter.client import ApiError, ArbiterClient, ControllerUnreachable
from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.files.spec import ModelFile
from gpu_arbiter.gateway.follower import CatalogueFollower
from gpu_arbiter.gateway.serve import _follow, verify_named
from gpu_arbiter.gateway.servers.config import ModelConfig

from .fakes import FakeClock, settle

Json = dict[str, Any]
CATALOGUE = """\
[models.chat]
command = "llama-server -m /models/qwen.gguf --port {port}"
vram = "6G"
hosts = ["box-1"]

[models.big]
command = "llama-server -m /models/big.gguf --port {port}"
vram = "60G"

[models.elsewhere]
command = "llama-server -m /models/e.gguf --port {port}"
vram = "1G"
hosts = ["box-2"]
"""
WORKER: Json = {
    "name": "box-1",
    "labels": {"zone": "a"},
    "gpus": [
        {"index": 0, "total_mb": 24576, "arch": "sm_86", "vendor": "nvidia",
         "model": "RTX 4090", "uuid": "GPU-1", "headroom_mb": 256},
    ],
}  # fmt: skip


class FakeController:
    """The catalogue's long-poll and the worker's read over a list of revisions;
    ``unreachable``: the next N calls fail as no controller answering."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.revisions: list[Json] = []
        self.workers: dict[str, Json] = {"box-1": WORKER}
        self.unreachable = 0
        self.asked: list[int] = []
        self.asked_at: list[float] = []
        self._changed = asyncio.Event()

    def apply(self, text: str) -> None:
        number = len(self.revisions) + 1
        sha = hashlib.sha256(text.encode()).hexdigest()
        self.revisions.append({"revision": number, "text": text, "file": "c.toml", "sha256": sha})
        self._changed.set()
        self._changed = asyncio.Event()

    async def catalogue_after(self, revision: int, wait_s: float) -> Json | None:
        self.asked.append(revision)
        self.asked_at.append(self.clock.now())
        if self.unreachable:
            self.unreachable -= 1
            raise ControllerUnreachable("no controller answered (http://a: refused)")
        if not self.revisions or self.revisions[-1]["revision"] <= revision:
            changed = asyncio.ensure_future(self._changed.wait())
            slept = asyncio.ensure_future(self.clock.sleep(wait_s))
            await asyncio.wait({changed, slept}, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            slept.cancel()
        return dict(self.revisions[-1]) if self.revisions else None

    async def worker(self, name: str) -> Json:
        if name not in self.workers:
            raise ApiError(404, "not_found", f"no worker {name!r}", {"worker": name})
        return self.workers[name]


class Handed:
    def __init__(self) -> None:
        self.calls: list[tuple[int, list[str]]] = []

    def __call__(self, revision: int, models: Mapping[str, ModelConfig]) -> None:
        self.calls.append((revision, sorted(models)))


@contextlib.asynccontextmanager
async def following(
    controller: FakeController | ArbiterClient, handed: Any, **options: Any
) -> AsyncIterator[CatalogueFollower]:
    clock = controller.clock if isinstance(controller, FakeController) else FakeClock()
    follower = CatalogueFollower(controller, "box-1", handed, clock=clock, **options)
    task = asyncio.ensure_future(follower.run())
    try:
        await settle()
        yield follower
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_each_new_revision_hands_over_this_workers_share_once() -> None:
    controller = FakeController(FakeClock())
    handed = Handed()
    async with following(controller, handed) as follower:
        assert handed.calls == [] and controller.asked == [0]  # waiting for a first one
        controller.apply(CATALOGUE)
        await settle()
        assert handed.calls == [(1, ["chat"])]  # big: no GPU holds it; elsewhere: box-2's
        await controller.clock.advance(30.0)  # the long-poll's end: asked again, nothing new
        assert handed.calls == [(1, ["chat"])]
        controller.apply(CATALOGUE.replace('"60G"', '"20G"'))
        await settle()
        assert handed.calls == [(1, ["chat"]), (2, ["big", "chat"])]
        assert follower.revision == 2 and controller.asked[-1] == 2


async def test_a_revision_this_gateway_cannot_read_is_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    controller = FakeController(FakeClock())
    handed = Handed()
    async with following(controller, handed) as follower:
        controller.apply('[models.a]\ncommand = "x {port}"\nfuture_key = 1\n')
        await settle()
        assert handed.calls == [] and follower.revision == 1
        assert "catalogue revision 1 skipped" in caplog.text
        assert "c.toml:3: models.a.future_key: unknown key" in caplog.text
        controller.apply(CATALOGUE)
        await settle()
        assert handed.calls == [(2, ["chat"])]


async def test_an_unreachable_controller_is_asked_again_after_a_doubling_bounded_backoff() -> None:
    clock = FakeClock()
    controller = FakeController(clock)
    controller.apply(CATALOGUE)
    controller.unreachable = 8
    handed = Handed()
    async with following(controller, handed, backoff_s=(0.5, 4.0)) as follower:
        while not handed.calls:
            await clock.advance(0.25)
        at = controller.asked_at
        pauses = [later - earlier for earlier, later in itertools.pairwise(at)]
        assert pauses[:8] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]  # then it answered
        assert handed.calls == [(1, ["chat"])] and follower.failures == 0


async def test_a_worker_not_registered_yet_is_asked_again_and_the_revision_handed_then() -> None:
    clock = FakeClock()
    controller = FakeController(clock)
    controller.workers = {}
    controller.apply(CATALOGUE)
    handed = Handed()
    async with following(controller, handed) as follower:
        assert handed.calls == [] and follower.revision == 0 and follower.failures == 1
        controller.workers = {"box-1": WORKER}
        await clock.advance(0.5)
        assert handed.calls == [(1, ["chat"])]


async def test_auto_models_take_this_hosts_estimate_or_are_left_out_callback_awaited() -> None:
    controller = FakeController(FakeClock())
    controller.apply(
        '[models.small]\ncommand = "llama-server -m /m/s.gguf --port {port}"\n'
        '[models.huge]\ncommand = "llama-server -m /m/h.gguf --port {port}"\n'
        '[models.unknown]\ncommand = "llama-server -m /m/u.gguf --port {port}"\n'
    )
    sizes = {"small": 4096, "huge": 90_000}
    seen: list[tuple[int, list[str]]] = []

    async def on_revision(revision: int, models: Mapping[str, ModelConfig]) -> None:
        await asyncio.sleep(0)
        seen.append((revision, sorted(models)))

    def estimate(model: ModelConfig) -> int | str:
        return sizes.get(model.name, "no model file here")

    async with following(controller, on_revision, estimate=estimate) as follower:
        for _ in range(100):  # the estimates run on a thread
            if seen:
                break
            await asyncio.sleep(0.01)
    assert seen == [(1, ["small"])]  # huge fits no GPU; unknown: no estimate here
    assert follower.left_out == {"unknown": "no model file here"}


async def test_a_take_over_is_followed_through_the_clients_failover() -> None:
    """The leader stops answering; the client moves on to the other controller it was
    given (the new leader, or a standby's copy), and the follower goes on from there."""
    stored = {"revision": 1, "text": CATALOGUE, "file": "c.toml"}
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.host} {request.url.path}")
        if request.url.host == "a":
            raise httpx.ConnectError("refused")
        if request.url.path == "/v1/workers/box-1":
            return httpx.Response(200, json=WORKER)
        return httpx.Response(200, json=stored)

    client = ArbiterClient("http://a:7070,http://b:7070", transport=httpx.MockTransport(answer))
    handed = Handed()
    try:
        follower = CatalogueFollower(client, "box-1", handed, clock=FakeClock())
        await follower.step()
    finally:
        await client.aclose()
    assert handed.calls == [(1, ["chat"])]
    assert seen[:3] == ["a /v1/catalogue", "b /v1/catalogue", "b /v1/workers/box-1"]


@pytest.mark.parametrize(
    ("settings", "worker", "said"),
    [
        ({"catalogue": False}, "box-1", ""),
        ({}, None, "the cluster's catalogue is not followed: no worker is known here"),
    ],
)
async def test_a_gateway_follows_not_when_turned_off_or_without_a_worker(
    settings: dict[str, Any],
    worker: str | None,
    said: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It returns at once, asking the controller nothing; without a worker it says so."""
    config = parse_config({"gateway": settings})
    client: Any = object()  # any call on it would raise
    live: Any = object()  # nor on this (the live set, the store, the estimate)
    with caplog.at_level(logging.INFO):
        await asyncio.wait_for(_follow(config, client, worker, live, live, live), 1.0)
    assert said in capsys.readouterr().err + caplog.text


async def test_a_named_file_that_cannot_be_verified_is_said_and_the_others_are_verified(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The files of a revision are verified beside its apply (a task nobody awaits for a
    result): one whose check fails, for whatever reason, is logged and the next one is
    verified all the same."""
    checked: list[str] = []

    class Store:
        async def verified(self, file: ModelFile) -> bool:
            checked.append(file.name)
            if file.name == "a.gguf":
                raise RuntimeError("the disk went away")
            return True

    files = [ModelFile("a.gguf", 1, "0" * 64), ModelFile("b.gguf", 1, "1" * 64)]
    with caplog.at_level(logging.WARNING, "gpu_arbiter.gateway"):
        await verify_named(Store(), files)  # type: ignore[arg-type]
    assert checked == ["a.gguf", "b.gguf"]
    assert "a.gguf: not verified here (RuntimeError: the disk went away)" in caplog.text
