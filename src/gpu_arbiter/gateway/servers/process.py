"""Model server processes: started in their own group, their output in a bounded log,
stopped when the gateway stops or dies, found again by the next gateway.

The real :class:`~.interfaces.Launcher` and :class:`~.interfaces.ServerProcess`.
What each guarantees, and how:

- **Nothing outlives its supervisor.** Each server leads a new process group (the lease
  covers the group). The gateway's watchdog (``watchdog.py``, one process per gateway,
  started with the first server) is told each group; when the gateway dies, however it
  dies, the watchdog sends the groups SIGTERM, SIGKILL after their grace. A server does
  not inherit the watchdog's pipe (it is close-on-exec, and ``close_fds``).
- **A restart finds what is left.** ``STATE/gateway/servers.json`` (written atomically on
  each start and end: model, lease, pid, start time, grace, boot) lists the groups that
  run. :meth:`ProcessLauncher.stop_leftovers` at the next start waits for the previous
  watchdog to finish, stops any group of the list still alive (same boot, same start
  time: a reused pid is never signalled) and returns their leases, to be released once
  their groups are gone (I4). No fsync: a process's death loses nothing written, and a
  reboot leaves no process to stop.
- **One gateway per state directory**: a ``flock`` on ``STATE/gateway/gateway.lock``
  (:class:`GatewayRefused`, exit 73, otherwise).
- **Bounded logs.** A server's stdout and stderr go through a pipe read by a thread of
  its own (not the event loop, which may be busy: a chatty server never waits on a
  full pipe for the gateway) into ``interfaces.log_path(STATE, model)``. The thread
  reads what came at most every ``LOG_BATCH_S`` (0.1 s; at once after a read of a
  quarter of the pipe or more, so the pipe never fills meanwhile, and once the server
  has exited), in blocks of up to the pipe's size (and the log's cap): llama.cpp's
  server writes about ten lines per request, and a thread woken for each took the GIL
  from the relay about as often (11 % of the gateway's CPU at 16 callers; 1 % now).
  Whole lines, rotated to ``.1`` when the next write would pass ``LOG_MAX_BYTES`` (so at
  most twice that on disk), the last lines kept in memory for :meth:`LaunchedServer.tail`.
- **Ports.** :meth:`ProcessLauncher.port` never hands out a port it reserved for a
  server until :meth:`~ProcessLauncher.unreserve`. The port is free when handed out, but
  another program may take it before the server binds it: a server that fails to bind
  exits, and the replica retries it on another port.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from . import watchdog
from .interfaces import log_path
from .watchdog import boot_id, group_alive, same_group, signal_group, start_time, stop_groups

__all__ = [
    "EXIT_STATE_DIR_IN_USE",
    "LOG_MAX_BYTES",
    "GatewayRefused",
    "LaunchedServer",
    "ModelLog",
    "ProcessLauncher",
    "lock_state_dir",
]

log = logging.getLogger("gpu_arbiter.gateway")

EXIT_STATE_DIR_IN_USE = 73
LOG_MAX_BYTES = 10 * 1024 * 1024
TAIL_LINES = 500  # kept in memory per server
LINE_MAX = 4096  # a longer line is kept cut in memory (whole in the file)
PARTIAL_MAX = 64 * 1024  # a line without its end yet, written out beyond this
PIPE_BYTES = 1024 * 1024  # the pipe's buffer, where the system allows it
LOG_BATCH_S = 0.1  # the log's reader waits this long between reads that do not fill it
POLL_S = 0.05
LEFTOVER_MARGIN_S = 5.0  # beyond the largest grace, for the previous watchdog to finish
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)


class GatewayRefused(Exception):
    """The gateway cannot start, and changed nothing: one line and its exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_STATE_DIR_IN_USE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def gateway_dir(state_dir: Path) -> Path:
    return state_dir / "gateway"


