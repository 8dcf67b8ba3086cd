"""The file store: never a half-written file under the real name, a cut copy resumed,
corrupt bytes refused, no headroom refused before the first byte, the budget kept by
removing the least recently used files nobody uses."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpu_arbiter.gateway.files import store as store_module
from gpu_arbiter.gateway.files.fetch import Download, FetchError, Source
from gpu_arbiter.gateway.files.spec import ModelFile
from gpu_arbiter.gateway.files.store import (
    CorruptCopy,
    FileStore,
    NoRoom,
    NoSource,
    Progress,
    format_progress,
)

from ..fakes import FakeClock

DATA = bytes(range(256)) * 40  # 10 KiB
PEER = Source("http://gw-a/files/m.gguf", peer="gw-a")
URL = Source("https://example.com/m.gguf")
LOTS = 1 << 40


def file_of(data: bytes, name: str = "m.gguf") -> ModelFile:
    return ModelFile(name, len(data), hashlib.sha256(data).hexdigest())


@dataclass
class FakeFetcher:
    """Serves ``data`` per source; ``cut_after``: the stream stops after that many bytes
    (once); ``ranges``: whether it honours a range; ``opened``: the starts asked for."""

    data: dict[str, bytes]
    clock: FakeClock
    cut_after: int | None = None
    ranges: bool = True
    chunk: int = 1000
    opened: list[tuple[str, int]] = field(default_factory=list)
    seen_part: list[bool] = field(default_factory=list)
    root: Path | None = None

    @contextlib.asynccontextmanager
    async def open(self, source: Source, start: int) -> AsyncIterator[Download]:
        self.opened.append((source.label, start))
        if source.url not in self.data:
            raise FetchError("answered 404 Not Found")
        begin = start if self.ranges else 0
        yield Download(begin, self._chunks(self.data[source.url], begin))

    async def _chunks(self, data: bytes, start: int) -> AsyncIterator[bytes]:
        sent = 0
        for at in range(start, len(data), self.chunk):
            if self.cut_after is not None and sent >= self.cut_after:
                self.cut_after = None
                raise FetchError("cut: the peer closed the stream")
            piece = data[at : at + self.chunk]
            self.clock.time += 0.001  # a MB/s: 1000 bytes a millisecond
            if self.root is not None:
                self.seen_part.append((self.root / "m.gguf").exists())
            sent += len(piece)
            yield piece


def store_of(tmp_path: Path, fetcher: FakeFetcher, **kwargs: object) -> FileStore:
    return FileStore(tmp_path, fetcher, fetcher.clock, **kwargs)  # type: ignore[arg-type]


def fetcher_of(tmp_path: Path, data: bytes = DATA, **kwargs: object) -> FakeFetcher:
    found = FakeFetcher({PEER.url: data, URL.url: data}, FakeClock(), **kwargs)  # type: ignore[arg-type]
    found.root = tmp_path
    return found


async def test_copied_under_a_part_name_then_renamed(tmp_path: Path) -> None:
    fetcher = fetcher_of(tmp_path)
    store = store_of(tmp_path, fetcher)
    seen: list[Progress] = []
    path = await store.ensure(file_of(DATA), [PEER], seen.append)
    assert path == tmp_path / "m.gguf" and path.read_bytes() == DATA
    assert not any(fetcher.seen_part)  # never under the real name while it was written
    assert not (tmp_path / "m.gguf.part").exists()
    assert seen[-1].done == len(DATA) and seen[-1].source == "gw-a"
    assert store.held() == [file_of(DATA)]


async def test_a_second_ensure_copies_nothing(tmp_path: Path) -> None:
    fetcher = fetcher_of(tmp_path)
    store = store_of(tmp_path, fetcher)
    await store.ensure(file_of(DATA), [PEER], lambda p: None)
    await store.ensure(file_of(DATA), [PEER], lambda p: None)
    assert fetcher.opened == [("gw-a", 0)]
    again = store_of(tmp_path, fetcher)  # a restart: remembered, not hashed again
    assert await again.verified(file_of(DATA))


async def test_a_cut_copy_is_resumed_from_its_part(tmp_path: Path) -> None:
    fetcher = fetcher_of(tmp_path, cut_after=4000)
    store = store_of(tmp_path, fetcher)
    with pytest.raises(NoSource) as raised:
        await store.ensure(file_of(DATA), [PEER], lambda p: None)
    assert "cut after 4000" in raised.value.reason
    assert (tmp_path / "m.gguf.part").stat().st_size == 4000
    assert not (tmp_path / "m.gguf").exists()
    await store_of(tmp_path, fetcher).ensure(file_of(DATA), [PEER], lambda p: None)
    assert fetcher.opened == [("gw-a", 0), ("gw-a", 4000)]
    assert (tmp_path / "m.gguf").read_bytes() == DATA


async def test_flushed_to_disk_as_it_comes_then_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "SYNC_BYTES", 2500)
    flushed: list[int] = []
    real = store_module._datasync
    monkeypatch.setattr(store_module, "_datasync", lambda out: (flushed.append(out.tell()),
                                                                real(out)))  # fmt: skip
    fetcher = fetcher_of(tmp_path, cut_after=6000)
    with pytest.raises(NoSource):
        await store_of(tmp_path, fetcher).ensure(file_of(DATA), [PEER], lambda p: None)
    assert flushed and (tmp_path / "m.gguf.part").stat().st_size == 6000
    flushed.clear()
    path = await store_of(tmp_path, fetcher).ensure(file_of(DATA), [PEER], lambda p: None)
    assert path.read_bytes() == DATA and flushed  # resumed, flushed on the way again
    assert not (tmp_path / "m.gguf.part").exists()


async def test_a_failed_write_stops_the_copy_with_its_part_a_prefix_of_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk full at the third chunk, while the next ones are already handed to the
    writing thread: the error comes out, and the ``.part`` holds the first two chunks
    only (a later copy resumes from them), not the ones after the gap."""
    writes = 0
    real = store_module._Writer._write

    class Full:
        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

    def failing(writer: Any, chunk: bytes) -> None:
        nonlocal writes
        writes += 1
        out = writer.out
        if writes == 3:
            writer.out = Full()
        try:
            real(writer, chunk)
        finally:
            writer.out = out

    monkeypatch.setattr(store_module._Writer, "_write", failing)
    store = store_of(tmp_path, fetcher_of(tmp_path))
    with pytest.raises(OSError, match="No space left"):
        await store.ensure(file_of(DATA), [PEER], lambda progress: None)
    assert (tmp_path / "m.gguf.part").read_bytes() == DATA[:2000]
    assert not (tmp_path / "m.gguf").exists()
    assert writes > 3  # the chunks after it were handed over too


