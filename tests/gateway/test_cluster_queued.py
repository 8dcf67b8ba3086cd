"""A cluster load still queued, as its waiting callers and the model listing read it:
the words (``cluster/queued.py``), the front door following its reason through the
load's long-poll (``after``: the signature it read last), and the listing from its own
load or from the controller's view; on a virtual clock, no controller."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpu_arbiter.gateway.cluster.cluster import Cluster
from gpu_arbiter.gateway.cluster.queued import nearest, queued_words
from gpu_arbiter.gateway.servers.lease import Lease

from .fakes import FakeClock, settle

pytestmark = pytest.mark.timeout(20)


def _reason(blocker: str, gpu: str = "box-3:0") -> dict[str, Any]:
    verdicts = [
        {"gpu": "box-2:0", "code": "too_small", "need_mb": 8192, "free_mb": 4096,
         "committed_mb": 0, "observed_mb": 0, "count": 1},
        {"gpu": gpu, "code": "insufficient_vram", "need_mb": 8192, "free_mb": 4096,
         "committed_mb": 20480, "observed_mb": 20480, "count": 2},
    ]  # fmt: skip
    message = f"0/3 GPUs fit; waiting for busy lease {blocker} (holder 'train', normal)"
    return {"code": "insufficient_vram", "message": message, "gpus": verdicts,
            "blocker": {"id": blocker, "gpus": [gpu]}}  # fmt: skip


def _pending(blocker: str, position: int = 1) -> dict[str, Any]:
    return {"id": "l1", "state": "pending", "position": position, "reason": _reason(blocker)}


def test_the_words_name_the_nearest_host_its_figures_and_the_lease_in_the_way() -> None:
    lease = Lease.of(_pending("b1"))
    words = queued_words(lease, {"box-3": "gw-3"}.get)
    assert words == (
        "queued for the cluster, position 1; nearest host box-3 (gw-3): box-3:0 "
        "insufficient_vram: need 8.0 GiB, free 4.0 GiB, committed 20.0 GiB, observed 20.0 GiB "
        "(1 more GPU(s) say the same); 0/3 GPUs fit; waiting for busy lease b1 (holder "
        "'train', normal)"
    )
    assert "nearest host box-3:" in queued_words(lease, lambda worker: None)  # no gateway known
    bare = Lease.of({"id": "l1", "state": "pending", "reason": {"code": "paused"}})
    assert queued_words(bare, lambda worker: None) == "queued for the cluster: paused"


def test_the_nearest_gpu_is_the_one_in_the_way_else_the_first() -> None:
    reason = _reason("b1")
    assert nearest(reason)["gpu"] == "box-3:0"  # type: ignore[index]
    del reason["blocker"]
    assert nearest(reason)["gpu"] == "box-2:0"  # type: ignore[index]
    assert nearest({}) is None


class _Controller:
    """The loads route: each long-poll answers the next of ``answers`` once ``go`` is
    set (then cleared); the params of each call are kept."""

    def __init__(self, *answers: dict[str, Any]) -> None:
        self.answers = list(answers)
        self.params: list[Any] = []
        self.go = asyncio.Event()

    async def request(self, method: str, path: str, **keys: Any) -> Any:
        if path.endswith("/cluster"):
            await asyncio.Event().wait()
        self.params.append(keys.get("params"))
        await self.go.wait()
        self.go.clear()
        return self.answers.pop(0)


async def test_a_front_door_follows_its_pending_loads_reason_and_lists_it_queued() -> None:
    controller = _Controller(
        {**_pending("b1"), "signature": "s1"},
        {**_pending("b2", position=2), "signature": "s2"},
        {"id": "l1", "state": "loading", "worker": "box-3", "gpus": ["box-3:0"]},
    )
    cluster = Cluster(
        controller,  # type: ignore[arg-type]
        name="gw-2", worker="box-2", models={}, routes={}, clock=FakeClock(),
    )  # fmt: skip
    life = asyncio.ensure_future(cluster.run())
    try:
        await settle()
        gw3 = {"name": "gw-3", "url": "http://127.0.0.3:1", "worker": "box-3", "models": []}
        cluster.apply({"gateways": [gw3]})
        waiter = asyncio.ensure_future(cluster.load("chat", 500))
        await settle()
        assert cluster.load_waiting("chat") == "asking the arbiter where to load it"
        assert cluster.queued("chat") is None
        controller.go.set()
        await settle()
        assert "nearest host box-3 (gw-3)" in cluster.load_waiting("chat")
        assert "lease b1" in cluster.load_waiting("chat")
        assert controller.params[-1]["after"] == "s1"  # answered when it moves from there
        queued = cluster.queued("chat")
        assert queued is not None
        assert (queued["lease"], queued["asked_by"], queued["waiters"]) == ("l1", ["gw-2"], 1)
        controller.go.set()
        await settle()
        assert "lease b2" in cluster.load_waiting("chat")
        assert cluster.queued("chat")["position"] == 2  # type: ignore[index]
        assert controller.params[-1]["after"] == "s2"
        controller.go.set()
        assert (await waiter).worker == "box-3"
        assert cluster.queued("chat") is None  # granted: no longer queued
    finally:
        life.cancel()
        await asyncio.gather(life, return_exceptions=True)


def test_another_front_doors_load_is_listed_from_the_controllers_view() -> None:
    cluster = Cluster(
        None,  # type: ignore[arg-type]
        name="gw-3", worker="box-3", models={}, routes={}, clock=FakeClock(),
    )  # fmt: skip
    load = {"model": "chat", "lease": "l1", "asked_by": ["gw-2"], "position": 1,
            "reason": _reason("b1")}  # fmt: skip
    cluster.apply({"gateways": [], "loads": [load]})
    queued = cluster.queued("chat")
    assert queued is not None
    assert (queued["lease"], queued["asked_by"], queued["waiters"]) == ("l1", ["gw-2"], 0)
    assert "nearest host box-3 (gw-3)" in queued["waiting"]  # its own worker: this gateway
    cluster.apply({"gateways": []})  # the view no longer shows it: granted or gone
    assert cluster.queued("chat") is None
