"""Runs the controller: state directory, store, admin token, uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

import uvicorn

from ..controller import Controller, Limits
from ..logs import say, setup_logging
from ..store import MemoryStore, PostgresStore, SqliteStore, Store, is_postgres_url
from .app import create_app
from .auth import Authenticator, ensure_admin_token
from .config import ServeConfig, is_loopback, parse_simulate
from .ha import Coordinator, LeaderStore
from .history import History
from .limits import ClientLimits

__all__ = ["Companion", "open_store", "serve"]

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


def serve(config: ServeConfig, companion: Companion | None = None) -> None:
    """Blocks until the server stops (SIGINT/SIGTERM). ``companion`` (``serve --local``'s
    agent) is started once the server listens, and stopped before it returns."""
    if not config.auth and not is_loopback(config.host):
        raise SystemExit(
            f"refusing to listen on {config.host} without authentication; "
            "use a loopback address or enable auth"
        )
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
        history=History(sample_s=config.history_sample_s),
        admin_token_file=token_file,
    )
    server = _Server(
        app.state.event_feed.close,
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level.lower(),
            log_config=None,  # uvicorn's loggers go to the one handler of setup_logging
            access_log=False,
            timeout_graceful_shutdown=3,
            timeout_keep_alive=65,  # longer than clients keep idle connections: no reuse race
        ),
    )
    companions = [] if companion is None else [companion]
    if isinstance(store, PostgresStore):
        companions.insert(0, _coordinate(controller, store, config))
    if not companions:
        server.run()
    else:
        asyncio.run(_serve_with(server, companions, admin_token))


class _Server(uvicorn.Server):
    """Ends the event streams first when it stops, so that their clients see the end
    at once rather than the cut of the graceful timeout."""

    def __init__(self, end_streams: Callable[[], None], config: uvicorn.Config) -> None:
        super().__init__(config)
        self.end_streams = end_streams

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.end_streams()
        await super().shutdown(sockets)


def _coordinate(controller: Controller, store: LeaderStore, config: ServeConfig) -> Companion:
    """Leader election beside the server (a shared store: several controllers)."""

    async def coordinate(url: str, token: str | None, stop: asyncio.Event) -> None:
        advertised = (config.advertise_url or url).rstrip("/")
        coordinator = Coordinator(controller, store, url=advertised, ttl_s=config.leader_ttl_s)
        await coordinator.run(stop)

    return coordinate


async def _serve_with(
    server: uvicorn.Server, companions: list[Companion], token: str | None
) -> None:
    serving = asyncio.create_task(server.serve())
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
