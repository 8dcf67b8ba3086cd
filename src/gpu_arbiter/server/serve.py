"""Runs the controller: state directory, store, admin token, uvicorn.

Start-up order, so that a controller that cannot run changes nothing: the state
directory's lock (one controller per directory), then the listening socket, then the
store. Either refusal is one line and an exit code (:class:`ServeRefused`)::

    73  another process holds the state directory, or it cannot be written
        (EXIT_STATE_DIR_IN_USE)
    98  the address cannot be listened on: in use, or not this machine's (EXIT_CANNOT_LISTEN)
     2  its TLS certificate, key or client CA cannot be loaded (EXIT_BAD_TLS)

With ``tls_cert`` and ``tls_key`` it serves HTTPS only (a plain HTTP request on its port
fails the handshake and the connection is closed, unanswered); the files are reloaded
when they change (``tls.py``). Listening beyond loopback without TLS is warned of.

Stopping: SIGINT or SIGTERM stops it gracefully and it exits 0 (uvicorn would raise the
signal again once stopped: ``_Server`` does not). With companions (``serve --local``'s
agent and gateway) the signal goes to them first: they stop while the server still
answers them (the gateway stops its model servers and releases their leases, then the
agent stops), and only then does the server stop. A second signal hurries them
(:class:`Stopping`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import gc
import logging
import os
import signal
import socket
import ssl
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import uvicorn

from ..controller import Controller, Limits
from ..core import InvalidInput
from ..logs import say, setup_logging
from ..store import MemoryStore, SqliteStore, Store, is_postgres_url
from ..tls import Reloader, handshake_bound, server_context, warn_if_plain
from ..web.connections import HeadLimits, Listener, bound, bounded_http, raise_open_files_limit
from .app import create_app
from .auth import Authenticator, ensure_admin_token
from .config import ServeConfig, is_loopback, parse_simulate
from .guards import allowed_hosts
from .ha import Coordinator, LeaderStore
from .history import History
from .limits import ClientLimits

if TYPE_CHECKING:
    from ..store import PostgresStore

__all__ = [
    "EXIT_BAD_TLS",
    "EXIT_CANNOT_LISTEN",
    "EXIT_STATE_DIR_IN_USE",
    "Companion",
    "ServeRefused",
    "Stopping",
    "lock_state_dir",
    "open_store",
    "serve",
]

log = logging.getLogger(__name__)

EXIT_STATE_DIR_IN_USE = 73
EXIT_CANNOT_LISTEN = 98
EXIT_BAD_TLS = 2

KEEP_ALIVE_S = 65
"""Idle keep-alive: longer than clients keep idle connections (httpx: 5 s; load balancers:
60 s), so that the server never closes a connection a client is about to reuse."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
HURRIED_S = 5.0
"""After a second stop signal, how long the companions have before they are cancelled."""


@dataclass(frozen=True, slots=True)
class Stopping:
    """How companions learn that ``serve`` stops: ``asked`` at the first SIGINT or
    SIGTERM (finish what is under way, within its own bounds), ``hurry`` at the next
    (no more graces: SIGKILL what still runs)."""

    asked: asyncio.Event = field(default_factory=asyncio.Event)
    hurry: asyncio.Event = field(default_factory=asyncio.Event)

    def signalled(self) -> None:
        (self.hurry if self.asked.is_set() else self.asked).set()


Companion = Callable[[str, str | None, Stopping], Coroutine[Any, Any, None]]
"""Runs beside the server once it listens: ``companion(url, admin_token, stopping)``;
returns once it has stopped."""


def open_store(config: ServeConfig) -> Store:
    """The store ``config.store`` names (``sqlite``: ``state.db`` in the state directory).
    A PostgreSQL store is opened as a standby: it reads, but commits only once it leads;
    closing it ends its term, so that a standby takes over at once."""
    if config.store == "memory":
        return MemoryStore()
    if is_postgres_url(config.store):
        from ..store import PostgresStore  # asyncpg: only for this store

        return PostgresStore(config.store, step_down_on_close=True)
    state_dir = config.state_path
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return SqliteStore(
        state_dir / "state.db", synchronous="FULL" if config.sync == "full" else "NORMAL"
    )


def _shared(store: Store, config: ServeConfig) -> PostgresStore | None:
    """``store`` if several controllers share it (a leader is elected beside the server):
    a PostgreSQL store, whose module is imported only where ``config`` names one."""
    if not is_postgres_url(config.store):
        return None
    from ..store import PostgresStore

    return store if isinstance(store, PostgresStore) else None


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


