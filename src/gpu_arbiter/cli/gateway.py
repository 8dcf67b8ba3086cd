"""``gpu-arbiter gateway --config models.toml``: model servers on demand, under leases.

Exit codes: 0 after a clean stop (SIGINT/SIGTERM); 2 when the config is wrong (the
message names the model, the key and the reason), or with ``--check`` when a model's
program is not found (at a start it is only a warning: it may be installed later);
69 when it cannot listen; 73 when another gateway uses its state directory. A second
SIGINT/SIGTERM while it stops kills the model servers at once. SIGHUP reads the config
file again and applies its models without a restart (``gateway/live.py``; one log line
says what changed, or why nothing did); ``gpu-arbiter gateways reload`` asks the same
over HTTP (``POST /admin/reload``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from ..core import ArbiterError, InvalidInput, format_mb, priority_name
from ..gateway.config import GatewayConfig, load_config
from ..gateway.programs import missing_program
from ..gateway.requests.access import check_exposure
from ..gateway.serve import estimates, run_gateway
from ..gateway.servers.estimate import Estimate
from ..gateway.servers.process import GatewayRefused
from ..logs import say, setup_logging
from ..paths import STATE_DIR_ENV, default_state_dir, read_token_file
from .access import credentials

EXIT_CONFIG = 2
EXIT_CANNOT_LISTEN = 69


def _opt(text: str, *names: str, envvar: str | None = None, **more: Any) -> Any:
    return typer.Option(*names, envvar=envvar, help=text, show_default=False, **more)


def checked_config(
    path: Path, *, warn: bool = True
) -> tuple[GatewayConfig, dict[str, Estimate | None]]:
    """The config and its estimates, or a line naming model, key and reason and exit 2.
    With ``warn``, a warning line for each model whose program is not found (both ways
    of starting a gateway come here): its requests fail until it is installed."""
    try:
        config = load_config(path)
        found = estimates(config)
    except InvalidInput as error:
        typer.echo(f"gpu-arbiter gateway: {path}: {error}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    for field, reason in missing_programs(config).items() if warn else ():
        say(f"gateway: warning: {path}: {field}: {reason}; its requests fail until it is")
    return config, found


def checked_exposure(config: GatewayConfig, path: Path) -> None:
    """Exit 2 with one line when the gateway would listen beyond loopback without API
    keys (``--host`` included)."""
    try:
        check_exposure(config.host, config.keys)
    except InvalidInput as error:
        typer.echo(f"gpu-arbiter gateway: {path}: {error}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None


def missing_programs(config: GatewayConfig) -> dict[str, str]:
    """Each model whose command's program cannot be run, as ``models.NAME.command`` ->
    why (:func:`~gpu_arbiter.gateway.programs.missing_program`). The Ollama models of
    one ``ollama serve`` entry share its command: it is named once."""
    missing: dict[str, str] = {}
    for name, model in config.models.items():
        why = missing_program(model)
        if why is not None:  # an Ollama model's command is its serve entry's
            missing[f"models.{model.ollama_serve or name}.command"] = why
    return missing


def sizes_of(config: GatewayConfig, found: dict[str, Estimate | None]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for name, model in config.models.items():
        estimate = found[name]
        if model.vram is not None:
            sizes[name] = model.vram
        else:  # none yet for a model file still to copy: estimated once it is here
            sizes[name] = 0 if estimate is None else estimate.total_mb
    return sizes


def _show(config: GatewayConfig, found: dict[str, Estimate | None]) -> None:
    """Each model's line (its size: given, or the estimate's parts and the flags read
    from its command), the estimate's notes under it."""
    if not config.models and config.catalogue:
        typer.echo(
            "no model: no [models.NAME] table; the gateway serves the models the cluster's "
            "catalogue gives it, or those of this file once it has some (SIGHUP reloads it)"
        )
    elif not config.models:
        typer.echo(
            "no model: no [models.NAME] table, and catalogue = false: the gateway serves "
            "none until this file has some (SIGHUP reloads it)"
        )
    for name, model in config.models.items():
        estimate = found[name]
        if estimate is None and model.vram is None:
            size = "auto (estimated from its file once it is in models_dir)"
        elif estimate is None:
            size = f"{format_mb(model.vram or 0)} (given)"
        else:
            size = f"{format_mb(estimate.total_mb)} (auto: {estimate.describe()})"
        gpus = f" on each of {model.gpus} GPUs" if model.gpus > 1 else ""
        aliases = f", aliases {', '.join(model.aliases)}" if model.aliases else ""
        typer.echo(
            f"{name}: vram {size}{gpus}; priority {priority_name(model.priority)}; "
            f"keep_alive {model.keep_alive_s:g}s; {model.replicas} replica(s) x "
            f"{model.max_parallel} in flight{aliases}"
        )
        for note in estimate.notes if estimate is not None else ():
            typer.echo(f"  note: {note}")