def lock_state_dir(state_dir: Path) -> int:
    """Takes ``gateway/gateway.lock`` in ``state_dir`` for the life of the process and
    writes the pid in it; its descriptor. :class:`GatewayRefused` if another holds it."""
    directory = gateway_dir(state_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(directory / "gateway.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        raise GatewayRefused(f"cannot use {state_dir}: {error.strerror or error}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise GatewayRefused(f"a gateway (pid {holder}) already uses {state_dir}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


# ---------------------------------------------------------------------- logs


class ModelLog:
    """One model's log, shared by its servers: whole lines appended, the file rotated to
    ``.1`` when the next write would pass ``max_bytes``. Written from the servers'
    reader threads; a write that fails (a full disk) is dropped, never waited on."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size
        self._failed = False

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def write(self, data: bytes) -> None:
        if len(data) > self.max_bytes:  # more than a whole file: its last whole lines
            start = data.find(b"\n", len(data) - self.max_bytes - 1) + 1
            data = data[start:] if 0 < start < len(data) else data[-self.max_bytes :]
        with self._lock:
            if self._fd < 0:
                return
            try:
                if self._size and self._size + len(data) > self.max_bytes:
                    self._rotate()
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view) :]
                self._size += len(data)
            except OSError as error:
                if not self._failed:
                    log.warning("log %s: %s (its output is dropped)", self.path, error)
                self._failed = True

    def note(self, text: str) -> None:
        """A line of the gateway's own (a start, an exit), told apart from the server's."""
        self.write(f"[gpu-arbiter {time.strftime('%Y-%m-%dT%H:%M:%S%z')}] {text}\n".encode())

    def _rotate(self) -> None:
        os.close(self._fd)
        self._fd = -1
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._fd = self._open()
        self._size = 0

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class _Output:
    """A server's stdout and stderr (one pipe), read by a thread until every process
    holding its write end has exited: what came, once per ``LOG_BATCH_S`` at most
    unless it fills a read, or :meth:`hurry` says not to wait."""

    def __init__(self, fd: int, model_log: ModelLog, name: str) -> None:
        self._fd = fd
        self._log = model_log
        self._ring: deque[bytes] = deque(maxlen=TAIL_LINES)
        self._partial = b""
        self._lock = threading.Lock()
        self._hurry = threading.Event()
        try:
            pipe_bytes: int = fcntl.fcntl(fd, F_GETPIPE_SZ)
        except OSError:
            pipe_bytes = 65536  # the least a pipe holds on Linux
        self._read_bytes = min(pipe_bytes, model_log.max_bytes)  # a read, one write at most
        self._thread = threading.Thread(target=self._read, name=f"log {name}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while chunk := os.read(self._fd, self._read_bytes):
                self._take(chunk)
                if len(chunk) < self._read_bytes // 4:  # what comes meanwhile: one read
                    self._hurry.wait(LOG_BATCH_S)
        except OSError:
            pass
        finally:
            if self._partial:
                self._take(b"\n")
            os.close(self._fd)

    def _take(self, chunk: bytes) -> None:
        data = self._partial + chunk
        whole, newline, partial = data.rpartition(b"\n")
        if len(partial) > PARTIAL_MAX:  # a line that never ends: out as it is
            whole, newline, partial = data, b"\n", b""
        if newline:
            self._log.write(whole + b"\n")
            lines = whole.split(b"\n")[-TAIL_LINES:]
            with self._lock:
                self._ring.extend(line[:LINE_MAX] for line in lines)
        self._partial = partial

    def tail(self, lines: int) -> list[str]:
        with self._lock:
            found = list(self._ring)
        if self._partial:
            found.append(self._partial[:LINE_MAX])
        return [line.decode(errors="replace") for line in found[-lines:]] if lines > 0 else []

    def hurry(self) -> None:
        """From now on, read as soon as anything comes (the server has exited)."""
        self._hurry.set()

    async def drained(self, timeout_s: float) -> None:
        """Waits (a bounded time: a process that left the group may keep the pipe open)
        until the thread has read everything."""
        self.hurry()
        await asyncio.to_thread(self._thread.join, timeout_s)


# ---------------------------------------------------------------------- servers


@dataclass(frozen=True, slots=True)
class Record:
    """A started group as ``servers.json`` keeps it."""

    model: str
    lease: str
    pid: int
    pgid: int
    start_time: int
    grace_s: float

    def watched(self) -> str:
        """The watchdog's line for it."""
        return f"+ {self.pgid} {self.start_time} {self.grace_s:g}"


class LaunchedServer:
    """A model server the launcher started (see :class:`~.interfaces.ServerProcess`)."""

    def __init__(
        self, record: Record, popen: subprocess.Popen[bytes], output: _Output, model_log: ModelLog
    ) -> None:
        self.pid = record.pid
        self.record = record
        self.returncode: int | None = None
        self._popen = popen
        self._output = output
        self._log = model_log
        self._terminated = False  # the group had its one SIGTERM
        self._ended: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def ended(self) -> bool:
        return self._ended.done()

    async def wait(self) -> int:
        """Waits until the leader exited and nothing is left of its group; its exit code."""
        code: int = await asyncio.shield(self._ended)
        return code

    def signal(self, signum: int) -> None:
        """Sends ``signum`` to the group while it is still the one started (a number
        given to another process since is never signalled)."""
        if self.ended:
            return
        sent = signal_group(self.record.pgid, self.record.start_time, signum)
        if sent and signum == signal.SIGTERM:
            self._terminated = True

    def tail(self, lines: int) -> list[str]:
        return self._output.tail(lines)

    async def stop(self, grace_s: float) -> int:
        """SIGTERM (unless it had it), SIGKILL after ``grace_s``; the exit code."""
        if not self._terminated:
            self.signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self.wait(), grace_s)
        self.signal(signal.SIGKILL)
        return await self.wait()

    async def supervise(self) -> None:
        """Its whole life: the leader's exit -> what is left of its group killed -> the
        end in the log; :meth:`wait` returns then. Cancelled (the gateway's loop ends
        without a stop), the group is not taken for ended: the watchdog still has it."""
        await _exited(self.pid)
        self._output.hurry()
        self.returncode = _reap(self._popen)
        try:
            await self._end_group()
            await self._output.drained(2.0)
            self._log.note(f"pid {self.pid} exited with code {self.returncode}")
        except Exception:  # a bug: its waiters still learn that the leader is gone
            log.exception("model %s: pid %d: after its exit", self.record.model, self.pid)
        self._ended.set_result(self.returncode)

    async def _end_group(self) -> None:
        """Kills what is left of a group whose leader exited (the group had its SIGTERM,
        from whoever stopped it, or its leader is gone and the rest cannot serve), and
        returns once it is gone."""
        pgid = self.record.pgid
        if not group_alive(pgid):
            return
        signal_group(pgid, self.record.start_time, signal.SIGKILL)
        deadline = asyncio.get_running_loop().time() + watchdog.GONE_WAIT_S
        while group_alive(pgid) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(POLL_S)


async def _exited(pid: int) -> None:
    """Returns once ``pid`` has exited (a pidfd: woken by the kernel, no polling)."""
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # exited, and reaped by another
    loop.add_reader(fd, woken.set)
    try:
        await woken.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def _reap(popen: subprocess.Popen[bytes]) -> int:
    """The exit code of a child that has exited (255 when another reaped it first)."""
    try:
        _, status = os.waitpid(popen.pid, 0)
        code = os.waitstatus_to_exitcode(status)
    except ChildProcessError:
        code = 255
    popen.returncode = code
    return code


def free_port() -> int:
    """A loopback port free now (the system's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _grow_pipe(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)


# ---------------------------------------------------------------------- launcher


class ProcessLauncher:
    """Starts model servers for one gateway on one state directory (see the module).

    ::

        launcher = ProcessLauncher(state_dir)        # the lock, or GatewayRefused
        previous = await launcher.stop_leftovers()   # lease ids to release
        server = await launcher.start(...)           # as often as needed
        await launcher.close()                       # stops what still runs
    """

    def __init__(self, state_dir: Path, *, log_max_bytes: int = LOG_MAX_BYTES) -> None:
        self.state_dir = state_dir
        self.log_max_bytes = log_max_bytes
        self._lock_fd = lock_state_dir(state_dir)
        self._dir = gateway_dir(state_dir)
        self._reserved: set[int] = set()
        self._servers: dict[int, LaunchedServer] = {}
        self._logs: dict[str, ModelLog] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._watchdog_fd = -1
        self._taken_over = False
        self._boot = boot_id()

    @property
    def watchdog_pid(self) -> int | None:
        return None if self._watchdog is None else self._watchdog.pid

    # -------------------------------------------------------------- ports

    def port(self) -> int:
        while True:
            port = free_port()
            if port not in self._reserved:
                self._reserved.add(port)
                return port

    def unreserve(self, port: int) -> None:
        self._reserved.discard(port)

    # -------------------------------------------------------------- start

    async def start(
        self,
        model: str,
        command: Sequence[str],
        env: Mapping[str, str],
        *,
        lease_id: str,
        grace_s: float,
    ) -> LaunchedServer:
        """Starts ``command`` in a new process group (see :class:`~.interfaces.Launcher`);
        ``OSError`` when it cannot be started."""
        if not self._taken_over:
            raise RuntimeError("stop_leftovers() comes before the first start")
        self._ensure_watchdog()
        model_log = self._log(model)
        read_fd, write_fd = os.pipe()
        _grow_pipe(write_fd)
        try:
            popen = subprocess.Popen(
                list(command), env=dict(env), stdin=subprocess.DEVNULL, stdout=write_fd,
                stderr=write_fd, process_group=0, close_fds=True,
            )  # fmt: skip
        except OSError:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        record = Record(model, lease_id, popen.pid, popen.pid, start_time(popen.pid) or 0, grace_s)
        self._tell(record.watched())
        model_log.note(f"pid {popen.pid} started (lease {lease_id}): {shlex.join(command)}")
        server = LaunchedServer(record, popen, _Output(read_fd, model_log, model), model_log)
        self._servers[record.pid] = server
        self._save()
        task = asyncio.ensure_future(self._supervise(server))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return server

    def _log(self, model: str) -> ModelLog:
        found = self._logs.get(model)
        if found is None:
            found = self._logs[model] = ModelLog(
                log_path(self.state_dir, model), self.log_max_bytes
            )
        return found

    async def _supervise(self, server: LaunchedServer) -> None:
        await server.supervise()
        self._servers.pop(server.pid, None)
        self._tell(f"- {server.record.pgid}")
        self._save()

    def servers(self) -> list[LaunchedServer]:
        """The servers whose group has not ended yet."""
        return list(self._servers.values())

    def kill_all(self) -> None:
        """SIGKILL to every group now (a second stop signal: no more grace)."""
        for server in self.servers():
            server.signal(signal.SIGKILL)

    async def close(self) -> None:
        """Stops what still runs (SIGTERM unless it had it, SIGKILL after its grace),
        then lets the watchdog go (it exits: nothing left to watch) and the lock."""
        await asyncio.gather(*(s.stop(s.record.grace_s) for s in self.servers()))
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._watchdog is not None:
            os.close(self._watchdog_fd)
            self._watchdog_fd = -1
            await asyncio.to_thread(self._watchdog.wait)
            self._watchdog = None
        for model_log in self._logs.values():
            model_log.close()
        if self._taken_over:  # else the previous run's list stays for the next start
            self._save()
        os.close(self._lock_fd)

    # -------------------------------------------------------------- the watchdog

    def _ensure_watchdog(self) -> None:
        """Starts the watchdog (once; again, told every group, if it died)."""
        if self._watchdog is not None and self._watchdog.poll() is None:
            return
        if self._watchdog_fd >= 0:
            os.close(self._watchdog_fd)
            self._watchdog_fd = -1
        lock_fd = os.open(self._dir / "watchdog.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("the previous gateway's watchdog still runs: this one starts anyway")
        read_fd, write_fd = os.pipe()
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-I", "-S", watchdog.__file__], stdin=read_fd,
                stdout=subprocess.DEVNULL, start_new_session=True, pass_fds=(lock_fd,),
                close_fds=True,
            )  # fmt: skip
        finally:
            os.close(read_fd)
            os.close(lock_fd)  # the watchdog holds the lock until it exits
        self._watchdog_fd = write_fd
        for server in self.servers():
            self._tell(server.record.watched())

    def _tell(self, line: str) -> None:
        if self._watchdog_fd < 0:
            return
        try:
            os.write(self._watchdog_fd, line.encode() + b"\n")
        except OSError as error:
            log.warning("the gateway's watchdog is gone (%s): a crash would leave servers", error)
            os.close(self._watchdog_fd)
            self._watchdog_fd = -1

    # -------------------------------------------------------------- state

    @property
    def _state_path(self) -> Path:
        return self._dir / "servers.json"

    def _save(self) -> None:
        found = {
            "boot_id": self._boot,
            "servers": [asdict(server.record) for server in self._servers.values()],
        }
        partial = self._state_path.with_suffix(".tmp")
        partial.write_text(json.dumps(found, indent=1) + "\n")
        os.replace(partial, self._state_path)

    def _previous(self) -> tuple[str, list[Record]]:
        try:
            found = json.loads(self._state_path.read_text())
            return str(found.get("boot_id", "")), [Record(**r) for r in found["servers"]]
        except FileNotFoundError:
            return self._boot, []
        except (OSError, ValueError, TypeError, KeyError) as error:
            log.warning(
                "%s unreadable (%s): nothing of the last run found", self._state_path, error
            )
            return self._boot, []

    async def stop_leftovers(self) -> list[str]:
        """Stops what the previous gateway on this state directory left running (once its
        watchdog is done, if it still runs) and returns the leases of all its servers, to
        be released now that their groups are gone. Comes before the first start."""
        boot, records = self._previous()
        if records:
            grace_s = max(r.grace_s for r in records)
            await asyncio.to_thread(self._wait_watchdog_lock, grace_s + LEFTOVER_MARGIN_S)
        live = [
            r
            for r in records
            if boot == self._boot and same_group(r.pgid, r.start_time) and group_alive(r.pgid)
        ]
        for record in live:
            log.warning(
                "model %s: pid %d (lease %s) left running by the previous gateway: stopping it",
                record.model, record.pid, record.lease,
            )  # fmt: skip
        await asyncio.to_thread(stop_groups, [(r.pgid, r.start_time, r.grace_s) for r in live])
        self._taken_over = True
        self._save()
        return [r.lease for r in records if r.lease]

    def _wait_watchdog_lock(self, timeout_s: float) -> None:
        """Until no watchdog holds ``watchdog.lock`` (the previous one has done its job)."""
        path = self._dir / "watchdog.lock"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return
            finally:
                os.close(fd)
            time.sleep(POLL_S)