def listen(host: str, port: int) -> Listener:
    """A socket bound to ``host:port`` (uvicorn listens on it), or :class:`ServeRefused`."""
    try:
        return bound(host, port)
    except OSError as error:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if error.errno == errno.EADDRINUSE:
            why = f"{where} is already in use (another gpu-arbiter? `--port` chooses another)"
        else:
            why = f"cannot listen on {where}: {error.strerror or error}"
        raise ServeRefused(why, EXIT_CANNOT_LISTEN) from None


def serve(config: ServeConfig, companion: Companion | None = None) -> None:
    """Blocks until the server stops (SIGINT/SIGTERM). ``companion`` (``serve --local``'s
    agent) is started once the server listens, and stopped before it returns. Raises
    :class:`ServeRefused` (having changed nothing) if it cannot start."""
    if not config.auth and not is_loopback(config.host):
        raise SystemExit(
            f"refusing to listen on {config.host} without authentication; "
            "use a loopback address or enable auth"
        )
    reloader = _tls(config)
    with contextlib.ExitStack() as held:
        if config.store == "sqlite":  # a shared database has several controllers by design
            held.callback(os.close, lock_state_dir(config.state_path))
        sock = held.enter_context(listen(config.host, config.port))
        _serve_on(sock, config, companion, reloader)


def _tls(config: ServeConfig) -> Reloader | None:
    """The listener's TLS context and its reloader, or :class:`ServeRefused` naming the
    file that cannot be loaded; None for plain HTTP."""
    tls = config.tls
    if tls is None:
        return None
    try:
        return Reloader(server_context(tls), tls)
    except InvalidInput as error:
        raise ServeRefused(str(error), EXIT_BAD_TLS) from None


def _serve_on(
    sock: Listener, config: ServeConfig, companion: Companion | None, tls: Reloader | None
) -> None:
    redactor = setup_logging(config.log_format, config.log_level)
    warn_if_plain("the controller", config.host, config.tls, "--tls-cert and --tls-key")
    if is_postgres_url(config.store):
        with contextlib.suppress(ValueError):
            redactor.hide(urlsplit(config.store).password)  # the database's, if in the URL
    gc.freeze()  # what the imports made lives as long as the process: no collection scans it
    store = open_store(config)
    shared = _shared(store, config)
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
        standby=shared is not None,  # a leader is elected beside
        allowed_hosts=allowed_hosts(sock.getsockname()[0], config),
        retention_s=config.retention_s,
        history=History(sample_s=config.history_sample_s),
        admin_token_file=token_file,
    )
    server = _Server(
        app.state.event_feed.close,
        _uvicorn_config(app, config, tls),
        tls,
        handshake_timeout_s=config.header_timeout_s,
    )
    sock.cap = server.config.limit_concurrency or sock.cap
    companions = [] if companion is None else [companion]
    if shared is not None:
        companions.insert(0, _coordinate(controller, shared, config))
    if not companions:
        server.run(sockets=[sock])
    else:
        asyncio.run(_serve_with(server, [sock], companions, admin_token))


