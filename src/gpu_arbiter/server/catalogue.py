"""The cluster's catalogue over HTTP: the models declared once, at the controller.

    PUT /v1/catalogue                  an admin applies a catalogue's text: checked whole
                                       first (422 naming file, line and field; nothing
                                       stored), then stored as the next revision (201),
                                       or nothing new for the current text (200)
    GET /v1/catalogue                  the current revision: its text and its models;
                                       ``after=N&wait=S``: a long-poll for one above N
    GET /v1/catalogue/history          every revision, newest first, without its text
    GET /v1/catalogue/revisions/{n}    one revision, with its text

Its text (each model's command, environment and file URL) is read by an admin and by
gateways only (a gateway follows it with its gateway token and the long-poll): a client
or a worker token gets 403, as for the cluster's view; the history, without the texts,
is open to every role. A standby answers reads from its copy (it has every revision the leader
stored) and sends an apply to the leader (307).

The controller keeps a catalogue's text opaque (``controller/catalogue.py``); what it
says is read here by the gateway package's parser (``gateway/catalogue.py``), imported
at the first call that needs it, so that a controller that is never asked for a
catalogue never loads the gateway's modules.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request

from ..controller import Controller
from ..core import NotFound
from ..store import CatalogueRevision
from . import routes
from . import schemas as s
from .auth import Principal, refuse
from .events import EventFeed
from .limits import Slots
from .responses import FiniteJSONResponse

__all__ = ["BODY_BYTES", "CatalogueReader", "router"]

MAX_WAIT_S = 60.0
RECHECK_S = 1.0
"""How often a long-poll looks whether the server is stopping."""
BODY_BYTES = 4 * s.CATALOGUE_TEXT_BYTES
"""The body of ``PUT /v1/catalogue``, at most: a text of the largest size, escaped in
JSON (a quote or a newline takes two bytes there)."""

router = APIRouter(prefix="/v1", responses=routes.ERRORS, route_class=s.StrictJsonRoute)


@router.put(
    "/catalogue",
    response_model=s.CatalogueAppliedOut,
    status_code=201,
    summary="Apply the cluster's catalogue: 201 a new revision, 200 unchanged",
    responses={
        200: {
            "model": s.CatalogueAppliedOut,
            "description": "The text is the current revision's: no new revision",
        },
        422: {
            "model": s.ErrorOut,
            "description": "The catalogue is refused whole: ``details`` name the file, the "
            "line and the field, and the reason; nothing is stored",
        },
    },
)
async def apply_catalogue(body: s.CatalogueIn, request: Request) -> FiniteJSONResponse:
    """An admin's. The text is read as a catalogue first (``[models.NAME]`` tables, as a
    gateway's models.toml has them, and where each may run); a catalogue with any error
    is refused whole. Stored, with a ``catalogue.applied`` event, before the answer."""
    ctl, who = routes.context(request)
    if not who.is_admin:
        raise refuse(who, "apply the cluster's catalogue")
    from ..gateway.catalogue import parse_catalogue  # the first call loads the parser

    # Read off the event loop (up to 1 MiB of TOML); CatalogueError: 422, naming file,
    # line and field.
    await asyncio.to_thread(parse_catalogue, body.text, body.file)
    revision, new = ctl.catalogue.apply(body.text, body.file, who.id)
    answer = s.catalogue_revision_out(revision, text=False)
    answer["outcome"] = "applied" if new else "unchanged"
    return FiniteJSONResponse(answer, status_code=201 if new else 200)


@router.get(
    "/catalogue",
    response_model=s.CatalogueOut,
    summary="The cluster's catalogue, current revision; long-poll for a newer one",
    responses={404: {"model": s.ErrorOut, "description": "No catalogue was ever applied"}},
)
async def get_catalogue(
    request: Request,
    after: Annotated[int, Query(ge=0, le=1 << 62)] = 0,
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)] = 0.0,
) -> FiniteJSONResponse:
    """With ``wait=SECONDS`` (at most 60), answers as soon as the current revision is
    above ``after``, or when the wait ends with the current one (404 while none was
    ever applied)."""
    ctl, who = routes.context(request)
    _may_read(who)
    current = ctl.catalogue.current
    if wait > 0 and (current is None or current.revision <= after):
        long_polls: Slots = request.app.state.long_polls
        with long_polls.hold(who.id):
            current = await _wait_after(ctl, request.app.state.event_feed, after, wait)
    if current is None:
        raise NotFound("no catalogue was ever applied: gpu-arbiter catalogue apply FILE")
    reader: CatalogueReader = request.app.state.catalogue_reader
    answer = s.catalogue_revision_out(current, text=True)
    return FiniteJSONResponse({**answer, **reader.models(current)})


def _may_read(who: Principal) -> None:
    """An admin or a gateway reads a catalogue's text: its commands, environments and
    file URLs are the cluster's, not a client's (403 naming the role)."""
    if who.role not in ("admin", "gateway"):
        raise refuse(who, "read the cluster's catalogue", needs="an admin or a gateway token")


async def _wait_after(
    ctl: Controller, feed: EventFeed, after: int, wait_s: float
) -> CatalogueRevision | None:
    """The long-poll, ended too (with the current revision) once the server begins to
    stop: its event streams' end (``EventFeed.close``) comes before uvicorn waits for the
    requests in flight, which a long-poll of a gateway that went away would outlast."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        left = deadline - loop.time()
        current = await ctl.catalogue.wait_after(after, min(left, RECHECK_S))
        if left <= RECHECK_S or feed.closed or (current and current.revision > after):
            return current


@router.get(
    "/catalogue/history",
    response_model=list[s.CatalogueRevisionOut],
    summary="Every revision of the cluster's catalogue, newest first, without its text",
)
async def catalogue_history(request: Request) -> FiniteJSONResponse:
    ctl, _who = routes.context(request)
    revisions = ctl.catalogue.history()
    return FiniteJSONResponse([s.catalogue_revision_out(r, text=False) for r in revisions])


@router.get(
    "/catalogue/revisions/{number}",
    response_model=s.CatalogueRevisionOut,
    summary="One revision of the cluster's catalogue, with its text",
)
async def catalogue_revision(
    number: Annotated[int, Path(ge=1, le=1 << 62)], request: Request
) -> FiniteJSONResponse:
    ctl, who = routes.context(request)
    _may_read(who)
    found = ctl.catalogue.revision(number)
    if found is None:
        raise NotFound(f"the catalogue has no revision {number}", revision=number)
    return FiniteJSONResponse(s.catalogue_revision_out(found, text=True))


@dataclass(slots=True)
class CatalogueReader:
    """What the current revision's text says, read once per revision (the last one read
    is kept: a text is the same catalogue whenever it is read)."""

    _last: tuple[str, dict[str, Any]] | None = field(default=None)

    def models(self, revision: CatalogueRevision) -> dict[str, Any]:
        """``models`` as readers see them; where this controller cannot read the text
        (one a newer version applied), no models and the ``problem``."""
        if self._last is not None and self._last[0] == revision.sha256:
            return dict(self._last[1])
        from ..gateway.catalogue import CatalogueError, describe, parse_catalogue

        try:
            read: dict[str, Any] = {
                "models": describe(parse_catalogue(revision.text, revision.file))
            }
        except CatalogueError as error:
            read = {"models": None, "problem": str(error)}
        self._last = (revision.sha256, read)
        return dict(read)
