"""``gpu-arbiter agent``: the worker agent of this host."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from pathlib import Path
from typing import Annotated, Any

import typer

from ..agent.agent import Agent, AgentConfig
from ..agent.local import runtime_dir
from ..agent.probes import FakeProbe, Probe, detect
from ..core import InvalidInput, validate_worker_name
from ..logs import LOG_FORMATS, LOG_LEVELS, setup_logging
from ..logs import say as notice
from ..paths import read_token_file

ENV = "GPU_ARBITER_"


def _opt(env: str | None, text: str, *names: str, **more: Any) -> Any:
    envvar = None if env is None else ENV + env
    return typer.Option(*names, envvar=envvar, help=text, show_default=False, **more)


def worker_name(name: str | None) -> str:
    """``name``, or this host's name; a clear error when it is not a valid worker name."""
    given = name if name is not None else socket.gethostname().split(".")[0]
    try:
        return validate_worker_name(given, "--name")
    except InvalidInput as error:
        raise typer.BadParameter(f"{error}; pass --name") from error


def _token(token: str | None, token_file: Path | None) -> str | None:
    """``--token``, or the token in ``--token-file`` (mode 0600: a secret is never
    written on a command line); a clear error for both, or for a file that is missing,
    empty or readable by others."""
    if token_file is None:
        return token
    if token is not None:
        raise typer.BadParameter("give --token-file or --token, not both", param_hint="--token")
    try:
        return read_token_file(token_file)
    except InvalidInput as error:
        raise typer.BadParameter(error.reason, param_hint="--token-file") from None


async def open_agent_probe(name: str, simulate: str | None, say: bool = True) -> Probe:
    """The detected probe, or the fake one for ``simulate`` (or when no GPU is found)."""
    if simulate is None:
        skipped: list[str] = []
        probe = await detect(skipped=skipped)
        if probe is not None:
            return probe
        simulate = "1x24G"
        if say:
            notice(
                "no GPU found (" + "; ".join(skipped) + f"): running on simulated GPUs {simulate}"
            )
    runtime_dir().mkdir(parents=True, exist_ok=True, mode=0o700)
    usage_dir = runtime_dir() / f"fake-{name}"
    usage_dir.mkdir(exist_ok=True, mode=0o700)
    try:
        return FakeProbe.from_spec(simulate, usage_dir=usage_dir)
    except InvalidInput as error:
        raise typer.BadParameter(str(error)) from error


async def run_agent(config: AgentConfig, probe: Probe) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await Agent(config, probe).run(stop)
    except RuntimeError as error:
        logging.getLogger("gpu_arbiter.agent").error("gpu-arbiter agent: %s", error)
        raise SystemExit(1) from error
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signum)


def agent(
    controller: Annotated[
        str | None, _opt("URL", "Controller URL(s), comma-separated.", "--controller")
    ] = None,
    token: Annotated[
        str | None, _opt("TOKEN", "A worker (or admin) token (better: --token-file).")
    ] = None,
    token_file: Annotated[
        Path | None,
        _opt("TOKEN_FILE", "The file of its worker token (mode 0600).", "--token-file"),
    ] = None,
    name: Annotated[str | None, _opt(None, "Worker name (default: the host name).")] = None,
    simulate: Annotated[
        str | None, _opt(None, "Simulated GPUs instead of probing, e.g. 2x24G:sm_86.")
    ] = None,
    heartbeat_s: Annotated[float, _opt(None, "Seconds between heartbeats.", min=0.1)] = 2.0,
    grace_s: Annotated[
        float, _opt(None, "Seconds between SIGTERM and SIGKILL on revocation.", min=0.0)
    ] = 10.0,
    update_command: Annotated[
        str | None,
        _opt(
            "UPDATE_COMMAND",
            "Command this host runs on an update (configured here, never sent by the network).",
        ),
    ] = None,
    version_file: Annotated[
        Path | None, _opt(None, "File whose first line is the version to report.")
    ] = None,
    headroom_mb: Annotated[
        int, _opt(None, "MiB kept free per GPU for driver memory.", min=0)
    ] = 256,
    log_level: Annotated[str, _opt("LOG_LEVEL", "debug, info, warning or error.")] = "info",
    log_format: Annotated[str, _opt("LOG_FORMAT", "text, or json: one object per line.")] = "text",
) -> None:
    """Run the worker agent: register this host's GPUs, heartbeat, stop revoked processes."""
    if log_format not in LOG_FORMATS:
        raise typer.BadParameter(
            f"must be one of {', '.join(LOG_FORMATS)}", param_hint="--log-format"
        )
    if log_level.lower() not in LOG_LEVELS:
        raise typer.BadParameter(
            f"must be one of {', '.join(LOG_LEVELS)}", param_hint="--log-level"
        )
    token = _token(token, token_file)
    redactor = setup_logging(log_format, log_level)
    redactor.hide(token)
    worker = worker_name(name)
    config = AgentConfig(
        name=worker,
        controller=controller,
        token=token,
        heartbeat_s=heartbeat_s,
        grace_s=grace_s,
        update_command=update_command,
        version_file=version_file,
        headroom_mb=0 if simulate else headroom_mb,
    )

    async def main() -> None:
        probe = await open_agent_probe(worker, simulate)
        notice(f"agent {worker}: probe {probe.name}")
        await run_agent(config, probe)

    asyncio.run(main())
