"""A host's model files: ``models_dir``, each file under its name, and the copy that
puts one there.

A copy is written to ``NAME.part``, never under the real name: only once its size and
SHA-256 match the model's ``file`` is it flushed to disk (fsync), renamed to ``NAME``
in one step (``os.replace``) and the directory flushed too. So a reader, a model
server or a peer never sees a half-written or a corrupt file under the real name. A
``.part`` left by a copy cut half-way is resumed: the rest is asked for from its length
(an HTTP range) at once, and its bytes so far are hashed again ahead of the new ones
(the hash of a copy covers every byte of the file, whoever wrote them). A copy whose
hash does not match is deleted and refused, saying which source gave it.

Before the first byte, the copy must fit: the free space of the filesystem (less
:data:`FREE_MARGIN_BYTES`) and, with a ``disk_budget``, the budget once the least
recently used files no replica uses are removed (``evict.py``). Refused, nothing is
written and nothing removed.

A file is *held* once verified: by a copy, or, for a file put there by hand, by hashing
it once (:meth:`FileStore.verified`). What was verified is remembered beside it
(``.NAME.sha256``: size, mtime and hash), so a restart does not hash gigabytes again.
Last uses (:meth:`FileStore.using`) are kept in ``.last-used.json``: the eviction's
order survives restarts.

Exceptions (one tree)::

    FileRefused            a copy that cannot be made, saying why
     +-- NoRoom            no headroom (disk or budget), before the first byte
     +-- CorruptCopy       the bytes did not hash to the sha256 (deleted)
     +-- NoSource          every source failed (the .part kept for a resume)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import logging
import os
import shutil
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..base.clock import Clock
from .evict import Held, evictions
from .fetch import Fetcher, FetchError, Source
from .spec import ModelFile

__all__ = [
    "CorruptCopy",
    "FileRefused",
    "FileStore",
    "NoRoom",
    "NoSource",
    "Progress",
    "format_progress",
]

log = logging.getLogger("gpu_arbiter.gateway")
FREE_MARGIN_BYTES = 64 << 20
"""Kept free on the filesystem beyond a copy (logs, the state dir's own files)."""
HASH_CHUNK = 4 << 20
FLUSH_BYTES = 16 << 20
"""How much of a copy is written before the kernel is asked to start writing it out."""
IN_FLIGHT = 3
"""Chunks handed to the writing and hashing threads at most (the copy's memory)."""
SYNC_BYTES = 8 << 20
"""How much of a copy is written before its data is flushed to disk (fdatasync) while
the rest comes."""
USES_FILE = ".last-used.json"


class FileRefused(Exception):
    """A model file that cannot be put in place; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NoRoom(FileRefused):
    """No room for the copy (disk or budget); nothing was written."""


class CorruptCopy(FileRefused):
    """The copy's bytes did not match the file's sha256; the copy was deleted."""


class NoSource(FileRefused):
    """No source gave the whole file; what came is kept for a resume."""


@dataclass(frozen=True, slots=True)
class Progress:
    """A copy as it goes: bytes done of ``size``, its rate, and where from."""

    name: str
    done: int
    size: int
    rate_bps: float
    source: str


def format_progress(progress: Progress, model: str, host: str) -> str:
    """``copying chat's file to box-4: 1.2 of 4.1 GiB, 80 MB/s`` (MiB below a GiB)."""
    unit, scale = ("GiB", 1 << 30) if progress.size >= 1 << 30 else ("MiB", 1 << 20)
    done, size = progress.done / scale, progress.size / scale
    rate = progress.rate_bps / 1e6
    return (
        f"copying {model}'s file to {host}: {done:.1f} of {size:.1f} {unit}, {rate:.0f} MB/s"
        f" (from {progress.source})"
    )


Free = Callable[[Path], int]


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


class FileStore:
    """``root``: models_dir; ``budget``: disk_budget in bytes (None: none); ``fetcher``:
    where copies come from; ``clock``: for rates and last uses; ``free``: the free
    bytes of the filesystem a path is on (a fake in tests)."""

    def __init__(
        self,
        root: Path,
        fetcher: Fetcher,
        clock: Clock,
        *,
        budget: int | None = None,
        free: Free = _free_bytes,
        wall: Callable[[], float] | None = None,
    ) -> None:
        self.root = root
        self.fetcher = fetcher
        self.clock = clock
        self.budget = budget
        self.free = free
        self.wall = wall or clock.now  # last uses are stored: a clock that survives restarts
        self.in_use: Counter[str] = Counter()
        self._locks: dict[str, asyncio.Lock] = {}
        self._held: dict[str, ModelFile] = {}  # verified, by name
        root.mkdir(parents=True, exist_ok=True)
        self._uses: dict[str, float] = self._read_uses()

    # ------------------------------------------------------------------ what is here

    def path(self, name: str) -> Path:
        return self.root / name

    def held(self) -> list[ModelFile]:
        """The files verified here (a peer may copy them), by name."""
        return [self._held[n] for n in sorted(self._held) if self.path(n).is_file()]

    def holds(self, file: ModelFile) -> bool:
        found = self._held.get(file.name)
        return found is not None and found == _bare(file) and self.path(file.name).is_file()

    async def verified(self, file: ModelFile) -> bool:
        """Whether ``file`` is here with its size and sha256: remembered, else hashed
        once now (a file put there by hand). A file of another hash is left as it is
        (and not held): a copy replaces it."""
        if self.holds(file):
            return True
        path = self.path(file.name)
        try:
            stat = path.stat()
        except OSError:
            return False
        if stat.st_size != file.size:
            return False
        if self._remembered(file, stat) or await _hashed(path) == file.sha256:
            self._hold(file)
            return True
        log.warning("model file %s: its sha256 is not the model's: copied again", path)
        return False

    # ------------------------------------------------------------------ the copy

    async def ensure(
        self, file: ModelFile, sources: Sequence[Source], progress: Callable[[Progress], None]
    ) -> Path:
        """``file`` in place (copied from the first source that gives it whole, a
        ``.part`` resumed); raises :class:`FileRefused` saying why not. One copy of a
        file at a time: a second caller waits for the first, then finds it held."""
        lock = self._locks.setdefault(file.name, asyncio.Lock())
        async with lock:
            if await self.verified(file):
                return self.path(file.name)
            if not sources:
                raise NoSource(f"no peer holds {file.name} and the model's file has no url")
            return await self._copy(file, sources, progress)

    async def _copy(
        self, file: ModelFile, sources: Sequence[Source], progress: Callable[[Progress], None]
    ) -> Path:
        part = self.path(file.name + ".part")
        have = _size_of(part)
        if have > file.size:
            part.unlink()
            have = 0
        self._make_room(file, file.size - have)
        failures: list[str] = []
        corrupt = 0
        for source in sources:
            try:
                await self._from(source, file, part, progress)
            except FetchError as error:
                failures.append(f"{source.label}: {error}")
                log.info("model file %s: copy from %s stopped: %s", file.name, source.label, error)
                continue
            except CorruptCopy as error:
                corrupt += 1
                failures.append(f"{source.label}: {error.reason}")
                log.warning("model file %s: %s", file.name, error.reason)
                continue
            return self._placed(file, part)
        if corrupt == len(failures):
            raise CorruptCopy(f"{file.name} not copied: " + "; ".join(failures))
        raise NoSource(f"{file.name} not copied: " + "; ".join(failures))

    async def _from(
        self, source: Source, file: ModelFile, part: Path, progress: Callable[[Progress], None]
    ) -> None:
        """One source's bytes appended to ``part`` from its length, hashed with what it
        held; a whole file that does not hash to the sha256 is deleted (CorruptCopy)."""
        have = _size_of(part)
        digest = hashlib.sha256()
        began, got = self.clock.now(), 0
        async with self.fetcher.open(source, have) as download:
            if download.start != have:  # the source ignored the range: from 0 again
                have = 0
            with part.open("r+b" if have else "wb") as out:
                out.seek(have)
                out.truncate()
                writer = _Writer(out, digest, download.give_back)
                if have:  # what the .part holds, hashed first while the rest comes
                    writer.hash_first(part, have)
                cut = ""
                try:
                    async for chunk in download.chunks:
                        if have + len(chunk) > file.size:
                            await writer.settle()
                            part.unlink(missing_ok=True)
                            raise CorruptCopy(f"copy refused: {source.label} sent more than "
                                              f"{file.size} bytes")  # fmt: skip
                        await writer.put(chunk)
                        have, got = have + len(chunk), got + len(chunk)
                        rate = got / max(self.clock.now() - began, 1e-3)
                        progress(Progress(file.name, have, file.size, rate, source.label))
                    await writer.settle()
                except FetchError as error:
                    cut = f": {error}"
                finally:
                    await writer.settle()  # no thread writes once the file is closed
                out.flush()
                await asyncio.to_thread(os.fsync, out.fileno())
        if have < file.size:
            raise FetchError(f"cut after {have} of {file.size} bytes (kept to resume){cut}")
        if digest.hexdigest() != file.sha256:
            part.unlink(missing_ok=True)
            raise CorruptCopy(
                f"copy refused: the bytes from {source.label} hash to "
                f"{digest.hexdigest()[:16]}..., not the model's sha256 {file.sha256[:16]}..."
            )

    def _placed(self, file: ModelFile, part: Path) -> Path:
        """The verified copy under its real name (one rename), remembered and used now."""
        path = self.path(file.name)
        os.replace(part, path)
        _fsync_dir(self.root)
        self._hold(file)
        self._used(file.name)
        self._sweep()
        log.info("model file %s: in place (%d bytes, sha256 checked)", path, file.size)
        return path

    # ------------------------------------------------------------------ room and budget

    def _make_room(self, file: ModelFile, more: int) -> None:
        """Room for ``more`` bytes of ``file``, checked before its first byte: the budget
        (the least recently used unused files removed, only if that makes it fit) and the
        filesystem's free space. Refused, nothing was written or removed."""
        held = [h for h in self._holdings() if h.name != file.name]
        plan = evictions(held, self.budget, incoming=file.size)
        if not plan.fits:
            used = ", ".join(sorted(n for n, c in self.in_use.items() if c)) or "none"
            raise NoRoom(
                f"{file.name} ({file.size} bytes) does not fit disk_budget "
                f"({self.budget} bytes) even without every unused file (in use: {used})"
            )
        freed = sum(h.size for h in held if h.name in plan.remove)
        free = self.free(self.root)
        if free + freed < more + FREE_MARGIN_BYTES:
            raise NoRoom(
                f"{file.name}: {more} more bytes needed, {free} free on {self.root} "
                f"(keeping {FREE_MARGIN_BYTES} free)"
            )
        self._remove(plan.remove)

    def sweep(self) -> None:
        """Back within the budget, as far as the files nobody uses allow (at the start: a
        budget lowered since)."""
        self._sweep()

    def _sweep(self) -> None:
        """Back within the budget, as far as the files nobody uses allow."""
        self._remove(evictions(self._holdings(), self.budget).remove)

    def _holdings(self) -> list[Held]:
        return [
            Held(f.name, f.size, self._uses.get(f.name, 0.0), self.in_use[f.name] > 0)
            for f in self.held()
        ]

    def _remove(self, names: Sequence[str]) -> None:
        for name in names:
            if self.in_use[name]:
                continue  # taken meanwhile: never removed
            log.info("model file %s: removed (disk_budget, least recently used)", name)
            self.path(name).unlink(missing_ok=True)
            _sidecar(self.root, name).unlink(missing_ok=True)
            self._held.pop(name, None)
            self._uses.pop(name, None)
        if names:
            self._write_uses()

    # ------------------------------------------------------------------ uses

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[None]:
        """A replica uses ``name`` meanwhile: never removed; its last use is now."""
        self.in_use[name] += 1
        self._used(name)
        try:
            yield
        finally:
            self.in_use[name] -= 1
            if not self.in_use[name]:
                del self.in_use[name]
            self._used(name)

    def _used(self, name: str) -> None:
        self._uses[name] = self.wall()
        self._write_uses()

    def _read_uses(self) -> dict[str, float]:
        try:
            found = json.loads((self.root / USES_FILE).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(found, dict):
            return {}
        return {str(k): float(v) for k, v in found.items() if isinstance(v, int | float)}

    def _write_uses(self) -> None:
        path = self.root / USES_FILE
        temporary = path.with_suffix(".tmp")
        with contextlib.suppress(OSError):
            temporary.write_text(json.dumps(self._uses, sort_keys=True))
            os.replace(temporary, path)

    # ------------------------------------------------------------------ verified files

    def _hold(self, file: ModelFile) -> None:
        self._held[file.name] = _bare(file)
        stat = self.path(file.name).stat()
        record = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": file.sha256}
        with contextlib.suppress(OSError):
            _sidecar(self.root, file.name).write_text(json.dumps(record))

    def _remembered(self, file: ModelFile, stat: os.stat_result) -> bool:
        try:
            found: dict[str, Any] = json.loads(_sidecar(self.root, file.name).read_text())
        except (OSError, ValueError):
            return False
        want = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": file.sha256}
        return found == want


class _Writer:
    """Writes and hashes each chunk while the next ones are read, each in a thread of its
    own (both let go of the GIL), :data:`IN_FLIGHT` chunks at most: the threads find the
    next chunk waiting when they end one, instead of waiting for the event loop to hand it
    over (with one at a time, the loop of a 256 MiB copy waited 0.6-0.7 s for the threads,
    which were busy 0.2-0.3 s of it). Every :data:`FLUSH_BYTES`, the kernel is asked to
    start writing what came to disk (Linux's ``sync_file_range``, which does not wait);
    every :data:`SYNC_BYTES`, what came is flushed to disk (``fdatasync``) in a third
    thread while the copy goes on, one flush at a time, so that the fsync before the
    rename finds little left to flush. On the test machine (a VM) a disk flush costs
    about as much whenever its data was written out: 256 MiB written out early still took
    0.4 s to fsync, 0.2 s once flushed in 32 MiB steps."""

    def __init__(self, out: BinaryIO, digest: Any, give_back: Callable[[bytearray], None]) -> None:
        self.out = out
        self.digest = digest
        self.give_back = give_back
        self._writing = ThreadPoolExecutor(1, thread_name_prefix="copy-write")  # in order
        self._hashing = ThreadPoolExecutor(1, thread_name_prefix="copy-hash")
        self._pending: deque[tuple[asyncio.Future[Any], bytes | bytearray]] = deque()
        self._written = out.tell()  # by the writing thread
        self._flushed = self._written
        self._handed = self._written  # to the threads, by the event loop
        self._synced = self._written
        self._syncing: asyncio.Future[None] | None = None
        self._write_failed = False

    async def put(self, chunk: bytes | bytearray) -> None:
        while len(self._pending) >= IN_FLIGHT:
            await self._oldest()
        if self._syncing is not None and self._syncing.done():
            syncing, self._syncing = self._syncing, None
            syncing.result()  # its error, if any
        if self._syncing is None and self._handed - self._synced >= SYNC_BYTES:
            self._synced = self._handed  # a flush for about each SYNC_BYTES that came
            self._syncing = asyncio.ensure_future(asyncio.to_thread(_datasync, self.out))
        loop = asyncio.get_running_loop()
        both = asyncio.gather(
            loop.run_in_executor(self._writing, self._write, chunk),
            loop.run_in_executor(self._hashing, self.digest.update, chunk),
        )
        self._pending.append((both, chunk))
        self._handed += len(chunk)

    def hash_first(self, path: Path, size: int) -> None:
        """``path``'s first ``size`` bytes (a ``.part`` resumed, before any chunk is put)
        hashed ahead of the chunks, by the hashing thread, which takes them in order."""
        loop = asyncio.get_running_loop()
        both = loop.run_in_executor(self._hashing, _hash_into, self.digest, path, size)
        self._pending.append((both, b""))

    def _write(self, chunk: bytes | bytearray) -> None:
        if self._write_failed:
            return  # the chunks handed after a failed one are not written: the .part stays
        try:  # the copy's first bytes, to be resumed
            self.out.write(chunk)
            self._written += len(chunk)
            if self._written - self._flushed >= FLUSH_BYTES:
                self.out.flush()
                start_writeback(self.out.fileno(), self._flushed, self._written - self._flushed)
                self._flushed = self._written
        except BaseException:
            self._write_failed = True
            raise

    async def _oldest(self) -> None:
        both, chunk = self._pending[0]
        try:  # shielded: a chunk handed over is written, even when the copy is cancelled,
            await asyncio.shield(both)  # so that the .part never has a gap
        finally:
            if both.done():
                self._pending.popleft()
        if isinstance(chunk, bytearray):
            self.give_back(chunk)  # written and hashed: the source may fill it again

    async def settle(self) -> None:
        """Every chunk handed written and hashed, and any flush ended (the first error,
        if any, raised once no thread works on the file)."""
        failed: BaseException | None = None
        try:
            while self._pending:
                try:
                    await self._oldest()
                except Exception as error:
                    failed = failed or error
        finally:
            syncing, self._syncing = self._syncing, None
            if syncing is not None:
                await syncing
            self._writing.shutdown(wait=False)
            self._hashing.shutdown(wait=False)
        if failed is not None:
            raise failed


def _datasync(out: BinaryIO) -> None:
    """What was written to ``out`` so far, flushed to disk (its data; the fsync before the
    rename does the rest)."""
    getattr(os, "fdatasync", os.fsync)(out.fileno())


def _sync_file_range() -> Callable[[int, int, int], None]:
    """``sync_file_range(fd, offset, count, SYNC_FILE_RANGE_WRITE)`` where the C library
    has it (Linux), else nothing: the fsync before the rename writes it all anyway."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return lambda fd, offset, count: None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)

    def start(fd: int, offset: int, count: int) -> None:
        call(fd, offset, count, 2)  # SYNC_FILE_RANGE_WRITE: start, do not wait

    return start


start_writeback = _sync_file_range()


def _bare(file: ModelFile) -> ModelFile:
    """The file as held: its name, size and hash (where it came from is no part of it)."""
    return ModelFile(file.name, file.size, file.sha256)


def _sidecar(root: Path, name: str) -> Path:
    return root / f".{name}.sha256"


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _hash_into(digest: Any, path: Path, size: int = -1) -> None:
    """``path``'s bytes added to ``digest``; ``size``: its first bytes only (what comes
    after them may be being written)."""
    with path.open("rb") as found:
        while size and (chunk := found.read(HASH_CHUNK if size < 0 else min(size, HASH_CHUNK))):
            digest.update(chunk)
            size = max(size - len(chunk), 0) if size > 0 else size


async def _hashed(path: Path) -> str:
    """The sha256 of ``path``'s bytes (in a thread: gigabytes take seconds)."""
    digest = hashlib.sha256()
    await asyncio.to_thread(_hash_into, digest, path)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
