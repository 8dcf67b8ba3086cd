"""The agent's local endpoint: how ``gpu-arbiter run`` tells the agent which process
holds which lease.

The agent listens on a unix socket, ``<runtime dir>/agent-<worker>.sock`` (mode
0600, in a 0700 directory). One request per connection, one JSON line each way::

    {"op": "env"}                                   -> {"ok": true, "env": {...},
                                                        "simulated": bool}
    {"op": "attach", "lease": ID, "pid": P, "pgid": G} -> {"ok": true}
    {"op": "attach", ..., "holder_stops_s": S}      -> the same; the holder stops it
    {"op": "usage", "lease": ID}                    -> {"ok": true, "used_mb": N | null}
    {"op": "usage", "pgid": G}                      -> the same for a process group
    {"op": "stop", "lease": ID, "grace_s": S}       -> {"ok": true} | {"ok": false, ...}
    {"op": "account", "pgid": G, "shares": {ID: MiB, ...}} -> {"ok": true}

``env`` is what the child must inherit (the fake probe's usage directory), and
whether this agent's GPUs are simulated;
``attach`` puts the process group under the agent's supervision for that lease
(idempotent; ``run`` repeats it with every renewal, so a restarted agent learns
its processes again). With ``holder_stops_s``, the holder says that on a
revocation it stops the process itself, within S seconds (the gateway lets the
requests in flight finish first, then asks for the stop with ``stop``): the agent
then sends its own SIGTERM only if the process still runs, and no stop is under
way, ``min(S, --grace-s)`` seconds after its heartbeat saw the revocation, and
SIGKILL after its grace as always. The lease is released once the agent has seen
the process group exit, either way (I4). Each attach says it again (one without
it is ``run``'s behaviour: SIGTERM as soon as the revocation is seen).
``usage`` is the lease's GPU memory as the probe sees it;
``stop`` asks the agent to stop a supervised lease's process (SIGTERM, SIGKILL after
``grace_s``) unless it already is: ``run`` leaves the signals to the agent, so that the
process gets one SIGTERM however many supervisors see its lease revoked.
``account`` says that process group G's GPU memory is the memory of those leases, in
those proportions (one ``ollama serve``, a lease per loaded model): the heartbeats split
the group's memory among them (I2 counts it once), and the agent does not supervise,
signal or persist the group. The holder repeats it every few seconds; one not repeated
within 30 s, or whose group leader is gone, is dropped, and ``"shares": {}`` drops it at
once. At most 256 leases (in all accounts), each MiB an integer 0 to 2**40
(:mod:`.accounts`).

Only the agent's own user (or root) can reach the socket, and the agent checks the
caller's credentials (``SO_PEERCRED``): a process may only attach processes of its
own user, so nobody can make the agent signal someone else's processes (nor account
for them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

__all__ = [
    "RUNTIME_DIR_ENV",
    "LocalEndpoint",
    "agent_request",
    "attach",
    "local_workers",
    "runtime_dir",
    "socket_path",
]

RUNTIME_DIR_ENV = "GPU_ARBITER_RUNTIME_DIR"
MAX_LINE = 32768  # an account of 256 leases fits
Json = dict[str, Any]
Handler = Callable[[Json, int], Awaitable[Json]]


def runtime_dir() -> Path:
    """``$GPU_ARBITER_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/gpu-arbiter``, else
    ``/tmp/gpu-arbiter-<uid>``."""
    explicit = os.environ.get(RUNTIME_DIR_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "gpu-arbiter"
    return Path(f"/tmp/gpu-arbiter-{os.getuid()}")


def socket_path(worker: str) -> Path:
    return runtime_dir() / f"agent-{worker}.sock"


def _peer_uid(writer: asyncio.StreamWriter) -> int | None:
    sock = writer.get_extra_info("socket")
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def process_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


class LocalEndpoint:
    """The unix socket server; ``handler(request, peer_uid)`` answers each request."""

    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = path
        self._handler = handler
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if await _answers(self.path):
            raise RuntimeError(f"another agent already listens on {self.path}")
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by an agent that was killed
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        finally:
            os.umask(old)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            try:
                request = json.loads(line[:MAX_LINE])
                if not isinstance(request, dict):
                    raise ValueError("not an object")
            except ValueError as error:
                answer: Json = {"ok": False, "error": f"bad request: {error}"}
            else:
                uid = _peer_uid(writer)
                answer = await self._handler(request, os.getuid() if uid is None else uid)
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (TimeoutError, ConnectionError, ValueError):  # ValueError: a line too long
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def local_workers() -> list[str]:
    """The workers whose agents run on this host (their sockets answer)."""
    found = []
    for path in sorted(runtime_dir().glob("agent-*.sock")):
        name = path.name.removeprefix("agent-").removesuffix(".sock")
        answer = await agent_request(name, {"op": "env"}, timeout_s=2.0)
        if answer is not None and answer.get("ok"):
            found.append(name)
    return found


async def _answers(path: Path) -> bool:
    try:
        _reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 2.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def agent_request(worker: str, request: Json, timeout_s: float = 5.0) -> Json | None:
    """Asks the local agent of ``worker``; None when no agent of that name runs here."""
    path = socket_path(worker)
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: 3.11's may swallow a cancel
            reader, writer = await asyncio.open_unix_connection(str(path))
    except (OSError, TimeoutError):
        return None
    try:
        writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            line = await reader.readline()
        answer = json.loads(line) if line else None
        return answer if isinstance(answer, dict) else None
    except (OSError, TimeoutError, ValueError):
        return None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def attach(
    worker: str, lease_id: str, pid: int, *, holder_stops_s: float | None = None
) -> bool:
    """Puts process group ``pid`` under the supervision of ``worker``'s local agent for
    the lease; with ``holder_stops_s`` the caller stops it itself on a revocation (see
    the module's docstring). False when no agent of that name runs here, or it refused."""
    body: Json = {"op": "attach", "lease": lease_id, "pid": pid, "pgid": pid}
    if holder_stops_s is not None:
        body["holder_stops_s"] = holder_stops_s
    answer = await agent_request(worker, body)
    return bool(answer and answer.get("ok"))
