"""Running a gateway: the models of a config, a controller client, an HTTP listener.

``gpu-arbiter gateway --config models.toml`` runs :func:`run_gateway` on its own;
``serve --local --models models.toml`` runs it beside the controller and the local
agent. It reports its models to the controller and takes the commands queued for it
there (``cluster/report.py``). At start, before it serves, it takes its state directory (one
gateway per directory) and stops what a previous gateway there left running, then
releases those leases (``servers/process.py``), and ends every other lease the previous gateway
there asked for that no process holds (a request still queued, a grant it never ran: its
leases name the directory in their metadata, ``gateway_dir``), so that its first request
waits behind nothing of its own.

On stop, in this order: each new request for a model, and each still waiting for a
replica, is answered 503 at once (the listener stays open meanwhile); the requests
relayed to a replica get the model's grace to finish, and those still running then end
as a preemption ends them (a 503 naming why; an event stream's final error event); each
replica's server is stopped (SIGTERM; SIGKILL at the end of the grace, or the engine's
short ``stop_s`` after a cut; at once when ``hurry`` is set) and its lease released;
the requests this front door relays to other gateways get the same grace, then end
the same way; only then does the HTTP server stop, with no request left for it to
cancel.

Every task has an owner that ends it: one task group holds the models' lives
(:meth:`.live.LiveModels.run`: each :meth:`.servers.model.ModelServer.run` the owner of its
replicas'; an Ollama entry's serve with its own tasks; a model added while the gateway
runs too), which end once the models are shut down and their replicas have released;
the cluster's life (:meth:`.cluster.cluster.Cluster.run`: the view, its loads and
adoptions), the reporter's, the reloads' and the catalogue's follower's are cancelled at
the stop.

Its models change while it runs (``live.py``): given ``reread`` (the config file read
again), each ``hangup`` (SIGHUP) and each ``POST /admin/reload`` reads the file and
applies its models, and says in one log line what changed, or why nothing did; the
gateway serves on either way. The ``[gateway]`` table's own settings apply at the next
start: a reload that finds them changed names them (``not_applied``). With a worker (and
unless ``[gateway] catalogue = false``) it follows the cluster's catalogue too
(``follower.py``): each revision's share for its worker is applied as it comes, merged
with the file's models (:func:`_follow`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvicorn

from ..agent.local import local_workers
from ..client import ApiError, ArbiterClient, ControllerUnreachable
from ..core import InvalidInput
from ..logs import Redactor, say
from ..tls import (
    CA_ENV,
    Reloader,
    client_context,
    handshake_bound,
    server_context,
    warn_if_plain,
)
from ..web.connections import (
    HeadLimits,
    Listener,
    bound,
    bounded_http,
    raise_open_files_limit,
    set_aside_files,
)
from .base.clock import LoopClock
from .base.metrics import GatewayMetrics
from .cluster.cluster import ROUTES_REPORTED, Cluster
from .cluster.report import Reporter, default_name, listen_url
from .config import GatewayConfig
from .files.ensure import FileStep
from .files.spec import ModelFile
from .files.store import FileStore
from .files.wiring import estimated, open_store, placed
from .follower import CatalogueFollower, estimate_here
from .live import LiveModels, Outcome
from .model_set import listener_changes
from .programs import missing_program
from .requests.access import Access, ApiKey, check_exposure
from .requests.app import GatewayApp
from .servers.config import ModelConfig
from .servers.engines import EngineHttp
from .servers.estimate import Estimate, estimate_vram
from .servers.interfaces import Parts
from .servers.lease import Lease
from .servers.links import HttpHealthCheck, LocalAgentLink
from .servers.ollama import model_servers
from .servers.process import ProcessLauncher

__all__ = ["beside_a_controller", "estimates", "run_gateway"]

log = logging.getLogger("gpu_arbiter.gateway")
ANSWERS_S = 5.0
"""On stop, once the replicas are gone: how long the answers still being written (to a
slow client) may take before the HTTP server stops and cancels what is left."""


def estimates(config: GatewayConfig) -> dict[str, Estimate | None]:
    """Each ``vram = "auto"`` model's estimate (None for a fixed size); raises
    :class:`InvalidInput` naming the model's ``vram`` key when one cannot be made."""
    found: dict[str, Estimate | None] = {}
    for name, model in config.models.items():
        auto = model.vram is None and model.file is None  # a file's: once it is here
        found[name] = _estimate(model) if auto else None
    return found