class _Server(uvicorn.Server):
    """uvicorn on the socket bound before the store was opened: it says where it listens
    once it does, as uvicorn does when it binds the socket itself; when it stops, it ends
    the event streams first, so that their clients see the end at once rather than the
    cut of the graceful timeout. With TLS, a client has ``handshake_timeout_s`` to
    complete its handshake (``tls.handshake_bound``)."""

    def __init__(
        self,
        end_streams: Callable[[], None],
        config: uvicorn.Config,
        tls: Reloader | None,
        *,
        handshake_timeout_s: float,
    ) -> None:
        super().__init__(config)
        self.handshake_timeout_s = handshake_timeout_s
        self.end_streams = end_streams
        self.own_signals = True  # False: whoever runs it handles SIGINT and SIGTERM
        self.tls = tls
        self.scheme = "http" if tls is None else "https"

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serves; with TLS, its certificate files are reloaded meanwhile when they change."""
        if self.tls is None:
            await super().serve(sockets)
            return
        async with self.tls.watching():
            await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's handlers while it serves (SIGINT, SIGTERM: a graceful stop; SIGINT
        again: at once), without raising the signal again once stopped, as uvicorn does:
        a stop that was asked for is a clean exit (0)."""
        if not self.own_signals or threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {signum: signal.signal(signum, self.handle_exit) for signum in STOP_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in originals.items():
                signal.signal(signum, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.tls is None:
            await super().startup(sockets)
        else:
            with handshake_bound(self.handshake_timeout_s):
                await super().startup(sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            where = f"[{host}]" if ":" in host else host
            logging.getLogger("uvicorn.error").info(
                "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", self.scheme, where, port
            )

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.end_streams()
        await super().shutdown(sockets)


def _uvicorn_config(app: Any, config: ServeConfig, tls: Reloader | None) -> uvicorn.Config:
    """uvicorn with the connection limits of ``config`` (see ``connections.py``), on
    asyncio's own loop alone as beside an agent or a gateway (``serve --local``): one
    loop however it runs, whose accepts go through the listening socket (its cap), and
    uvloop made no difference to its throughput beyond the noise of one run (its time
    is its Python, not the loop's)."""
    max_connections = config.max_connections
    files = raise_open_files_limit()
    if max_connections > files:
        log.warning("at most %d connections: the limit of open files allows no more", files)
        max_connections = files
    limits = HeadLimits(config.max_header_bytes, config.max_headers, config.header_timeout_s)
    return uvicorn.Config(
        app,
        ssl_context_factory=None if tls is None else _context_of(tls),
        host=config.host,
        port=config.port,
        http=bounded_http(limits),
        limit_concurrency=max_connections,
        log_level=config.log_level.lower(),
        log_config=None,  # uvicorn's loggers go to the one handler of setup_logging
        access_log=False,
        timeout_graceful_shutdown=3,
        timeout_keep_alive=KEEP_ALIVE_S,
        loop="asyncio",
    )


def _context_of(tls: Reloader) -> Callable[[uvicorn.Config, Any], ssl.SSLContext]:
    """uvicorn's factory of its TLS context: the reloader's own, whose certificate is
    replaced in place when the files change."""
    return lambda config, default: tls.context


def _coordinate(controller: Controller, store: LeaderStore, config: ServeConfig) -> Companion:
    """Leader election beside the server (a shared store: several controllers)."""

    async def coordinate(url: str, token: str | None, stopping: Stopping) -> None:
        advertised = (config.advertise_url or url).rstrip("/")
        coordinator = Coordinator(controller, store, url=advertised, ttl_s=config.leader_ttl_s)
        await coordinator.run(stopping.asked)

    return coordinate


async def _serve_with(
    server: _Server,
    sockets: list[socket.socket],
    companions: list[Companion],
    token: str | None,
) -> None:
    """Serves with ``companions`` beside it; a stop signal stops them first, then the
    server (see the module)."""
    stopping = Stopping()
    loop = asyncio.get_running_loop()
    server.own_signals = False
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stopping.signalled)
    try:
        await _serve_beside(server, sockets, companions, token, stopping)
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)


async def _serve_beside(
    server: _Server,
    sockets: list[socket.socket],
    companions: list[Companion],
    token: str | None,
    stopping: Stopping,
) -> None:
    serving = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started:
        if serving.done() or stopping.asked.is_set():
            server.should_exit = True
            await serving
            return
        await asyncio.sleep(0.05)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = socket.getfqdn()
    url = f"{server.scheme}://{host}:{port}"
    beside: asyncio.Future[list[None]] = asyncio.ensure_future(
        asyncio.gather(*(companion(url, token, stopping) for companion in companions))
    )
    asked = asyncio.ensure_future(stopping.asked.wait())
    try:
        running: list[asyncio.Future[Any]] = [serving, beside, asked]
        await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
    finally:
        asked.cancel()
        stopping.asked.set()
        await _companions_stopped(beside, stopping)
        server.should_exit = True
        await serving
    if not beside.cancelled():
        beside.result()  # a companion that failed says why


async def _companions_stopped(beside: asyncio.Future[list[None]], stopping: Stopping) -> None:
    """Waits for the companions (each bounds its own stop); once hurried, for at most
    ``HURRIED_S`` more before they are cancelled."""
    hurry = asyncio.ensure_future(stopping.hurry.wait())
    try:
        either: list[asyncio.Future[Any]] = [beside, hurry]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not beside.done():
            await asyncio.wait([beside], timeout=HURRIED_S)
        if not beside.done():
            log.warning("the companions did not stop in %gs after the second signal", HURRIED_S)
            beside.cancel()
            await asyncio.gather(beside, return_exceptions=True)
    finally:
        hurry.cancel()
