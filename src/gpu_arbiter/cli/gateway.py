"""``gpu-arbiter gateway --config models.toml``: model servers on demand, under leases.

Exit codes: 0 after a clean stop (SIGINT/SIGTERM); 2 when the config is wrong (the
message names the model, the key and the reason); 69 when it cannot listen.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from ..core import InvalidInput, format_mb, priority_name
from ..gateway.config import GatewayConfig, load_config
from ..gateway.estimate import Estimate
from ..gateway.serve import estimates, run_gateway
from ..logs import setup_logging

EXIT_CONFIG = 2
EXIT_CANNOT_LISTEN = 69


def _opt(text: str, *names: str, envvar: str | None = None, **more: Any) -> Any:
    return typer.Option(*names, envvar=envvar, help=text, show_default=False, **more)


def checked_config(path: Path) -> tuple[GatewayConfig, dict[str, Estimate | None]]:
    """The config and its estimates, or a line naming model, key and reason and exit 2."""
    try:
        config = load_config(path)
        return config, estimates(config)
    except InvalidInput as error:
        typer.echo(f"gpu-arbiter gateway: {path}: {error}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None


def sizes_of(config: GatewayConfig, found: dict[str, Estimate | None]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for name, model in config.models.items():
        estimate = found[name]
        sizes[name] = model.vram if model.vram is not None else estimate.total_mb  # type: ignore[union-attr]
    return sizes


def _show(config: GatewayConfig, found: dict[str, Estimate | None]) -> None:
    for name, model in config.models.items():
        estimate = found[name]
        if estimate is None:
            size = f"{format_mb(model.vram or 0)} (given)"
        else:
            size = f"{format_mb(estimate.total_mb)} (auto: {estimate.describe()})"
        aliases = f", aliases {', '.join(model.aliases)}" if model.aliases else ""
        typer.echo(
            f"{name}: vram {size}; priority {priority_name(model.priority)}; "
            f"keep_alive {model.keep_alive_s:g}s; {model.replicas} replica(s) x "
            f"{model.max_parallel} in flight{aliases}"
        )


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
    token: Annotated[str | None, _opt("Bearer token.", envvar="GPU_ARBITER_TOKEN")] = None,
    log_level: Annotated[str, _opt("debug, info, warning or error.")] = "info",
) -> None:
    """Route OpenAI-style requests to model servers started on demand under leases."""
    settings, found = checked_config(config)
    if check:
        _show(settings, found)
        return
    changes: dict[str, Any] = {}
    if host is not None:
        changes["host"] = host
    if port is not None:
        changes["port"] = port
    if worker is not None:
        changes["worker"] = worker
    settings = _replace(settings, changes)
    setup_logging("text", log_level)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_main(settings, controller, token, sizes_of(settings, found)))
    except OSError as error:
        print(f"gpu-arbiter gateway: cannot listen: {error}", file=sys.stderr)
        raise typer.Exit(EXIT_CANNOT_LISTEN) from None


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


async def _main(
    settings: GatewayConfig, controller: str | None, token: str | None, sizes: dict[str, int]
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await run_gateway(settings, controller=controller, token=token, stop=stop, sizes=sizes)
