"""``gpu-arbiter serve`` and ``gpu-arbiter token create``.

The server (FastAPI, uvicorn) is imported only by these commands, so that ``run`` and
``agent`` start quickly; the agent (and the client) only by ``serve --local``, the
gateway only by ``serve --local --models``, so that a controller starts quickly."""

from __future__ import annotations

import asyncio
import functools
import os
import shlex
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..core import InvalidInput, validate_worker_name
from ..logs import say
from ..paths import default_state_dir

if TYPE_CHECKING:
    from ..gateway.servers.process import GatewayRefused
    from ..server.serve import Companion, ServeRefused, Stopping
    from ..store import Store

Gateway = Callable[..., Awaitable[None]]
"""``gateway(worker, url, token, stop, hurry=)``: ``serve --local --models``'s gateway."""

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
        str | None,
        _opt(
            "STORE",
            "sqlite (durable), memory (lost on exit) or a postgresql:// URL (a database "
            "several controllers share) (default sqlite).",
        ),
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
    log_format: Annotated[
        str | None, _opt("LOG_FORMAT", "text, or json: one object per line (default text).")
    ] = None,
    advertise_url: Annotated[
        str | None,
        _opt(
            "ADVERTISE_URL",
            "With a shared PostgreSQL store: the URL standbys send clients to while this "
            "controller leads (default: the address it listens on).",
        ),
    ] = None,
    leader_ttl_s: Annotated[
        float | None,
        _opt(
            "LEADER_TTL_S",
            "With a shared PostgreSQL store: a leader silent this long is replaced (default 3).",
        ),
    ] = None,
    max_pending_per_token: Annotated[
        int | None,
        _opt("MAX_PENDING_PER_TOKEN", "Pending requests one token may have (default 1000).", min=1),
    ] = None,
    max_streams_per_token: Annotated[
        int | None,
        _opt("MAX_STREAMS_PER_TOKEN", "Event streams one token may open (default 100).", min=1),
    ] = None,
    max_streams: Annotated[
        int | None, _opt("MAX_STREAMS", "Event streams open in all (default 10000).", min=1)
    ] = None,
    max_long_polls_per_token: Annotated[
        int | None,
        _opt(
            "MAX_LONG_POLLS_PER_TOKEN",
            "Long-polls (GET /v1/leases/ID?wait=) one token may hold open (default 1000).",
            min=1,
        ),
    ] = None,
    max_long_polls: Annotated[
        int | None, _opt("MAX_LONG_POLLS", "Long-polls open in all (default 10000).", min=1)
    ] = None,
    allowed_hosts: Annotated[
        str | None,
        _opt(
            "ALLOWED_HOSTS",
            "Host names clients may reach this controller by, comma-separated, besides "
            "loopback names, IP addresses and the address it listens on (a name or a "
            "proxy in front of it); * allows any.",
        ),
    ] = None,
    retention: Annotated[
        str | None,
        _opt(
            "RETENTION",
            "Forget leases this long after they ended: 7d, 12h; 0 keeps them (default 7d).",
        ),
    ] = None,
    max_connections: Annotated[
        int | None,
        _opt(
            "MAX_CONNECTIONS", "Open connections; requests beyond get 503 (default 10000).", min=1
        ),
    ] = None,
    max_header_bytes: Annotated[
        int | None,
        _opt("MAX_HEADER_BYTES", "A request's line and headers; larger: 431 (default 65536)."),
    ] = None,
    header_timeout_s: Annotated[
        float | None,
        _opt(
            "HEADER_TIMEOUT_S",
            "Time a client has to send a request's headers; later: 408 and closed (default 10).",
        ),
    ] = None,
    config: Annotated[
        Path | None, _opt("CONFIG", "TOML config file (see docs/one-machine.md).", exists=True)
    ] = None,
    tls_cert: Annotated[
        Path | None,
        _opt("TLS_CERT", "Serve HTTPS with this certificate (PEM; reloaded when it changes)."),
    ] = None,
    tls_key: Annotated[Path | None, _opt("TLS_KEY", "The certificate's key (PEM).")] = None,
    tls_client_ca: Annotated[
        Path | None,
        _opt("TLS_CLIENT_CA", "Require a client certificate signed by this CA (mutual TLS)."),
    ] = None,
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            help="Also run the agent of this machine (GPUs detected; none: simulated 1x24G, "
            "or --simulate SPEC).",
        ),
    ] = False,
    models: Annotated[
        Path | None,
        typer.Option(
            "--models",
            help="With --local: also run a model gateway for this models file (see "
            "`gpu-arbiter gateway --help`).",
            exists=True,
        ),
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
        "log_format": log_format,
        "advertise_url": advertise_url,
        "leader_ttl_s": leader_ttl_s,
        "max_pending_per_token": max_pending_per_token,
        "max_streams_per_token": max_streams_per_token,
        "max_streams": max_streams,
        "max_long_polls_per_token": max_long_polls_per_token,
        "max_long_polls": max_long_polls,
        "allowed_hosts": allowed_hosts,
        "retention": retention,
        "max_connections": max_connections,
        "max_header_bytes": max_header_bytes,
        "header_timeout_s": header_timeout_s,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
        "tls_client_ca": tls_client_ca,
    }
    from ..server.config import ServeConfig
    from ..server.serve import serve as run_server
    from ..store import StoreError

    spec = given.pop("simulate") if local else None  # --local: the local agent's GPUs
    try:
        settings = ServeConfig.resolve(given, config)
    except (InvalidInput, TypeError) as error:
        raise typer.BadParameter(str(error)) from error
    if models is not None and not local:
        raise typer.BadParameter("--models runs the gateway beside the local agent: add --local")
    companion = None
    token_file = settings.state_path / "admin.token" if settings.auth else None
    refusals = _refusals(with_gateway=models is not None)
    try:
        if local:
            companion = local_agent(spec, token_file, models, settings.state_path)
        run_server(settings, companion)
    except refusals as refused:  # one line, and its exit code
        typer.echo(f"gpu-arbiter serve: {refused}", err=True)
        raise typer.Exit(refused.exit_code) from None
    except StoreError as error:  # at start: once serving, the store's failures are 503s
        raise SystemExit(f"gpu-arbiter serve: {error}") from error


