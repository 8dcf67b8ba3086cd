"""The front door's liveness check of the other gateways (``cluster/liveness.py``), on the
virtual clock with peers that answer, freeze, refuse or fail as a test says: a freeze is
seen within ``check_s + timeout_s``, the relays there are cut ``cut_s`` later, a peer that
answers again is routable at once, a refusal is its own state, and a peer is asked once
at a time however long it stays silent."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from gpu_arbiter.gateway.base.upstream import NotConnected, UpstreamError
from gpu_arbiter.gateway.cluster.liveness import Liveness, LivenessSettings

from .fakes import FakeClock, settle


class Peers:
    """Each peer's behaviour: "ok", "frozen" (never answers), "refused" or "reset"; and
    what the check told of them."""

    def __init__(self, clock: FakeClock, **states: str) -> None:
        self.clock = clock
        self.states = dict(states)
        self.asked: list[str] = []
        self.outstanding: dict[str, int] = {}
        self.events: list[tuple[float, str, str]] = []
        self.tasks: list[asyncio.Future[None]] = []
        self.frozen: dict[str, asyncio.Event] = {}

    async def ping(self, name: str) -> None:
        self.asked.append(name)
        self.outstanding[name] = self.outstanding.get(name, 0) + 1
        try:
            state = self.states[name]
            if state == "frozen":
                thawed = self.frozen.setdefault(name, asyncio.Event())
                await thawed.wait()
            elif state == "refused":
                raise NotConnected("ConnectionRefusedError")
            elif state == "reset":
                raise UpstreamError("the server closed the connection without answering")
        finally:
            self.outstanding[name] -= 1

    def thaw(self, name: str) -> None:
        self.states[name] = "ok"
        self.frozen.pop(name, asyncio.Event()).set()

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(work)
        self.tasks.append(task)
        return task

    def told(self, what: str) -> Any:
        return lambda name, *_: self.events.append((self.clock.now() - 1000.0, what, name))

    def liveness(self, settings: LivenessSettings | None = None) -> Liveness:
        return Liveness(
            settings or LivenessSettings(), self.clock, self.ping,
            refused=self.told("refused"), silent=self.told("silent"), cut=self.told("cut"),
            answers=self.told("answers"),
        )  # fmt: skip


async def _watching(peers: Peers, liveness: Liveness) -> asyncio.Task[None]:
    task = asyncio.ensure_future(liveness.watch(lambda: peers.states.keys(), peers.spawn))
    await settle()
    return task


async def _stop(task: asyncio.Task[None], peers: Peers) -> None:
    task.cancel()
    for spawned in peers.tasks:
        spawned.cancel()
    await asyncio.wait([task, *peers.tasks])


async def test_a_peer_that_answers_is_never_silent() -> None:
    clock = FakeClock()
    peers = Peers(clock, gw2="ok")
    liveness = peers.liveness()
    task = await _watching(peers, liveness)
    await clock.advance(30.0)
    assert liveness.silent() == [] and liveness.why("gw2") == ""
    assert peers.events == []
    assert 25 <= peers.asked.count("gw2") <= 31  # every check_s
    await _stop(task, peers)


@pytest.mark.parametrize("frozen_at", [0.0, 0.3, 0.99, 2.5])
async def test_a_freeze_is_seen_within_check_plus_timeout_and_its_relays_cut_later(
    frozen_at: float,
) -> None:
    clock = FakeClock()
    peers = Peers(clock, gw2="ok", gw3="ok")
    liveness = peers.liveness()
    task = await _watching(peers, liveness)
    await clock.advance(frozen_at)
    peers.states["gw3"] = "frozen"
    for _ in range(100):
        await clock.advance(0.1)
    seen = [at for at, what, name in peers.events if what == "silent" and name == "gw3"]
    cuts = [at for at, what, name in peers.events if what == "cut" and name == "gw3"]
    assert len(seen) == 1
    assert seen[0] - frozen_at <= 1.0 + 3.0 + 1e-6  # check_s + timeout_s
    assert cuts and cuts[0] - seen[0] >= 5.0 - 1e-6  # cut_s after it was seen
    assert cuts[0] - seen[0] <= 5.0 + 1.0 + 1e-6  # at the next check after that
    assert liveness.silent() == ["gw3"]
    assert liveness.why("gw3").startswith("not answering its liveness check since ")
    assert liveness.why("gw2") == ""
    assert max(peers.outstanding.values()) <= 1  # one ask at a time, however long
    await _stop(task, peers)


async def test_a_silent_peer_that_answers_again_is_routable_at_once() -> None:
    clock = FakeClock()
    peers = Peers(clock, gw3="frozen")
    liveness = peers.liveness()
    task = await _watching(peers, liveness)
    await clock.advance(4.5)
    assert liveness.silent() == ["gw3"]
    peers.thaw("gw3")
    await settle()
    assert liveness.silent() == [] and liveness.why("gw3") == ""
    assert [what for _, what, _ in peers.events] == ["silent", "answers"]
    await clock.advance(20.0)
    assert [what for _, what, _ in peers.events] == ["silent", "answers"]  # no cut
    await _stop(task, peers)


async def test_a_refused_connection_is_its_own_state_told_at_each_check() -> None:
    clock = FakeClock()
    peers = Peers(clock, gw3="refused")
    liveness = peers.liveness()
    task = await _watching(peers, liveness)
    await clock.advance(10.0)
    refusals = [at for at, what, _ in peers.events if what == "refused"]
    assert len(refusals) >= 10  # each check: the peer stays out while it is dead
    assert liveness.silent() == []
    assert {what for _, what, _ in peers.events} == {"refused"}
    await _stop(task, peers)


async def test_an_ask_that_fails_counts_as_no_answer() -> None:
    clock = FakeClock()
    peers = Peers(clock, gw3="reset")
    liveness = peers.liveness(LivenessSettings(check_s=1.0, timeout_s=2.0, cut_s=1.0))
    task = await _watching(peers, liveness)
    await clock.advance(5.0)
    assert liveness.silent() == ["gw3"]
    assert ("cut", "gw3") in [(what, name) for _, what, name in peers.events]
    await _stop(task, peers)


async def test_a_peer_gone_from_the_view_is_no_longer_asked() -> None:
    clock = FakeClock()
    peers = Peers(clock, gw2="ok", gw3="frozen")
    liveness = peers.liveness()
    task = await _watching(peers, liveness)
    await clock.advance(4.5)
    assert liveness.silent() == ["gw3"]
    del peers.states["gw3"]
    await clock.advance(1.0)
    assert liveness.silent() == [] and liveness.why("gw3") == ""
    asked = peers.asked.count("gw3")
    await clock.advance(10.0)
    assert peers.asked.count("gw3") == asked
    assert peers.outstanding["gw3"] == 0  # its ask in flight was cancelled
    await _stop(task, peers)