async def test_a_copy_cancelled_half_way_leaves_a_prefix_and_is_resumed(tmp_path: Path) -> None:
    """Cancelled while chunks are handed to the threads: each handed chunk is written all
    the same (a ``.part`` with a gap would resume into a corrupt file)."""
    store = store_of(tmp_path, fetcher_of(tmp_path))
    copy: asyncio.Task[Path] | None = None

    def cancel_at_half(progress: Progress) -> None:
        if progress.done >= len(DATA) // 2 and copy is not None:
            copy.cancel()

    copy = asyncio.ensure_future(store.ensure(file_of(DATA), [PEER], cancel_at_half))
    with pytest.raises(asyncio.CancelledError):
        await copy
    part = (tmp_path / "m.gguf.part").read_bytes()
    assert 0 < len(part) < len(DATA) and DATA.startswith(part)
    path = await store.ensure(file_of(DATA), [PEER], lambda progress: None)
    assert path.read_bytes() == DATA


async def test_a_cut_copy_goes_on_from_the_next_source(tmp_path: Path) -> None:
    fetcher = fetcher_of(tmp_path, cut_after=3000)
    store = store_of(tmp_path, fetcher)
    await store.ensure(file_of(DATA), [PEER, URL], lambda p: None)
    assert fetcher.opened == [("gw-a", 0), ("example.com", 3000)]
    assert (tmp_path / "m.gguf").read_bytes() == DATA


async def test_a_source_that_ignores_the_range_starts_over(tmp_path: Path) -> None:
    (tmp_path / "m.gguf.part").write_bytes(b"garbage!" * 100)
    fetcher = fetcher_of(tmp_path, ranges=False)
    await store_of(tmp_path, fetcher).ensure(file_of(DATA), [PEER], lambda p: None)
    assert (tmp_path / "m.gguf").read_bytes() == DATA


async def test_resumed_bytes_are_hashed_again(tmp_path: Path) -> None:
    """A .part whose first bytes are wrong makes a copy whose hash is wrong: refused."""
    (tmp_path / "m.gguf.part").write_bytes(b"X" * 2000)
    fetcher = fetcher_of(tmp_path)
    with pytest.raises(CorruptCopy) as raised:
        await store_of(tmp_path, fetcher).ensure(file_of(DATA), [PEER], lambda p: None)
    assert "hash to" in raised.value.reason and "gw-a" in raised.value.reason
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "m.gguf.part").exists()