def _refusals(with_gateway: bool) -> tuple[type[ServeRefused | GatewayRefused], ...]:
    """What refuses to start ``serve`` (one line and an exit code): the server, and the
    gateway where one runs beside it (its modules are imported only then)."""
    from ..server.serve import ServeRefused

    if not with_gateway:
        return (ServeRefused,)
    from ..gateway.servers.process import GatewayRefused

    return (ServeRefused, GatewayRefused)


def local_agent(
    simulate: str | None,
    token_file: Path | None,
    models: Path | None = None,
    state_dir: Path | None = None,
) -> Companion:
    """``serve --local``'s agent for this machine, in the controller's process; with
    ``models``, the model gateway beside it, on ``state_dir`` (a config error exits 2,
    another gateway on the directory 73, before anything starts). On stop the gateway
    stops first (its servers stopped, their leases released, the agent still there to
    stop them), then the agent."""
    from ..agent.agent import Agent, AgentConfig
    from ..agent.probes import FakeProbe, parse_fake_spec
    from .agent import open_agent_probe, worker_name

    gateway = None if models is None else local_gateway(models, state_dir or default_state_dir())
    if simulate is not None:
        try:
            parse_fake_spec(simulate)
        except InvalidInput as error:
            raise typer.BadParameter(str(error)) from error
    try:
        name = worker_name(None)
    except typer.BadParameter:
        name = "local"

    async def companion(url: str, token: str | None, stopping: Stopping) -> None:
        probe = await open_agent_probe(name, simulate)
        simulated = isinstance(probe, FakeProbe)
        if simulate is not None:
            say(f"running on simulated GPUs {simulate} (--simulate)")
        settings = AgentConfig(
            name=name, controller=url, token=token, headroom_mb=0 if simulated else 256
        )
        kind = " (simulated GPUs)" if simulated else ""
        say(f"local worker {name}: probe {probe.name}{kind}; controller {url}")
        say(f"dashboard {url}/ ; API docs {url}/docs")
        say("try it from another shell:")
        for line in usage_lines(url, token_file):
            say(f"  {line}")
        agent_stop = asyncio.Event()
        agent = asyncio.ensure_future(Agent(settings, probe).run(agent_stop))
        try:
            if gateway is None:
                await _until_asked(stopping, [agent])
            else:
                run = functools.partial(gateway, name, url, token, hurry=stopping.hurry)
                await _gateway_beside(run, agent, stopping)
        finally:
            agent_stop.set()
            await agent

    return companion


