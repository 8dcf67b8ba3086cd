"""Every error leaves as ``{"error": {"code", "message", "details"}}`` with its status.

This is the one place that maps the exception tree to HTTP statuses.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from ..controller import NotLeader, ServiceUnavailable, TooManyRequests
from ..core import (
    ArbiterError,
    Conflict,
    InvalidInput,
    NotFound,
    Unschedulable,
)
from .auth import Forbidden, Unauthorized
from .responses import FiniteJSONResponse

__all__ = ["error_response", "install_error_handlers"]

log = logging.getLogger("gpu_arbiter.server")

RETRY_AFTER_S = 2
"""A refusal for a limit (429) or for want of what is needed now (503) says to retry after
this many seconds."""

_STATUS: tuple[tuple[type[ArbiterError], int], ...] = (
    (Unauthorized, 401),
    (Forbidden, 403),
    (NotFound, 404),
    (Conflict, 409),
    (InvalidInput, 422),
    (Unschedulable, 422),
    (TooManyRequests, 429),
    (ServiceUnavailable, 503),
)
_HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


def error_response(
    status: int, code: str, message: str, details: dict[str, Any] | None = None
) -> FiniteJSONResponse:
    """The one rendering of an error. A message may echo the request's text (a field's
    name, a metadata key), which need not be valid Unicode: what cannot be written as
    UTF-8 (a lone surrogate) is written as its escape (``\\ud800``), never a 500."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    body = {"error": {"code": code, "message": message, "details": details or {}}}
    try:
        return FiniteJSONResponse(body, status_code=status, headers=headers)
    except UnicodeEncodeError:
        return FiniteJSONResponse(_writable(body), status_code=status, headers=headers)


def _writable(value: Any) -> Any:
    """``value`` with every text made encodable: lone surrogates backslash-escaped."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_writable(k): _writable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_writable(item) for item in value]
    return value


def _details(error: ArbiterError) -> dict[str, Any]:
    if isinstance(error, Unschedulable):
        return {"reason": error.reason.as_dict()}
    return {k: v for k, v in error.details.items() if isinstance(v, str | int | float | bool)}


async def _arbiter_error(request: Request, error: Exception) -> FiniteJSONResponse:
    assert isinstance(error, ArbiterError)
    if isinstance(error, NotLeader) and error.details.get("leader"):
        return _to_leader(request, error)
    status = next((s for kind, s in _STATUS if isinstance(error, kind)), 400)
    response = error_response(status, error.code, error.message, _details(error))
    if status in (429, 503):
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    if status == 429:
        refused = getattr(request.app.state, "refused", None)
        if refused is not None:
            refused(str(error.details.get("limit", "other")))
    return response


def _to_leader(request: Request, error: NotLeader) -> FiniteJSONResponse:
    """A standby redirects a change to the leader: 307 keeps the method and the body,
    so ``curl -L`` and any HTTP client that follows redirects just work."""
    leader = str(error.details["leader"]).rstrip("/")
    target = leader + request.url.path + (f"?{request.url.query}" if request.url.query else "")
    response = error_response(307, error.code, error.message, _details(error))
    response.headers["Location"] = target
    response.headers["X-GPU-Arbiter-Leader"] = leader
    return response


async def _validation_error(request: Request, error: Exception) -> FiniteJSONResponse:
    assert isinstance(error, RequestValidationError)
    problems = [
        {
            "field": (e.get("ctx") or {}).get("field")  # a place inside a free-form field
            or ".".join(str(part) for part in e.get("loc", ()) if part != "body"),
            "message": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in error.errors()
    ]
    if any(p["type"] == "json_invalid" for p in problems):
        return error_response(400, "malformed_json", "the body is not valid JSON")
    first = problems[0] if problems else {"field": "", "message": "invalid"}
    message = f"{first['field'] or 'body'}: {first['message']}"
    return error_response(422, "invalid_input", message, {"errors": problems})


async def _http_error(request: Request, error: Exception) -> FiniteJSONResponse:
    assert isinstance(error, HTTPException)
    code = _HTTP_CODES.get(error.status_code, "http_error")
    return error_response(error.status_code, code, str(error.detail))


async def _unexpected(request: Request, error: Exception) -> FiniteJSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return error_response(500, "internal", "internal error; see the controller's log")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ArbiterError, _arbiter_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
