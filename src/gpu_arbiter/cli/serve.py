"""``gpu-arbiter serve`` and ``gpu-arbiter token create``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..core import InvalidInput, validate_worker_name
from ..server.auth import create_token
from ..server.config import ServeConfig
from ..server.serve import open_store
from ..server.serve import serve as run_server

ENV = "GPU_ARBITER_"
token_app = typer.Typer(help="Bearer tokens for the controller.", no_args_is_help=True)


def _opt(env: str, text: str, *names: str, **more: Any) -> Any:
    return typer.Option(*names, envvar=ENV + env, help=text, show_default=False, **more)


def serve(
    host: Annotated[str | None, _opt("HOST", "Address to listen on (default 127.0.0.1).")] = None,
    port: Annotated[int | None, _opt("PORT", "Port (default 7070).", min=0, max=65535)] = None,
    state_dir: Annotated[
        Path | None,
        _opt(
            "STATE_DIR",
            "Where state.db and admin.token live (default $XDG_STATE_HOME/gpu-arbiter).",
        ),
    ] = None,
    simulate: Annotated[
        str | None,
        _opt("SIMULATE", "Register a simulated local worker, e.g. 2x24G or 2x24G:sm_86."),
    ] = None,
    auth: Annotated[
        bool | None, _opt("AUTH", "Require bearer tokens (default on).", "--auth/--no-auth")
    ] = None,
    store: Annotated[
        str | None, _opt("STORE", "sqlite (durable) or memory (lost on exit) (default sqlite).")
    ] = None,
    sync: Annotated[
        str | None,
        _opt(
            "SYNC",
            "normal: durable against a crash; full: also against power loss (default normal).",
        ),
    ] = None,
    heartbeat_timeout_s: Annotated[
        float | None,
        _opt("HEARTBEAT_TIMEOUT_S", "A worker silent this long goes offline (default 15)."),
    ] = None,
    log_level: Annotated[
        str | None, _opt("LOG_LEVEL", "debug, info, warning or error (default info).")
    ] = None,
    config: Annotated[
        Path | None, _opt("CONFIG", "TOML config file (see the README).", exists=True)
    ] = None,
) -> None:
    """Run the controller: the HTTP API over the decision core, with durable state."""
    given: dict[str, Any] = {
        "host": host,
        "port": port,
        "state_dir": state_dir,
        "simulate": simulate,
        "auth": auth,
        "store": store,
        "sync": sync,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "log_level": log_level,
    }
    try:
        settings = ServeConfig.resolve(given, config)
    except (InvalidInput, TypeError) as error:
        raise typer.BadParameter(str(error)) from error
    run_server(settings)


@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option(help="client or worker.")],
    worker: Annotated[
        str | None, typer.Option(help="The worker a worker token is bound to.")
    ] = None,
    state_dir: Annotated[
        Path | None, _opt("STATE_DIR", "The controller's state directory.")
    ] = None,
) -> None:
    """Issue a token: printed once; only its digest is kept."""
    if role not in ("client", "worker"):
        raise typer.BadParameter("--role must be client or worker")
    try:
        name = validate_worker_name(worker) if worker is not None else None
        store = open_store(ServeConfig.resolve({"state_dir": state_dir}, None))
    except InvalidInput as error:
        raise typer.BadParameter(str(error)) from error
    try:
        token, _ = create_token(store, role, name)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    finally:
        store.close()
    typer.echo(token)