def size_of(model: ModelConfig) -> int:
    """A model's lease size in MiB per GPU: its ``vram``, else its estimate's."""
    return model.vram if model.vram is not None else _estimate(model).total_mb


def _sized(model: ModelConfig, store: FileStore) -> int:
    """:func:`size_of`, for a model of a running gateway: one whose file is not here yet
    asks for the file's size until it is (``files/wiring.estimated``)."""
    if model.vram is None and model.file is not None:
        return estimated({model.name: model}, store)[0][model.name]
    return size_of(model)


def _estimate(model: ModelConfig) -> Estimate:
    try:
        return estimate_vram(
            model.command, model_file=model.model_file, ctx=model.ctx, gpus=model.gpus
        )
    except InvalidInput as error:
        key = "ctx" if error.field == "ctx" else "vram"
        raise InvalidInput(f"models.{model.name}.{key}", error.reason) from None


class _Server(uvicorn.Server):
    """uvicorn without signal handlers of its own: whoever runs the gateway stops it;
    with TLS, its certificate files reloaded while it serves when they change, and a
    client given ``handshake_timeout_s`` to complete its handshake."""

    def __init__(
        self, config: uvicorn.Config, tls: Reloader | None, handshake_timeout_s: float
    ) -> None:
        super().__init__(config)
        self.tls = tls
        self.handshake_timeout_s = handshake_timeout_s

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        if self.tls is None:
            await super().serve(sockets)
            return
        async with self.tls.watching():
            await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.tls is None:
            await super().startup(sockets)
            return
        with handshake_bound(self.handshake_timeout_s):
            await super().startup(sockets)


async def run_gateway(
    config: GatewayConfig,
    *,
    controller: str | None,
    token: str | None,
    stop: asyncio.Event,
    sizes: dict[str, int],
    state_dir: Path,
    hurry: asyncio.Event | None = None,
    reread: Callable[[], GatewayConfig] | None = None,
    hangup: asyncio.Event | None = None,
    config_name: str = "its config",
) -> None:
    """Serves until ``stop`` is set; ``sizes``: each model's MiB per GPU to ask for;
    ``state_dir``: where its servers' list, their logs and its lock are (a second
    gateway there: :class:`~.servers.process.GatewayRefused`); ``hurry``: once set while it
    stops, what still runs is killed without waiting for its grace; ``reread``: its
    config read again (raises :class:`InvalidInput`), for a reload at each ``hangup``
    (cleared by the gateway) and each ``POST /admin/reload``; ``config_name``: the file's
    name, as a model removed by a reload names it."""
    launcher = ProcessLauncher(state_dir)  # the lock first: a refused gateway starts nothing
    try:
        changes = _Reloads(config, reread, hangup, config_name)
        await _serve(config, controller, token, stop, sizes, launcher, hurry, changes)
    finally:
        await launcher.close()


class _Reloads:
    """The gateway's reloads: the config file read again (``reread``), its models applied
    to the live set, one at a time, each told in one log line."""

    def __init__(
        self,
        started: GatewayConfig,
        reread: Callable[[], GatewayConfig] | None,
        hangup: asyncio.Event | None,
        name: str,
    ) -> None:
        self.name = name
        self.started = started
        self.reread = reread
        self.hangup = hangup
        self.live: LiveModels | None = None

    async def reload(self) -> dict[str, Any]:
        """What a reload changed, as JSON; raises :class:`InvalidInput` when it changed
        nothing (the file, a model, its size, its program: field and reason)."""
        assert self.reread is not None and self.live is not None
        source = f"the reload of {self.name} at {time.strftime('%H:%M:%S')}"
        try:
            config = self.reread()
            outcome = await self.live.set_own(config.models, source)
        except InvalidInput as error:
            say(f"gateway: reload refused, nothing changed: {error}")
            raise
        kept = listener_changes(self.started, config)
        outcome = Outcome(outcome.diff, outcome.conflicts, kept, outcome.failed)
        say(f"gateway: reloaded: {outcome.describe()}")
        return outcome.as_json()

    async def run(self) -> None:
        """Each SIGHUP (``hangup``), a reload; a refused one leaves all as it was."""
        if self.hangup is None or self.reread is None:
            return
        while True:
            await self.hangup.wait()
            self.hangup.clear()
            try:
                await self.reload()
            except InvalidInput:
                continue  # said; all as it was
            except Exception:  # a bug: said, and the next SIGHUP tries again
                log.exception("gateway: the reload failed")


