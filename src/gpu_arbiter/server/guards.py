"""Requests a web page could make on a visitor's behalf are refused, with or without auth.

The decision is :func:`gpu_arbiter.web.guards.refusal` (the gateway's port takes the
same one); here it stands in front of every route of the controller, which answers in
its own error shape:

- ``Host`` must name this controller: a loopback name, an IP address, the address it
  listens on, this machine's names when it listens on every interface, the host of
  ``advertise_url``, or one of ``allowed_hosts`` (``*``: any). Else 421
  ``misdirected_request``.
- A change (POST, PUT, PATCH, DELETE) has an ``application/json`` body; one without a
  body says ``Content-Type: application/json`` or carries an ``Authorization: Bearer``
  header. Else 415 ``unsupported_media_type``. With auth, a change without a bearer
  token goes on to its route, whose 401 refuses it.

The project's client, and so the CLI, the agent and ``run``, and the dashboard send
``Content-Type: application/json`` with every change.

Inside these checks, a request to the API (``/v1/...``; not ``/v1/access``, which tells
a caller how to sign in) needs a valid token before its route reads anything of it
(:class:`TokenFirst`): without one it is 401, whatever its body or parameters, so a
caller without a token never learns the API's shape from a 422. What a role may do
is the routes' to say (403).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from ..store import StoreError
from ..web.guards import host_names, refusal
from .auth import Authenticator, Unauthorized
from .config import ServeConfig
from .errors import error_response

__all__ = ["RequestGuard", "TokenFirst", "allowed_hosts"]

OPEN_API_PATHS = frozenset({"/v1/access"})
"""Paths of the API answered without a token."""


def allowed_hosts(bound: str, config: ServeConfig) -> frozenset[str] | None:
    """The host names this controller answers to, besides IP addresses (None: any)."""
    names = [config.host, *config.allowed_hosts]
    if config.advertise_url:
        names.append(urlsplit(config.advertise_url).hostname or "")
    return host_names(bound, names)


class RequestGuard:
    """ASGI middleware: the ``Host`` check and the change's content type (see above)."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None, auth: bool) -> None:
        self.app = app
        self.hosts = hosts
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self._refusal(scope)
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> ASGIApp | None:
        headers = {name: value.decode("latin-1") for name, value in scope["headers"]}
        found = refusal(scope["method"], headers, self.hosts, auth=self.auth, json_only=True)
        if found is None:
            return None
        if found.status == 421:
            return error_response(
                421,
                "misdirected_request",
                f"Host {found.host!r} is not a name of this controller; add it to "
                "--allowed-hosts if it is",
                {"host": found.host},
            )
        why = "a change must be sent with Content-Type: application/json"
        return error_response(415, "unsupported_media_type", why)


class TokenFirst:
    """ASGI middleware: a request to the API without a valid token is answered 401
    before its route validates its body or parameters (see above)."""

    def __init__(self, app: ASGIApp, auth: Authenticator) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.auth.enabled and _needs_token(scope["path"]):
            try:
                self.auth.authenticate(_authorization(scope))
            except Unauthorized as error:
                await error_response(401, error.code, error.message)(scope, receive, send)
                return
            except StoreError:
                pass  # the route looks it up again, and answers what the store said
        await self.app(scope, receive, send)


def _needs_token(path: str) -> bool:
    return path.startswith("/v1/") and path not in OPEN_API_PATHS


def _authorization(scope: Scope) -> str | None:
    """The first ``Authorization`` header, as the routes read it."""
    for name, value in scope["headers"]:
        if name.lower() == b"authorization":
            return str(value.decode("latin-1"))
    return None