async def test_a_resumed_part_is_hashed_while_the_rest_comes_up_to_where_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The .part's bytes are hashed beside the new ones being written after them: a hash
    that reads the .part only once new bytes were written still takes its first 4,000
    bytes only (the new ones are hashed as they come)."""
    data = DATA * 4  # in chunks beyond the file object's buffer: each goes to the file
    (tmp_path / "m.gguf.part").write_bytes(data[:4000])
    real = store_module._hash_into
    sizes: list[int] = []

    def late(digest: Any, path: Path, size: int = -1) -> None:
        for _ in range(500):  # until the writing thread put a chunk after the old bytes
            if path.stat().st_size > 4000:
                break
            time.sleep(0.01)
        sizes.append(path.stat().st_size)
        real(digest, path, size)

    monkeypatch.setattr(store_module, "_hash_into", late)
    fetcher = fetcher_of(tmp_path, data, chunk=9000)
    path = await store_of(tmp_path, fetcher).ensure(file_of(data), [PEER], lambda p: None)
    assert path.read_bytes() == data and fetcher.opened == [("gw-a", 4000)]
    assert sizes[0] > 4000  # it did read the .part while it grew


async def test_corrupt_bytes_are_refused_and_deleted(tmp_path: Path) -> None:
    bad = DATA[:-1] + b"\x00"
    fetcher = fetcher_of(tmp_path, data=bad)
    store = store_of(tmp_path, fetcher)
    with pytest.raises(CorruptCopy) as raised:
        await store.ensure(file_of(DATA), [PEER], lambda p: None)
    assert "not the model's sha256" in raised.value.reason
    assert list(tmp_path.iterdir()) == []  # nothing under the real name, no .part
    assert store.held() == []


async def test_a_corrupt_peer_then_a_good_url(tmp_path: Path) -> None:
    fetcher = FakeFetcher({PEER.url: DATA[::-1], URL.url: DATA}, FakeClock())
    await store_of(tmp_path, fetcher).ensure(file_of(DATA), [PEER, URL], lambda p: None)
    assert (tmp_path / "m.gguf").read_bytes() == DATA


async def test_too_many_bytes_are_refused(tmp_path: Path) -> None:
    fetcher = fetcher_of(tmp_path, data=DATA + b"more")
    with pytest.raises(CorruptCopy):
        await store_of(tmp_path, fetcher).ensure(file_of(DATA), [PEER], lambda p: None)
    assert list(tmp_path.iterdir()) == []


async def test_no_headroom_is_refused_before_the_first_byte(tmp_path: Path) -> None:
    fetcher = fetcher_of(tmp_path)
    store = store_of(tmp_path, fetcher, free=lambda path: 1000)
    with pytest.raises(NoRoom) as raised:
        await store.ensure(file_of(DATA), [PEER], lambda p: None)
    assert "free on" in raised.value.reason
    assert fetcher.opened == [] and list(tmp_path.iterdir()) == []


async def test_no_source(tmp_path: Path) -> None:
    store = store_of(tmp_path, fetcher_of(tmp_path))
    with pytest.raises(NoSource) as raised:
        await store.ensure(file_of(DATA), [], lambda p: None)
    assert "no url" in raised.value.reason


async def test_the_budget_removes_the_least_recently_used_unused_file(tmp_path: Path) -> None:
    one, two, three = DATA[:4000], DATA[:4001], DATA[:4002]
    data = {f"http://gw-a/files/{n}": d for n, d in (("1", one), ("2", two), ("3", three))}
    fetcher = FakeFetcher(data, FakeClock())
    store = store_of(tmp_path, fetcher, budget=9000, free=lambda path: LOTS)

    async def copy(name: str, body: bytes) -> None:
        source = Source(f"http://gw-a/files/{name}", peer="gw-a")
        await store.ensure(file_of(body, name), [source], lambda p: None)
        fetcher.clock.time += 1

    await copy("1", one)
    await copy("2", two)
    with store.using("1"):  # used since: "2" is the least recently used now
        fetcher.clock.time += 1
        await copy("3", three)
        assert sorted(f.name for f in store.held()) == ["1", "3"]
        with store.using("3"), pytest.raises(NoRoom) as raised:  # both in use: no room
            await copy("2", two)
        assert "in use: 1, 3" in raised.value.reason
        assert sorted(f.name for f in store.held()) == ["1", "3"]  # nothing removed


async def test_a_file_put_by_hand_is_verified_once(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(DATA)
    fetcher = fetcher_of(tmp_path)
    store = store_of(tmp_path, fetcher)
    assert await store.verified(file_of(DATA))
    await store.ensure(file_of(DATA), [PEER], lambda p: None)
    assert fetcher.opened == []


async def test_a_wrong_file_by_hand_is_replaced_by_a_copy(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(DATA[::-1])
    store = store_of(tmp_path, fetcher_of(tmp_path))
    assert not await store.verified(file_of(DATA))
    await store.ensure(file_of(DATA), [PEER], lambda p: None)
    assert (tmp_path / "m.gguf").read_bytes() == DATA


def test_format_progress() -> None:
    progress = Progress("m", int(1.2 * (1 << 30)), int(4.1 * (1 << 30)), 80e6, "gw-a")
    assert format_progress(progress, "chat", "box-4") == (
        "copying chat's file to box-4: 1.2 of 4.1 GiB, 80 MB/s (from gw-a)"
    )