async def _serve(
    config: GatewayConfig,
    controller: str | None,
    token: str | None,
    stop: asyncio.Event,
    sizes: dict[str, int],
    launcher: ProcessLauncher,
    hurry: asyncio.Event | None,
    reloads: _Reloads,
) -> None:
    worker = config.worker
    if worker is None:
        here = await local_workers()
        worker = here[0] if len(here) == 1 else None
        if not here:
            say("gateway: no agent runs on this host: leases may land on another machine")
    metrics = GatewayMetrics()
    health = HttpHealthCheck()
    engines = EngineHttp()
    models_dir = config.models_dir or launcher.state_dir / "models"
    config = replace(config, models=placed(config.models, models_dir))  # {file}: its path
    signer: list[Cluster] = []  # the cluster, once made: it signs a copy's request

    def sign(to: str, method: str, target: str) -> str | None:
        return signer[0].sign_request(to, method, target) if signer else None

    store, fetcher = await open_store(
        config.models, models_dir, config.disk_budget, sign, _peer_tls(config)
    )
    auto, made = estimated(config.models, store)  # vram = "auto": from the files here
    sizes = {**sizes, **auto}
    async with ArbiterClient(controller or config.controller, token=token) as client:
        await _release(client, await launcher.stop_leftovers())
        asker = {"gateway_dir": str(launcher.state_dir.resolve())}
        await _end_asked(client, asker)
        parts = Parts(LoopClock(), launcher, LocalAgentLink(), client, health, engines)
        models = model_servers(
            config.models, parts=parts, metrics=metrics, worker=worker, sizes=sizes
        )  # an Ollama entry's models share one serve
        files = FileStep(store, lambda: app.cluster, worker or socket.gethostname(), made)
        live = LiveModels(
            models, parts=parts, metrics=metrics, worker=worker,
            size_of=lambda model: _sized(model, store), program_of=missing_program, asker=asker,
            affinity=config.affinity, files=files,
            place=lambda found: placed(found, models_dir),
        )  # fmt: skip
        routes = live.routes
        reloads.live = live
        check_exposure(config.host, config.keys)  # the CLI said so already, in one line
        sock = _listen(config.host, config.port)
        access = Access(config.keys, sock.getsockname()[0], (config.host, *config.allowed_hosts))
        app = GatewayApp(
            models, routes, metrics, access, max_body_bytes=config.max_body_bytes,
            max_buffered_bytes=config.max_buffered_bytes,
        )  # fmt: skip
        app.files = store  # GET /files/{name}, to peers
        _hide(config.keys)
        tls = None if config.tls is None else Reloader(server_context(config.tls), config.tls)
        warn_if_plain("the gateway", config.host, config.tls, "tls_cert and tls_key in [gateway]")
        server = _Server(_uvicorn_config(app, config, tls), tls, config.header_timeout_s)
        sock.cap = server.config.limit_concurrency or sock.cap
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        host, port = sock.getsockname()[:2]
        scheme = "http" if tls is None else "https"
        serves = f"for {', '.join(models) or 'no model yet'} (worker {worker or 'any'})"
        say(f"gateway on {scheme}://{host}:{port} {serves}")
        name = config.name or default_name(port)
        app.name = name
        app.removed = live.removed
        app.reload = None if reloads.reread is None else reloads.reload
        app.cluster = Cluster(
            client, name=name, worker=worker, models=models, routes=routes, clock=parts.clock,
            affinity=config.affinity, liveness=config.liveness, peer_tls=_peer_tls(config),
        )  # fmt: skip
        signer.append(app.cluster)
        url = config.url or listen_url(host, port, scheme)  # how the other gateways reach it
        reporter = Reporter(
            client, name=name, url=url, host=socket.gethostname(),
            worker=worker, models=models, administer=app.administer, adopt=app.adopt,
            routes=lambda: () if app.cluster is None else app.cluster.last_routed(ROUTES_REPORTED),
            conflicts=lambda: [c.as_json() for c in live.conflicts],
            left_out=lambda: [{"model": m, "why": why} for m, why in live.left_out.items()],
            public_key=app.cluster.identity.public_key,
            files=lambda: [f.describe() for f in store.held()],
        )  # fmt: skip
        live.set_cluster(app.cluster)
        live.changed = reporter.models_changed
        living = asyncio.ensure_future(live.run())
        following = _follow(
            config, client, worker, live, store, lambda m: _share_size(m, store, models_dir)
        )
        reporting = asyncio.gather(reporter.run(), app.cluster.run(), reloads.run(), following)
        try:
            ended = asyncio.ensure_future(stop.wait())
            await asyncio.wait({serving, ended}, return_when=asyncio.FIRST_COMPLETED)
            ended.cancel()
        finally:
            app.stop()  # 503 at once to new requests; those relayed keep their grace
            reporting.cancel()
            live.shutdown()
            await asyncio.gather(reporting, return_exceptions=True)
            await reporter.goodbye()
            grace_s = live.grace_s()
            hurried = asyncio.ensure_future(_kill_when(hurry, launcher))
            await asyncio.gather(_settle(living, grace_s), app.settle_forwards(grace_s))
            hurried.cancel()
            await app.quiet(ANSWERS_S)  # the last answers (503s, final events) go out
            server.should_exit = True
            await serving
            await health.aclose()
            await engines.aclose()
            await fetcher.aclose()
            sock.close()


