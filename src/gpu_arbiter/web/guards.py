"""Requests a web page could make on a visitor's behalf: the decision, for every listener.

A page on another site can make the visitor's browser send a form POST, or a plain
``fetch``, to ``http://127.0.0.1:PORT``; with DNS rebinding its own name can even point
at this listener, same-origin. Two checks, in front of every route:

- ``Host`` must name this listener: a loopback name, an IP address (a rebinding attack
  has a name of its own), the address it listens on, this machine's names when it
  listens on every interface, or one of the names it was given (a deployment behind a
  name or a proxy; ``*``: any). Else 421 ``misdirected_request``.
- A change (POST, PUT, PATCH, DELETE) must be one a browser sends only after a CORS
  preflight, which these servers never answer: its body is ``application/json``, or it
  carries an ``Authorization: Bearer`` header (browsers send neither cross-site on
  their own). Else 415 ``unsupported_media_type``. With auth, a change without a
  bearer token goes on to its route, whose 401 refuses it (a client without a token
  learns that first). A listener that takes only JSON (the controller) refuses a body
  of another type even with a token; one that relays bodies (the gateway: multipart
  uploads, a model server's own types) lets a bearer token vouch for any body.

:func:`refusal` decides; each listener answers in its own error shape.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Refusal", "host_names", "media_type", "refusal"]

_CHANGES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused before any route: ``status`` (421, 415), ``code`` and
    ``host`` (the ``Host`` header refused, for 421)."""

    status: int
    code: str
    host: str | None = None


def host_names(bound: str, names: Iterable[str]) -> frozenset[str] | None:
    """The host names a listener bound to ``bound`` answers to besides IP addresses:
    loopback names, ``bound``, ``names`` (None: any, when they hold ``*``)."""
    given = [name for name in names if name]
    if "*" in given:
        return None
    found = set(_LOOPBACK_NAMES) | {bound, *given}
    if bound in ("0.0.0.0", "::"):
        found |= {socket.gethostname(), socket.getfqdn()}
    return frozenset(_normal(name) for name in found if name)


def refusal(
    method: str,
    headers: Mapping[bytes, str],
    hosts: frozenset[str] | None,
    *,
    auth: bool,
    json_only: bool,
) -> Refusal | None:
    """The refusal of a request with ``headers`` (lower-case names), or None. ``auth``:
    the listener checks bearer tokens itself; ``json_only``: it takes JSON bodies only."""
    host = headers.get(b"host")
    if host is not None and hosts is not None and not _host_ok(host, hosts):
        return Refusal(421, "misdirected_request", host)
    if method in _CHANGES and not _sent_by_a_program(headers, auth, json_only):
        return Refusal(415, "unsupported_media_type")
    return None


def media_type(headers: Mapping[bytes, str]) -> str:
    """The ``Content-Type``'s media type, lower-case, without its parameters."""
    return headers.get(b"content-type", "").partition(";")[0].strip().lower()


def _sent_by_a_program(headers: Mapping[bytes, str], auth: bool, json_only: bool) -> bool:
    """A JSON body, or a bearer token (with ``json_only``: and no body): what a browser
    sends only after a CORS preflight. With ``auth``, no bearer token: the route's 401."""
    if media_type(headers) == "application/json":
        return True
    bearer = headers.get(b"authorization", "")[:7].lower() == "bearer "
    if auth and not bearer:
        return True
    has_body = headers.get(b"content-length", "0") != "0" or b"transfer-encoding" in headers
    return bearer and not (json_only and has_body)


def _normal(host: str) -> str:
    return host.strip().lower().rstrip(".")


def _host_name(header: str) -> str:
    """The host of a ``Host`` header, without its port or an IPv6 address's brackets."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return _normal(header.rpartition(":")[0] if header.count(":") == 1 else header)


def _host_ok(header: str, hosts: frozenset[str]) -> bool:
    name = _host_name(header)
    return name in hosts or _is_address(name)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
