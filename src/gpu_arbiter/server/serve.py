"""Runs the controller: state directory, store, admin token, uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from ..controller import Controller, Limits
from ..store import MemoryStore, SqliteStore, Store
from .app import create_app
from .auth import Authenticator, ensure_admin_token
from .config import ServeConfig, is_loopback, parse_simulate

__all__ = ["open_store", "serve"]


def open_store(config: ServeConfig) -> Store:
    if config.store == "memory":
        return MemoryStore()
    state_dir = config.state_path
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return SqliteStore(
        state_dir / "state.db", synchronous="FULL" if config.sync == "full" else "NORMAL"
    )


def serve(config: ServeConfig) -> None:
    """Blocks until the server stops (SIGINT/SIGTERM)."""
    if not config.auth and not is_loopback(config.host):
        raise SystemExit(
            f"refusing to listen on {config.host} without authentication; "
            "use a loopback address or enable auth"
        )
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    store = open_store(config)
    if config.auth:
        state_dir = config.state_path
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path, created = ensure_admin_token(state_dir, store)
        print(
            f"admin token {'created in' if created else 'in'} {path}", file=sys.stderr, flush=True
        )
    controller = Controller(
        store,
        limits=Limits(
            max_pending=config.max_pending, max_pending_per_holder=config.max_pending_per_holder
        ),
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        simulated=parse_simulate(config.simulate) if config.simulate else (),
    )
    app = create_app(
        controller, Authenticator(store, enabled=config.auth), max_body_bytes=config.max_body_bytes
    )
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,
        timeout_graceful_shutdown=3,
        timeout_keep_alive=65,  # longer than clients keep idle connections: no reuse race
    )