async def _follow(
    config: GatewayConfig,
    client: ArbiterClient,
    worker: str | None,
    live: LiveModels,
    store: FileStore,
    estimate: Callable[[ModelConfig], int | str],
) -> None:
    """This worker's share of the cluster's catalogue, each revision's applied to the live
    set (``follower.py``), until cancelled; not without a worker (said once) or with
    ``catalogue = false``. A model whose program is not on this host is left out of its
    share, as one whose ``vram = "auto"`` cannot be estimated here: logged, and reported
    with why (``LiveModels.left_out``); a revision the live set refuses changes nothing
    here (said), and the next is applied all the same. The model files any of the
    revision's models names that are here are verified beside it (held: served to
    peers), whichever hosts may run those models: a large file put here by hand is
    hashed while the revision's models are already served."""
    if not config.catalogue:
        return
    if worker is None:
        say("gateway: the cluster's catalogue is not followed: no worker is known here "
            "(no agent on this host, or several: set [gateway] worker)")  # fmt: skip
        return

    checking: asyncio.Task[None] | None = None

    async def apply(revision: int, models: Mapping[str, ModelConfig]) -> None:
        nonlocal checking
        if checking is not None:
            checking.cancel()  # the files of the revision before: this one names them anew
        checking = asyncio.create_task(verify_named(store, follower.files))
        here, left_out = {}, dict(follower.left_out)
        for name, model in models.items():
            why = missing_program(model)
            if why is None:
                here[name] = model
            else:
                left_out[name] = why  # said with the revision's line
        try:
            outcome = await live.set_catalogue(here, revision, left_out)
        except InvalidInput as error:
            say(f"gateway: catalogue revision {revision} not applied here: {error}")
            return
        except Exception:  # a bug: said, and the next revision is applied all the same
            log.exception("gateway: catalogue revision %d: its change failed", revision)
            return
        left = "".join(f"; {name} left out here ({why})" for name, why in left_out.items())
        say(f"gateway: catalogue revision {revision}: {outcome.describe()}{left}")

    follower = CatalogueFollower(client, worker, apply, clock=LoopClock(), estimate=estimate)
    try:
        await follower.run()
    finally:
        if checking is not None:
            checking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checking


async def verify_named(store: FileStore, files: Sequence[ModelFile]) -> None:
    """Each of ``files`` that is here, verified (held: served to the peers that lack it);
    one that cannot be read is said and left, and the others are verified all the same
    (this runs beside the revision's apply, with nobody to raise to)."""
    for file in files:
        try:
            await store.verified(file)
        except Exception as error:
            log.warning("model file %s: not verified here (%s: %s)", file.name,
                        error.__class__.__name__, error)  # fmt: skip


def _share_size(model: ModelConfig, store: FileStore, models_dir: Path) -> int | str:
    """A catalogue model's ``vram = "auto"`` size on this host, to judge whether its GPUs
    hold it (``catalogue.share``): one naming its ``file`` asks for what it will here
    (the estimate from the file where it is here, else the file's size: it is copied
    before its lease); another, the estimate from its model file here, or why none."""
    if model.file is None:
        return estimate_here(model)
    return _sized(placed({model.name: model}, models_dir)[model.name], store)


