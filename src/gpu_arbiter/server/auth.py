"""Bearer tokens and roles.

    admin    everything
    worker   bound to one worker name: registers and heartbeats as that worker only
    gateway  bound to one worker name: reports the gateway beside that worker, asks for
             the cluster's loads (placed on any host), holds the cluster's leases
             granted on that worker and its own leases there; never registers or
             heartbeats the worker (that is its agent's worker token)
    client   asks for leases; renews, readies, idles, shrinks and releases only its own

A worker token does not serve as its host's gateway, nor a gateway token as its agent:
the two run as separate processes (often as separate users), and each token holds only
what its process needs: a leaked gateway token cannot report GPU memory (I2) or stop
processes, a leaked worker token cannot relay requests or hold the cluster's leases,
and either can be revoked alone.

A token is ``gat_`` + 32 random bytes (URL-safe). Only its SHA-256 digest is
stored; a presented token is hashed and the digests compared in constant time.
Tokens are never logged. A token known to the server is looked up in the store again
at most :data:`TOKEN_RECHECK_S` after it was last, so one revoked (``gpu-arbiter token
revoke``, from any process) stops working within that time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core import ArbiterError
from ..store import Store, StoreError, TokenRecord

__all__ = [
    "ROLES",
    "Authenticator",
    "Forbidden",
    "Principal",
    "Unauthorized",
    "create_token",
    "ensure_admin_token",
    "refuse",
]

ROLES = ("admin", "worker", "gateway", "client")
BOUND = ("worker", "gateway")
"""Roles whose token is bound to one worker name."""
MAY = {
    "admin": "do everything",
    "client": "ask for leases and renew, ready, idle, shrink and release its own",
    "worker": "register and heartbeat its worker and report its operations",
    "gateway": (
        "report gateways beside its worker, ask for the cluster's loads and hold the "
        "leases granted on its worker"
    ),
}
"""What each role may do, in words, for a refusal."""
_PREFIX = "gat_"

TOKEN_RECHECK_S = 1.0
"""How long a token found in the store is trusted before it is looked up again."""


class Unauthorized(ArbiterError):
    """No token, or a token the controller does not know."""

    code = "unauthorized"


class Forbidden(ArbiterError):
    """A known token whose role may not do this."""

    code = "forbidden"


@dataclass(frozen=True, slots=True)
class Principal:
    id: str
    role: str
    worker: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def described(self) -> str:
        """``a gateway token of worker box-3``, as a refusal names the caller."""
        bound = f" of worker {self.worker}" if self.worker else ""
        return f"a{'n' if self.role == 'admin' else ''} {self.role} token{bound}"


def refuse(who: Principal, doing: str, **details: object) -> Forbidden:
    """403 naming the caller's role and what that role may do instead."""
    return Forbidden(
        f"{who.described()} may not {doing}; it may {MAY.get(who.role, 'nothing')}",
        role=who.role,
        **details,
    )


ANONYMOUS_ADMIN = Principal("anonymous", "admin")


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(store: Store, role: str, worker: str | None = None) -> tuple[str, TokenRecord]:
    """A new token of ``role`` (a worker or gateway token is bound to ``worker``); returns
    the token itself — shown once, never stored — and its record."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    if (role in BOUND) != (worker is not None):
        raise ValueError("a worker or gateway token needs --worker NAME; other roles take none")
    token = _PREFIX + secrets.token_urlsafe(32)
    record = TokenRecord(
        id=f"{role}-{secrets.token_hex(4)}",
        digest=_digest(token),
        role=role,
        worker=worker,
        created_at=time.time(),
    )
    store.put_token(record)
    return token, record


def ensure_admin_token(state_dir: Path, store: Store) -> tuple[Path, bool]:
    """``admin.token`` in ``state_dir`` (mode 0600), created on first start. Returns its path
    and whether it was created now."""
    path = state_dir / "admin.token"
    if path.exists():
        path.chmod(0o600)
        token = path.read_text().strip()
        if store.token(_digest(token)) is None:  # a fresh store next to an old file
            store.put_token(TokenRecord("admin", _digest(token), "admin", None, time.time()))
        return path, False
    token, _ = create_token(store, "admin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return path, True


class Authenticator:
    """Finds the principal of an ``Authorization: Bearer ...`` header."""

    def __init__(
        self,
        store: Store,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.enabled = enabled
        self._clock = clock
        self._cache: dict[str, tuple[TokenRecord, float]] = {}  # digest -> record, found at

    def authenticate(self, header: str | None) -> Principal:
        if not self.enabled:
            return ANONYMOUS_ADMIN
        if not header:
            raise Unauthorized("missing bearer token (Authorization: Bearer ...)")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > 256:
            raise Unauthorized("malformed Authorization header; expected 'Bearer TOKEN'")
        digest = _digest(token)
        record = self._record(digest)
        if record is None or not hmac.compare_digest(record.digest, digest):
            raise Unauthorized("unknown token")
        return Principal(record.id, record.role, record.worker)

    def exists(self, token_id: str) -> bool:
        """Whether the token ``token_id`` is still known (not revoked). A store that
        cannot answer counts it as known: nothing is freed on a guess."""
        try:
            return any(record.id == token_id for record in self.store.tokens())
        except StoreError:
            return True

    def _record(self, digest: str) -> TokenRecord | None:
        """The token's record, from the cache while it is fresh, else from the store
        (tokens are created and revoked by the CLI, in other processes). A store that
        cannot answer leaves a known token trusted until it can."""
        now = self._clock()
        cached = self._cache.get(digest)
        if cached is not None and now - cached[1] < TOKEN_RECHECK_S:
            return cached[0]
        try:
            record = self.store.token(digest)
        except StoreError:
            if cached is None:
                raise
            return cached[0]
        if record is None:
            self._cache.pop(digest, None)
        else:
            self._cache[digest] = (record, now)
        return record
