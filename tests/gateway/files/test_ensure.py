"""A replica's file is copied before its lease is asked for, on a virtual clock: no
lease while the copy goes on, the wait says how far it is, a corrupt copy ends the
start with its reason, a copy given up is resumed by the next start."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpu_arbiter.gateway.files.ensure import FileStep, sources_of
from gpu_arbiter.gateway.files.fetch import Download, Source
from gpu_arbiter.gateway.files.store import FileStore
from gpu_arbiter.gateway.servers.config import ModelFile
from gpu_arbiter.gateway.servers.model import Refused

from ..fakes import FakeClock, World

pytestmark = pytest.mark.timeout(20)
DATA = bytes(range(256)) * 4096  # 1 MiB
SHA = hashlib.sha256(DATA).hexdigest()
SPEC = {"name": "m.gguf", "size": len(DATA), "sha256": SHA}


@dataclass
class PeerOf:
    name: str
    url: str


@dataclass
class FakeHolders:
    peers: list[PeerOf] = field(default_factory=lambda: [PeerOf("gw-a", "http://gw-a:1")])
    seen: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.seen.set()

    def holders(self, name: str, size: int, sha256: str) -> Sequence[PeerOf]:
        return self.peers


@dataclass
class SlowFetcher:
    """``DATA`` (or ``data``) in 64 KiB chunks, one per virtual second."""

    clock: FakeClock
    data: bytes = DATA
    opened: list[int] = field(default_factory=list)

    @contextlib.asynccontextmanager
    async def open(self, source: Source, start: int) -> AsyncIterator[Download]:
        self.opened.append(start)
        yield Download(start, self._chunks(start))

    async def _chunks(self, start: int) -> AsyncIterator[bytes]:
        for at in range(start, len(self.data), 65536):
            await self.clock.sleep(1.0)
            yield self.data[at : at + 65536]


def world_of(tmp_path: Path, fetcher_data: bytes = DATA) -> tuple[World, SlowFetcher]:
    world = World(file=SPEC, vram="auto")
    fetcher = SlowFetcher(world.clock, fetcher_data)
    store = FileStore(tmp_path, fetcher, world.clock, free=lambda p: 1 << 40)
    world.model.files = FileStep(store, FakeHolders, "box-4")
    return world, fetcher


def test_sources_peers_first_then_the_url() -> None:
    file = ModelFile("m.gguf", 1, SHA, "https://example.com/m.gguf")
    found = sources_of(file, FakeHolders())
    assert [(s.url, s.peer) for s in found] == [
        ("http://gw-a:1/files/m.gguf", "gw-a"),
        ("https://example.com/m.gguf", None),
    ]
    assert sources_of(file, None) == [Source("https://example.com/m.gguf")]


async def test_no_lease_while_the_file_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world, _ = world_of(tmp_path)
    estimated: list[str] = []

    def estimate(command: object, **kwargs: object) -> object:
        estimated.append(str(kwargs["model_file"]))
        return type("E", (), {"total_mb": 2048})()

    import gpu_arbiter.gateway.files.ensure as ensure

    monkeypatch.setattr(ensure, "estimate_vram", estimate)
    world.model.vram_mb = 0
    waiting = world.start()
    await until(world, lambda: "0.3 of" in world.model.waiting_for())
    said = world.model.waiting_for()
    assert said.startswith("copying chat's file to box-4: 0.3 of 1.0 MiB"), said
    assert "(from gw-a)" in said
    assert world.leases.calls == []  # no lease asked for while it copies
    assert not (tmp_path / "m.gguf").exists()
    await until(world, lambda: bool(world.leases.calls))
    assert (tmp_path / "m.gguf").read_bytes() == DATA
    assert [verb for verb, _ in world.leases.calls][:1] == ["create"]
    [request] = world.leases.requests.values()
    assert request["vram_mb"] == 2048  # estimated from the file now here
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError, Refused):
        await waiting
    await world.close()


async def test_a_corrupt_copy_fails_the_start_saying_why(tmp_path: Path) -> None:
    world, _ = world_of(tmp_path, fetcher_data=DATA[::-1])
    waiting = world.start()
    await until(world, waiting.done)
    with pytest.raises(Refused) as raised:
        await waiting
    assert raised.value.status == 502
    assert "model file not in place" in raised.value.reason
    assert "not the model's sha256" in raised.value.reason
    assert list(tmp_path.glob("m.gguf*")) == []
    assert world.leases.calls == []
    await world.close()


async def test_a_copy_given_up_is_resumed_by_the_next_start(tmp_path: Path) -> None:
    world, fetcher = world_of(tmp_path)
    first = world.start()
    part = tmp_path / "m.gguf.part"
    await until(world, lambda: part.exists() and part.stat().st_size >= 3 * 65536)
    first.cancel()  # its caller went away: the replica is cancelled, the copy with it
    with contextlib.suppress(asyncio.CancelledError):
        await first
    await until(world, lambda: not world.model.replicas)
    kept = part.stat().st_size
    assert 3 * 65536 <= kept < len(DATA) and kept % 65536 == 0
    second = world.start()
    await until(world, lambda: (tmp_path / "m.gguf").exists())
    assert fetcher.opened == [0, kept]
    assert (tmp_path / "m.gguf").read_bytes() == DATA
    second.cancel()
    with contextlib.suppress(asyncio.CancelledError, Refused):
        await second
    await world.close()


async def until(world: World, done: Callable[[], bool]) -> None:
    """Moves virtual time on, giving the store's threads (fsync, hashing) real time too."""
    for _ in range(400):
        if done():
            return
        await asyncio.sleep(0.005)
        await world.clock.advance(1.0)
    raise AssertionError("never")


async def test_a_copy_waits_for_the_clusters_first_view(tmp_path: Path) -> None:
    world, fetcher = world_of(tmp_path)
    holders = FakeHolders()
    holders.seen.clear()  # the gateway just started: no view yet
    assert world.model.files is not None
    world.model.files.cluster = lambda: holders  # type: ignore[attr-defined]
    waiting = world.start()
    await world.clock.advance(2.0)
    assert fetcher.opened == []  # which peer holds it is not known yet
    holders.seen.set()
    await until(world, lambda: fetcher.opened == [0])
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError, Refused):
        await waiting
    await world.close()