def _check(path: Path) -> None:
    """``--check``: every model shown, then exit 2 if a program is missing."""
    settings, found = checked_config(path, warn=False)
    _show(settings, found)
    missing = missing_programs(settings)
    for field, reason in missing.items():
        typer.echo(f"gpu-arbiter gateway: {path}: {field}: {reason}", err=True)
    if missing:
        raise typer.Exit(EXIT_CONFIG)


def gateway(
    config: Annotated[Path, _opt("The models file (TOML).", "--config", "-c")],
    check: Annotated[
        bool, _opt("Check the config, show each model's VRAM and its parts, and exit.", "--check")
    ] = False,
    host: Annotated[str | None, _opt("Address to listen on (default: the config's).")] = None,
    port: Annotated[
        int | None, _opt("Port (default: the config's, else 8080).", min=0, max=65535)
    ] = None,
    worker: Annotated[str | None, _opt("The worker whose GPUs to use.")] = None,
    controller: Annotated[
        str | None, _opt("Controller URL(s), comma-separated.", envvar="GPU_ARBITER_URL")
    ] = None,
    token: Annotated[
        str | None,
        _opt(
            "Bearer token (better: --token-file; a command line is no secret).",
            envvar="GPU_ARBITER_TOKEN",
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        _opt(
            "The file of its gateway token (mode 0600; default: [gateway] token_file).",
            envvar="GPU_ARBITER_TOKEN_FILE",
        ),
    ] = None,
    log_level: Annotated[str, _opt("debug, info, warning or error.")] = "info",
    state_dir: Annotated[
        Path | None,
        _opt(
            "Where its servers' list, their logs and its lock live (default "
            "$XDG_STATE_HOME/gpu-arbiter); one gateway per directory.",
            envvar=STATE_DIR_ENV,
        ),
    ] = None,
) -> None:
    """Route OpenAI-style requests to model servers started on demand under leases."""
    if check:
        _check(config)
        return
    settings, found = checked_config(config)
    changes: dict[str, Any] = {}
    if host is not None:
        changes["host"] = host
    if port is not None:
        changes["port"] = port
    if worker is not None:
        changes["worker"] = worker
    settings = _replace(settings, changes)
    checked_exposure(settings, config)
    if token is not None and token_file is not None:
        typer.echo("gpu-arbiter gateway: give --token-file or --token, not both", err=True)
        raise typer.Exit(EXIT_CONFIG)
    token = _token(controller or settings.controller, token, token_file, settings.token_file)
    setup_logging("text", log_level)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            sizes = sizes_of(settings, found)
            reread = rereader(config, changes)
            runner.run(
                _main(settings, controller, token, sizes, state_dir or default_state_dir(),
                      (config.name, reread))
            )  # fmt: skip
    except GatewayRefused as refused:
        print(f"gpu-arbiter gateway: {refused}", file=sys.stderr)
        raise typer.Exit(refused.exit_code) from None
    except OSError as error:
        print(f"gpu-arbiter gateway: cannot listen: {error}", file=sys.stderr)
        raise typer.Exit(EXIT_CANNOT_LISTEN) from None


def _token(
    controller: str | None, token: str | None, given: Path | None, configured: Path | None
) -> str | None:
    """The token given (``--token``), else the one in the file ``given``
    (``--token-file``) or ``configured`` (``[gateway] token_file``), of mode 0600, else
    this machine's admin token for a controller on this machine, as every command finds
    it; exit 2 for a malformed controller URL or a token file that is missing, empty or
    readable by others."""
    try:
        if token is None and given is not None:
            return read_token_file(given, "--token-file")
        if token is None and configured is not None:
            return read_token_file(configured, "gateway.token_file")
        return credentials(controller, token).token
    except ArbiterError as error:
        typer.echo(f"gpu-arbiter gateway: {error}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed: it relays a request in about half the
    time asyncio's own loop takes."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _replace(settings: GatewayConfig, changes: dict[str, Any]) -> GatewayConfig:
    from dataclasses import replace

    return replace(settings, **changes)


def rereader(path: Path, changes: dict[str, Any]) -> Callable[[], GatewayConfig]:
    """The config file read again, with the command line's settings over it as at the
    start (``--host``, ``--port``, ``--worker``): what a reload applies."""
    return lambda: _replace(load_config(path), changes)


@contextlib.contextmanager
def on_hangup(hangup: asyncio.Event) -> Iterator[None]:
    """SIGHUP sets ``hangup`` (a reload) while in the block."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, hangup.set)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)


async def _main(
    settings: GatewayConfig,
    controller: str | None,
    token: str | None,
    sizes: dict[str, int],
    state_dir: Path,
    reread: tuple[str, Callable[[], GatewayConfig]],
) -> None:
    """Until SIGINT or SIGTERM; the next one hurries the stop (no more graces). SIGHUP:
    a reload."""
    stop, hurry, hangup = asyncio.Event(), asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, lambda: (hurry if stop.is_set() else stop).set())
    with on_hangup(hangup):
        await run_gateway(
            settings, controller=controller, token=token, stop=stop, hurry=hurry, sizes=sizes,
            state_dir=state_dir, reread=reread[1], hangup=hangup, config_name=reread[0],
        )  # fmt: skip
