"""The FastAPI application factory: one controller, one authenticator, no globals."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from ..controller import Controller
from ..store import SqliteStore
from .auth import Authenticator
from .catalogue import BODY_BYTES, CatalogueReader
from .catalogue import router as catalogue_router
from .cluster import LoadAskers, adoptable
from .cluster import router as cluster_router
from .durable import DurableAnswers
from .errors import error_response, install_error_handlers
from .events import EventFeed
from .gateways import GatewayRegistry
from .guards import RequestGuard, TokenFirst
from .history import History
from .limits import BodyLimit, ClientLimits, Slots
from .metrics import metrics_registry, refusal_counter, render
from .responses import FiniteJSONResponse
from .retention import prune_ended
from .routes import router
from .schemas import ErrorOut

__all__ = ["create_app"]

DASHBOARD = Path(__file__).with_name("dashboard")
DOCS_ASSETS = "/docs-assets"


def create_app(
    controller: Controller,
    auth: Authenticator,
    *,
    max_body_bytes: int = 64 * 1024,
    client_limits: ClientLimits | None = None,
    standby: bool = False,
    allowed_hosts: frozenset[str] | None = None,
    retention_s: float = 7 * 86400.0,
    history: History | None = None,
    admin_token_file: Path | None = None,
) -> FastAPI:
    """The controller is started in the app's lifespan and closed (with its store) after.
    With ``standby``, it starts as a standby (a shared store's leader is elected beside
    the server: see ``ha.py``). ``allowed_hosts``: the names a request's ``Host`` may
    give besides IP addresses (None: any; see ``guards.py``). Ended leases are forgotten
    ``retention_s`` after they ended (0: kept; see ``retention.py``). ``history`` samples
    the controller while the app runs (default: every 10 s, the last hour);
    ``admin_token_file`` is where ``GET /v1/access`` tells a local caller to find the
    admin token."""
    kept = history or History()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if standby:
            controller.mirror()
        else:
            controller.start()
        if isinstance(controller.store, SqliteStore) and not standby:
            controller.changes.commit_in_groups()  # its commits run off the loop, several at once
        stop = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as background:
                background.create_task(prune_ended(controller, retention_s, stop))
                background.create_task(kept.run(controller, stop))
                try:
                    yield
                finally:
                    stop.set()
        finally:
            controller.close()
            await controller.changes.flush()
            controller.store.close()

    # /docs (Swagger UI) with its scripts and styles served from the package (fastapi-offline
    # ships them), under /docs-assets: it works with no other host. No /redoc: its page
    # fetches a logo from its maker's site.
    app = FastAPIOffline(
        redoc_url=None,
        title="gpu-arbiter",
        version=__version__,
        summary="The single authority for GPU memory: leases of VRAM, granted safely.",
        lifespan=lifespan,
        static_url=DOCS_ASSETS,
        default_response_class=FiniteJSONResponse,
    )
    app.state.controller = controller
    app.state.auth = auth
    app.state.history = kept
    app.state.admin_token_file = admin_token_file
    # The reports in memory, like the workers' live figures; who holds each name, stored.
    app.state.gateways = GatewayRegistry(controller.names)
    app.state.gateways.token_exists = auth.exists  # a revoked token's names are free
    app.state.gateways.adoptable = functools.partial(adoptable, controller)
    app.state.load_askers = LoadAskers()  # who asked for each cluster load
    app.state.catalogue_reader = CatalogueReader()  # the current catalogue's models, read once
    bounds = client_limits or ClientLimits()
    app.state.event_feed = EventFeed(controller)
    app.state.streams = Slots("streams", bounds.max_streams_per_token, bounds.max_streams)
    app.state.long_polls = Slots(
        "long_polls", bounds.max_long_polls_per_token, bounds.max_long_polls
    )
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(cluster_router)
    app.include_router(catalogue_router)

    @app.get("/healthz", summary="The process is up")
    async def healthz() -> FiniteJSONResponse:
        return FiniteJSONResponse({"status": "ok"})

    @app.get(
        "/readyz",
        summary="The controller accepts changes (a standby does not)",
        responses={503: {"model": ErrorOut, "description": "Not ready, or a standby"}},
    )
    async def readyz() -> FiniteJSONResponse:
        if controller.gate.standby:
            leader = {"leader": controller.gate.leader_url} if controller.gate.leader_url else {}
            return error_response(503, "not_leader", "this controller is a standby", leader)
        if controller.gate.broken is not None:
            return error_response(503, "unavailable", controller.gate.broken)
        if not controller.gate.started:
            return error_response(503, "unavailable", "the controller is not started")
        return FiniteJSONResponse({"status": "ready"})

    registry = metrics_registry(controller)
    app.state.refused = refusal_counter(registry)

    @app.get(
        "/metrics",
        summary="Prometheus text exposition (any valid token)",
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus text format",
                "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
            },
            401: {"model": ErrorOut, "description": "No valid token"},
        },
    )
    async def metrics(request: Request) -> Response:
        auth.authenticate(request.headers.get("authorization"))
        return Response(render(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def dashboard() -> FileResponse:
        """The dashboard: plain HTML/CSS/JS shipped in the package; it asks for a token."""
        return FileResponse(DASHBOARD / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/dashboard", StaticFiles(directory=DASHBOARD), name="dashboard")
    app.add_middleware(DurableAnswers, controller=controller)
    larger = {"/v1/catalogue": max(max_body_bytes, BODY_BYTES)}  # a catalogue's text
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, larger=larger)
    app.add_middleware(TokenFirst, auth=auth)  # 401 before a body is read or validated
    app.add_middleware(RequestGuard, hosts=allowed_hosts, auth=auth.enabled)  # the outermost
    return app