async def _settle(living: asyncio.Task[None], grace_s: float) -> None:
    """Waits for the models' lives to end, once their replicas have stopped and released:
    the grace, the engine's stop time, the agent's margin and the release (a bound of
    twice the grace and a margin); what still runs then is cancelled."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(living), 2 * grace_s + 10.0)
    living.cancel()
    await asyncio.gather(living, return_exceptions=True)


async def _release(client: ArbiterClient, leases: list[str]) -> None:
    """Releases the leases of a previous run's servers (their groups are gone)."""
    for lease_id in leases:
        try:
            await client.release(lease_id)
            log.info("lease %s of the previous gateway released", lease_id)
        except ApiError:
            continue  # ended already
        except ControllerUnreachable as error:
            log.warning("lease %s of the previous gateway not released (%s)", lease_id, error)


async def _end_asked(client: ArbiterClient, asker: dict[str, str]) -> None:
    """Cancels the requests a previous gateway of this state directory (on this host) left
    queued, and releases its grants that no agent reports a process for (after
    :meth:`~.servers.process.ProcessLauncher.stop_leftovers`, none of its servers runs)."""
    host = socket.gethostname()[:100]
    try:
        leases = await client.leases()
    except (ApiError, ControllerUnreachable) as error:
        log.warning("the previous gateway's lease requests not looked up (%s)", error)
        return
    for lease in map(Lease.of, leases):
        metadata = lease.metadata
        ours = metadata.get("gateway") == host and all(
            metadata.get(k) == v for k, v in asker.items()
        )
        held = lease.held or lease.state == "revoking"
        if ours and (lease.pending or (held and not lease.supervised)):
            await _release(client, [lease.id])


async def _kill_when(hurry: asyncio.Event | None, launcher: ProcessLauncher) -> None:
    """A second stop signal: every server SIGKILLed now (its lease is then released)."""
    if hurry is not None:
        await hurry.wait()
        log.warning("stopping at once: SIGKILL to every model server")
        launcher.kill_all()


def beside_a_controller(config: GatewayConfig) -> GatewayConfig:
    """The config of a gateway run in the controller's process (``serve --local
    --models``): its connections, and its own to its model servers, are set aside from
    the process's descriptors before the controller sizes its cap, so that connections
    to either listener can never make the other unreachable."""
    upstream = _upstream_connections(config)
    share = set_aside_files(config.max_connections + upstream)
    return replace(config, max_connections=max(1, share - upstream))


def _upstream_connections(config: GatewayConfig) -> int:
    """The most connections to model servers at once: each replica's ``max_parallel``."""
    return sum(model.max_parallel * model.replicas for model in config.models.values())


def _peer_tls(config: GatewayConfig) -> ssl.SSLContext | None:
    """How this gateway reaches peers that listen over HTTPS: trusting its
    ``tls_client_ca`` (the cluster's CA), else ``GPU_ARBITER_CA``, and showing its own
    certificate (mutual TLS); without TLS of its own, as any client of the cluster does
    (``GPU_ARBITER_CA``, ``GPU_ARBITER_CLIENT_CERT``/``KEY``)."""
    if config.tls is None:
        return client_context()
    ca = config.tls.client_ca or os.environ.get(CA_ENV) or None
    return client_context(ca, config.tls.cert, config.tls.key)


def _uvicorn_config(app: GatewayApp, config: GatewayConfig, tls: Reloader | None) -> uvicorn.Config:
    """uvicorn with the port's bounds: the controller's head limits and header timeout
    (one implementation, ``web/connections.py``) and a cap on connections that leaves
    room, under the open-files limit, for the connections to the model servers."""
    room = max(1, raise_open_files_limit() - _upstream_connections(config))
    cap = min(config.max_connections, room)
    if cap < config.max_connections:
        log.warning("gateway: at most %d connections: the limit of open files allows no more", cap)
    limits = HeadLimits(config.max_header_bytes, config.max_headers, config.header_timeout_s)
    context = None if tls is None else tls.context
    return uvicorn.Config(
        app, http=bounded_http(limits), limit_concurrency=cap, log_config=None,
        ssl_context_factory=None if context is None else (lambda config, default: context),
        access_log=False, lifespan="off", timeout_graceful_shutdown=1, timeout_keep_alive=30,
        proxy_headers=False, server_header=False, date_header=False,  # the model server's
    )  # fmt: skip


def _hide(keys: tuple[ApiKey, ...]) -> None:
    """No log line shows an API key, whoever writes it (the handlers' redactors)."""
    for handler in logging.getLogger().handlers:
        for found in handler.filters:
            if isinstance(found, Redactor):
                for key in keys:
                    found.hide(key.key)


def _listen(host: str, port: int) -> Listener:
    sock = bound(host, port)
    sock.listen(2048)  # connections made before uvicorn serves wait rather than fail
    return sock
