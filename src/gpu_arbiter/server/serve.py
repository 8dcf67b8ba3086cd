"""Runs the controller: state directory, store, admin token, uvicorn.

Start-up order, so that a controller that cannot run changes nothing: the state
directory's lock (one controller per directory), then the listening socket, then the
store. Either refusal is one line and an exit code (:class:`ServeRefused`)::

    73  another process holds the state directory, or it cannot be written
        (EXIT_STATE_DIR_IN_USE)
    98  the address cannot be listened on: in use, or not this machine's (EXIT_CANNOT_LISTEN)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import uvicorn

from ..controller import Controller, Limits
from ..logs import say, setup_logging
from ..store import MemoryStore, PostgresStore, SqliteStore, Store, is_postgres_url
from .app import create_app
from .auth import Authenticator, ensure_admin_token
from .config import ServeConfig, is_loopback, parse_simulate
from .connections import HeadLimits, bounded_http, raise_open_files_limit
from .guards import allowed_hosts
from .ha import Coordinator, LeaderStore
from .history import History
from .limits import ClientLimits

__all__ = [
    "EXIT_CANNOT_LISTEN",
    "EXIT_STATE_DIR_IN_USE",
    "Companion",
    "ServeRefused",
    "lock_state_dir",
    "open_store",
    "serve",
]

log = logging.getLogger(__name__)

EXIT_STATE_DIR_IN_USE = 73
EXIT_CANNOT_LISTEN = 98

KEEP_ALIVE_S = 65
"""Idle keep-alive: longer than clients keep idle connections (httpx: 5 s; load balancers:
60 s), so that the server never closes a connection a client is about to reuse."""

Companion = Callable[[str, str | None, asyncio.Event], Coroutine[Any, Any, None]]
"""Runs beside the server once it listens: ``companion(url, admin_token, stop)``."""


def open_store(config: ServeConfig) -> Store:
    """The store ``config.store`` names (``sqlite``: ``state.db`` in the state directory).
    A PostgreSQL store is opened as a standby: it reads, but commits only once it leads;
    closing it ends its term, so that a standby takes over at once."""
    if config.store == "memory":
        return MemoryStore()
    if is_postgres_url(config.store):
        return PostgresStore(config.store, step_down_on_close=True)
    state_dir = config.state_path
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return SqliteStore(
        state_dir / "state.db", synchronous="FULL" if config.sync == "full" else "NORMAL"
    )


class ServeRefused(Exception):
    """``serve`` cannot start, and changed nothing: one line for the operator, and the
    process's exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def lock_state_dir(state_dir: Path) -> int:
    """Takes ``controller.lock`` in ``state_dir`` for the life of the process (the OS lets
    it go when the process ends, however it ends) and writes the pid in it; returns its
    descriptor. :class:`ServeRefused` if another process holds it."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(state_dir / "controller.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        why = f"cannot use {state_dir}: {error.strerror or error}"
        raise ServeRefused(why, EXIT_STATE_DIR_IN_USE) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ServeRefused(
            f"a controller (pid {holder}) already uses {state_dir}", EXIT_STATE_DIR_IN_USE
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (uvicorn listens on it), or :class:`ServeRefused`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio: NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if error.errno == errno.EADDRINUSE:
            why = f"{where} is already in use (another gpu-arbiter? `--port` chooses another)"
        else:
            why = f"cannot listen on {where}: {error.strerror or error}"
        raise ServeRefused(why, EXIT_CANNOT_LISTEN) from None
    return sock


def serve(config: ServeConfig, companion: Companion | None = None) -> None:
    """Blocks until the server stops (SIGINT/SIGTERM). ``companion`` (``serve --local``'s
    agent) is started once the server listens, and stopped before it returns. Raises
    :class:`ServeRefused` (having changed nothing) if it cannot start."""
    if not config.auth and not is_loopback(config.host):
        raise SystemExit(
            f"refusing to listen on {config.host} without authentication; "
            "use a loopback address or enable auth"
        )
    with contextlib.ExitStack() as held:
        if config.store == "sqlite":  # a shared database has several controllers by design
            held.callback(os.close, lock_state_dir(config.state_path))
        sock = held.enter_context(listen(config.host, config.port))
        _serve_on(sock, config, companion)


def _serve_on(sock: socket.socket, config: ServeConfig, companion: Companion | None) -> None:
    redactor = setup_logging(config.log_format, config.log_level)
    if is_postgres_url(config.store):
        with contextlib.suppress(ValueError):
            redactor.hide(urlsplit(config.store).password)  # the database's, if in the URL
    store = open_store(config)
    admin_token = None
    token_file = None
    if config.auth:
        state_dir = config.state_path
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path, created = ensure_admin_token(state_dir, store)
        token_file = path
        admin_token = path.read_text(encoding="utf-8").strip()
        redactor.hide(admin_token)
        say(f"admin token {'created in' if created else 'in'} {path}")
    controller = Controller(
        store,
        policy=config.policy,
        limits=Limits(
            max_pending=config.max_pending,
            max_pending_per_token=config.max_pending_per_token,
            max_pending_per_holder=config.max_pending_per_holder,
        ),
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        simulated=parse_simulate(config.simulate) if config.simulate else (),
    )
    app = create_app(
        controller,
        Authenticator(store, enabled=config.auth),
        max_body_bytes=config.max_body_bytes,
        client_limits=ClientLimits(
            max_streams=config.max_streams,
            max_streams_per_token=config.max_streams_per_token,
            max_long_polls=config.max_long_polls,
            max_long_polls_per_token=config.max_long_polls_per_token,
        ),
        standby=isinstance(store, PostgresStore),  # shared: a leader is elected beside
        allowed_hosts=allowed_hosts(sock.getsockname()[0], config),
        retention_s=config.retention_s,
        history=History(sample_s=config.history_sample_s),
        admin_token_file=token_file,
    )
    server = _Server(app.state.event_feed.close, _uvicorn_config(app, config))
    companions = [] if companion is None else [companion]
    if isinstance(store, PostgresStore):
        companions.insert(0, _coordinate(controller, store, config))
    if not companions:
        server.run(sockets=[sock])
    else:
        asyncio.run(_serve_with(server, [sock], companions, admin_token))


class _Server(uvicorn.Server):
    """uvicorn on the socket bound before the store was opened: it says where it listens
    once it does, as uvicorn does when it binds the socket itself; when it stops, it ends
    the event streams first, so that their clients see the end at once rather than the
    cut of the graceful timeout."""

    def __init__(self, end_streams: Callable[[], None], config: uvicorn.Config) -> None:
        super().__init__(config)
        self.end_streams = end_streams

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            where = f"[{host}]" if ":" in host else host
            logging.getLogger("uvicorn.error").info(
                "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", where, port
            )

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.end_streams()
        await super().shutdown(sockets)


def _uvicorn_config(app: Any, config: ServeConfig) -> uvicorn.Config:
    """uvicorn with the connection limits of ``config`` (see ``connections.py``)."""
    max_connections = config.max_connections
    files = raise_open_files_limit()
    if max_connections > files:
        log.warning("at most %d connections: the limit of open files allows no more", files)
        max_connections = files
    limits = HeadLimits(config.max_header_bytes, config.max_headers, config.header_timeout_s)
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=bounded_http(limits),
        limit_concurrency=max_connections,
        log_level=config.log_level.lower(),
        log_config=None,  # uvicorn's loggers go to the one handler of setup_logging
        access_log=False,
        timeout_graceful_shutdown=3,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def _coordinate(controller: Controller, store: LeaderStore, config: ServeConfig) -> Companion:
    """Leader election beside the server (a shared store: several controllers)."""

    async def coordinate(url: str, token: str | None, stop: asyncio.Event) -> None:
        advertised = (config.advertise_url or url).rstrip("/")
        coordinator = Coordinator(controller, store, url=advertised, ttl_s=config.leader_ttl_s)
        await coordinator.run(stop)

    return coordinate


async def _serve_with(
    server: uvicorn.Server,
    sockets: list[socket.socket],
    companions: list[Companion],
    token: str | None,
) -> None:
    serving = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started:
        if serving.done():
            await serving
            return
        await asyncio.sleep(0.05)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = socket.getfqdn()
    stop = asyncio.Event()
    url = f"http://{host}:{port}"
    beside: asyncio.Future[list[None]] = asyncio.ensure_future(
        asyncio.gather(*(companion(url, token, stop) for companion in companions))
    )
    try:
        running: list[asyncio.Future[Any]] = [serving, beside]
        await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(beside), 5.0)
        if not serving.done():
            server.should_exit = True
        await serving
        if beside.done() and not beside.cancelled():
            beside.result()  # an agent that failed says why