async def _until_asked(stopping: Stopping, running: list[asyncio.Future[None]]) -> None:
    """Until ``serve`` is asked to stop, or one of ``running`` has ended (failed)."""
    asked = asyncio.ensure_future(stopping.asked.wait())
    try:
        either: list[asyncio.Future[Any]] = [asked, *running]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        asked.cancel()


async def _gateway_beside(
    run: Callable[[asyncio.Event], Awaitable[None]],
    agent: asyncio.Future[None],
    stopping: Stopping,
) -> None:
    """Runs the gateway until ``serve`` stops (or the agent failed), then waits until it
    has stopped its servers and released their leases; its failure is raised."""
    stop = asyncio.Event()
    serving = asyncio.ensure_future(run(stop))
    try:
        await _until_asked(stopping, [agent, serving])
    finally:
        stop.set()
        await asyncio.wait([serving])
    serving.result()


def local_gateway(models: Path, state_dir: Path) -> Gateway:
    """``serve --local --models``'s gateway on ``state_dir``; a config error exits 2 and
    another gateway on the directory is refused, before anything starts."""
    from ..gateway.config import GatewayConfig, load_config
    from ..gateway.serve import beside_a_controller, run_gateway
    from ..gateway.servers.process import lock_state_dir
    from .gateway import checked_config, checked_exposure, on_hangup, sizes_of

    config, found = checked_config(models)
    checked_exposure(config, models)
    config = beside_a_controller(config)  # before the controller sizes its connection cap
    sizes = sizes_of(config, found)
    os.close(lock_state_dir(state_dir))  # taken for good once the gateway starts

    async def gateway(
        worker: str, url: str, token: str | None, stop: asyncio.Event, hurry: asyncio.Event
    ) -> None:
        settings = replace(config, worker=config.worker or worker)

        def reread() -> GatewayConfig:  # as at the start: beside the controller
            found = load_config(models)
            return replace(
                found, worker=found.worker or worker, max_connections=settings.max_connections
            )

        hangup = asyncio.Event()
        with on_hangup(hangup):  # SIGHUP: the models file read again
            await run_gateway(
                settings, controller=url, token=token, stop=stop, hurry=hurry, sizes=sizes,
                state_dir=state_dir, reread=reread, hangup=hangup, config_name=models.name,
            )  # fmt: skip

    return gateway


StateDirOpt = Annotated[Path | None, _opt("STATE_DIR", "The controller's state directory.")]
StoreOpt = Annotated[
    str | None, _opt("STORE", "The controller's store: sqlite or a postgresql:// URL.")
]


def _open_token_store(command: str, state_dir: Path | None, store: str | None) -> Store:
    """The store a running controller uses, opened beside it (it takes no lock: token
    rows are the only thing these commands write, and the controller reads them)."""
    from ..server.config import ServeConfig
    from ..server.serve import open_store
    from ..store import StoreError

    try:
        settings = ServeConfig.resolve({"state_dir": state_dir, "store": store}, None)
        if settings.store == "memory":
            raise InvalidInput("store", "a memory store keeps no tokens")
        return open_store(settings)
    except InvalidInput as error:
        raise typer.BadParameter(str(error)) from error
    except StoreError as error:
        raise SystemExit(f"gpu-arbiter token {command}: {error}") from error


