"""Who may use the gateway's port: API keys, the ``Host`` check, the simple-request rule.

In front of every request, in this order (the first that fails answers, in OpenAI's
error shape):

1. ``Host`` names this gateway (loopback names, IP addresses, the address it listens
   on, ``[gateway] allowed_hosts``): else 421 ``misdirected_request`` (DNS rebinding).
2. A POST, PUT, PATCH or DELETE has a JSON body or carries ``Authorization: Bearer``:
   else 415 ``unsupported_media_type`` (a cross-site form or ``fetch`` cannot do either
   without a CORS preflight, which the gateway never answers). A multipart upload
   therefore carries a bearer header; the OpenAI SDKs always send one.
3. With keys configured, ``Authorization: Bearer KEY`` is one of them: else 401
   ``invalid_api_key``. ``/healthz`` is open; everything else, ``/metrics`` included,
   needs a key.
4. With keys configured, ``/admin/...`` (unload, pin, unpin) needs a key whose role is
   ``admin``: else 403 ``permission_denied``. Without keys (loopback only) it is open
   like the rest.

A request another gateway relays carries that gateway's authenticated header
(``x-arbiter-peer``, ``peer_identity.py``) instead of a key; verified, it opens the
relayed model requests only (the OpenAI routes and ``/models/...``), never ``/metrics``,
``/admin/...`` or the listing (403 ``permission_denied``: :data:`PEER_ONLY`). The
priority a peer names (``x-arbiter-priority``: what its front door's key gave its
caller) is capped at :attr:`Access.max_priority`, the highest any key of this gateway
gives: a peer never raises a request above what a caller here could ask.

The rules are :mod:`gpu_arbiter.web.guards`' (the controller's). A key is compared by
its SHA-256 digest with :func:`hmac.compare_digest` against every configured key,
whatever matched first: the time taken says nothing about a key, not even its length.
Keys are never logged and never shown (``repr`` hides them).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

from ...core import InvalidInput
from ...paths import is_loopback
from ...web.guards import host_names, refusal

__all__ = [
    "ADMIN_PREFIX",
    "PEER_ONLY",
    "ROLES",
    "Access",
    "ApiKey",
    "Denial",
    "check_exposure",
]

OPEN_PATHS = frozenset({"/healthz"})
"""Answered without a key: a load balancer's health check has none."""
ADMIN_PREFIX = "/admin/"
"""Routes that change what the gateway runs for everyone: an admin key's only."""
ROLES = ("admin", "user")


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key a caller may present. ``name`` says whose it is (``chat-ui``); ``role``
    (``user`` or ``admin``) whether it may also use the admin routes; ``priority`` (0..1000)
    the class of its requests (an interactive chat key, a batch indexing key; None: the
    model's). A request's priority only ever raises a lease's above its model's (see
    :meth:`gpu_arbiter.gateway.servers.model.ModelServer.lease_priority`)."""

    name: str
    key: str = field(repr=False)
    role: str = "user"
    priority: int | None = None

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(self.key.encode()).digest()


@dataclass(frozen=True, slots=True)
class Denial:
    """A request refused before any route: ``status``, OpenAI's error ``code``, why."""

    status: int
    code: str
    message: str


PEER_ONLY = Denial(
    403,
    "permission_denied",
    "a peer's x-arbiter-peer opens relayed model requests only; this route needs "
    "an API key of [gateway] api_keys",
)
"""A peer's verified header on any route but a model's."""


class Access:
    """The three checks above, for one gateway."""

    def __init__(self, keys: tuple[ApiKey, ...], bound: str, names: tuple[str, ...]) -> None:
        """``bound``: the address listened on; ``names``: the host names to answer to
        besides loopback names and addresses (the configured host, ``allowed_hosts``)."""
        self._keys = tuple((key.digest, key) for key in keys)
        self.hosts = host_names(bound, names)
        given = [key.priority for key in keys if key.priority is not None]
        self.max_priority: int | None = max(given, default=None)
        """The highest priority a key here gives (None: none gives one, every caller
        has the model's): the most a peer's ``x-arbiter-priority`` is believed."""

    @property
    def auth(self) -> bool:
        return bool(self._keys)

    def check(self, method: str, path: str, headers: Mapping[bytes, str]) -> Denial | None:
        """Why the request may not go on (None: it may); ``headers``' names lower-case."""
        found = refusal(method, headers, self.hosts, auth=self.auth, json_only=False)
        if found is not None and found.status == 421:
            return Denial(
                421,
                "misdirected_request",
                f"Host {found.host!r} is not a name of this gateway; add it to "
                "[gateway] allowed_hosts if it is",
            )
        if found is not None:
            return Denial(
                415,
                "unsupported_media_type",
                "send a JSON body (Content-Type: application/json), or an Authorization: "
                "Bearer header with any other body",
            )
        if not self.auth or path in OPEN_PATHS:
            return None
        key = self.key_of(headers)
        if key is None:
            given = "a wrong API key" if b"authorization" in headers else "no API key"
            return Denial(
                401,
                "invalid_api_key",
                f"{given}: send Authorization: Bearer KEY with a key of [gateway] api_keys",
            )
        if path.startswith(ADMIN_PREFIX) and key.role != "admin":
            return Denial(
                403,
                "permission_denied",
                f"the key {key.name!r} is a user key: {ADMIN_PREFIX}... needs a key of "
                '[[gateway.keys]] with role = "admin"',
            )
        return None

    def key_of(self, headers: Mapping[bytes, str]) -> ApiKey | None:
        """The configured key the request's bearer header presents, or None."""
        scheme, _, presented = headers.get(b"authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        digest = hashlib.sha256(presented.strip().encode("latin-1")).digest()
        found = None
        for known, key in self._keys:  # all of them, whichever matches
            if hmac.compare_digest(digest, known):
                found = key
        return found


def check_exposure(host: str, keys: tuple[ApiKey, ...]) -> None:
    """Refuses (:class:`InvalidInput`) to listen beyond loopback without API keys, as the
    controller refuses to without tokens: anyone who can reach the port could start
    models on this host's GPUs."""
    if not keys and not is_loopback(host):
        raise InvalidInput(
            "gateway.api_keys",
            f"refusing to listen on {host} without API keys; set [gateway] api_keys or "
            "api_key_file, or listen on a loopback address",
        )
