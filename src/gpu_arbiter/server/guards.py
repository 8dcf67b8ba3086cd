"""Requests a web page could make on a visitor's behalf are refused, with or without auth.

A page on another site can make the visitor's browser send a form POST, or a plain
``fetch``, to ``http://127.0.0.1:7070``; with DNS rebinding its own name can even point
at this controller, same-origin. Two checks, in front of every route:

- ``Host`` must name this controller: a loopback name, an IP address (a rebinding
  attack has a name of its own), the address it listens on, this machine's names when
  it listens on every interface, the host of ``advertise_url``, or one of
  ``allowed_hosts`` (a deployment behind a name or a proxy; ``*``: any). Else 421
  ``misdirected_request``.
- A change (POST, PUT, PATCH, DELETE) must be one a browser sends only after a CORS
  preflight, which this server never answers: its body is ``application/json``; one
  without a body says ``Content-Type: application/json`` or carries an
  ``Authorization: Bearer`` header (browsers send neither on their own). Else 415
  ``unsupported_media_type``. With auth, a change without a bearer token goes on to
  its route, whose 401 refuses it (a client without a token learns that first).

The project's client, and so the CLI, the agent and ``run``, and the dashboard send
``Content-Type: application/json`` with every change.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from .config import ServeConfig
from .errors import error_response

__all__ = ["RequestGuard", "allowed_hosts"]

_CHANGES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def allowed_hosts(bound: str, config: ServeConfig) -> frozenset[str] | None:
    """The host names this controller answers to, besides IP addresses (None: any)."""
    if "*" in config.allowed_hosts:
        return None
    names = set(_LOOPBACK_NAMES) | {config.host, bound, *config.allowed_hosts}
    if bound in ("0.0.0.0", "::"):
        names |= {socket.gethostname(), socket.getfqdn()}
    if config.advertise_url:
        names.add(urlsplit(config.advertise_url).hostname or "")
    return frozenset(_normal(name) for name in names if name)


def _normal(host: str) -> str:
    return host.strip().lower().rstrip(".")


def _host_name(header: str) -> str:
    """The host of a ``Host`` header, without its port or an IPv6 address's brackets."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return _normal(header.rpartition(":")[0] if header.count(":") == 1 else header)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class RequestGuard:
    """ASGI middleware: the ``Host`` check and the change's content type (see above)."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None, auth: bool) -> None:
        self.app = app
        self.hosts = hosts
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> ASGIApp | None:
        headers = {name: value.decode("latin-1") for name, value in scope["headers"]}
        host = headers.get(b"host")
        if host is not None and not self._host_ok(host):
            return error_response(
                421,
                "misdirected_request",
                f"Host {host!r} is not a name of this controller; add it to "
                "--allowed-hosts if it is",
                {"host": host},
            )
        if scope["method"] in _CHANGES and not _sent_by_a_program(headers, self.auth):
            return error_response(
                415,
                "unsupported_media_type",
                "a change must be sent with Content-Type: application/json",
            )
        return None

    def _host_ok(self, header: str) -> bool:
        if self.hosts is None:
            return True
        name = _host_name(header)
        return name in self.hosts or _is_address(name)


def _sent_by_a_program(headers: dict[bytes, str], auth: bool) -> bool:
    """A JSON body, or none with the JSON content type or a bearer token: what a browser
    sends only after a CORS preflight. With ``auth``, no bearer token: the route's 401."""
    media_type = headers.get(b"content-type", "").partition(";")[0].strip().lower()
    if media_type == "application/json":
        return True
    bearer = headers.get(b"authorization", "")[:7].lower() == "bearer "
    if auth and not bearer:
        return True
    has_body = headers.get(b"content-length", "0") != "0" or b"transfer-encoding" in headers
    return not has_body and bearer