def command_word() -> str:
    """How a new shell runs this very gpu-arbiter: ``gpu-arbiter`` where PATH finds it,
    else its full path (or ``python -m gpu_arbiter`` when started that way)."""
    me = Path(sys.argv[0])
    if me.name == "__main__.py" or not me.is_file():
        return f"{shlex.quote(sys.executable)} -m gpu_arbiter"
    found = shutil.which("gpu-arbiter")
    if found is not None and Path(found).resolve() == me.resolve():
        return "gpu-arbiter"
    return shlex.quote(str(me.absolute()))


def usage_lines(url: str, token_file: Path | None) -> list[str]:
    """Commands that work as printed in a new shell: the URL and token only where the
    command would not find them by itself (another port, another state directory)."""
    from ..client import DEFAULT_URL

    lines = [] if url == DEFAULT_URL else [f"export GPU_ARBITER_URL={url}"]
    if token_file is not None and token_file.parent != default_state_dir():
        lines.append(f"export GPU_ARBITER_TOKEN=$(cat {shlex.quote(str(token_file))})")
    word = command_word()
    example = 'import os; print("granted GPU", os.environ["CUDA_VISIBLE_DEVICES"])'
    return [
        *lines,
        f"{word} status",
        f"{word} run --vram 8G -- python3 -c {shlex.quote(example)}",
    ]


@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option(help="client, worker or gateway.")],
    worker: Annotated[
        str | None, typer.Option(help="The worker a worker or gateway token is bound to.")
    ] = None,
    state_dir: StateDirOpt = None,
    store: StoreOpt = None,
) -> None:
    """Issue a token: printed once; only its digest is kept."""
    from ..server.auth import create_token
    from ..store import StoreError

    if role not in ("client", "worker", "gateway"):
        raise typer.BadParameter("--role must be client, worker or gateway")
    try:
        name = validate_worker_name(worker) if worker is not None else None
    except InvalidInput as error:
        raise typer.BadParameter(str(error)) from error
    opened = _open_token_store("create", state_dir, store)
    try:
        token, _ = create_token(opened, role, name)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    except StoreError as error:
        raise SystemExit(f"gpu-arbiter token create: {error}") from error
    finally:
        opened.close()
    typer.echo(token)


@token_app.command("list")
def token_list(state_dir: StateDirOpt = None, store: StoreOpt = None) -> None:
    """Every token: id, the start of its digest, role, worker, created (never the token)."""
    from ..store import StoreError

    opened = _open_token_store("list", state_dir, store)
    try:
        records = opened.tokens()
    except StoreError as error:
        raise SystemExit(f"gpu-arbiter token list: {error}") from error
    finally:
        opened.close()
    typer.echo(f"{'ID':<24} {'DIGEST':<12} {'ROLE':<7} {'WORKER':<20} CREATED")
    for record in records:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created_at))
        line = f"{record.id:<24} {record.digest[:12]:<12} {record.role:<7} "
        typer.echo(line + f"{record.worker or '-':<20} {created}")


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(metavar="ID", help="The token's id (token list).")],
    state_dir: StateDirOpt = None,
    store: StoreOpt = None,
) -> None:
    """Revoke a token: a running controller refuses it (401) within a second.

    The admin token in the state directory's admin.token is stored again at the next
    start while that file holds it: delete the file too (a new one is made at start)."""
    from ..store import StoreError

    opened = _open_token_store("revoke", state_dir, store)
    try:
        revoked = opened.revoke_token(token_id)
    except StoreError as error:
        raise SystemExit(f"gpu-arbiter token revoke: {error}") from error
    finally:
        opened.close()
    if not revoked:
        typer.echo(f"error: no token {token_id} (see gpu-arbiter token list)", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {token_id}")
