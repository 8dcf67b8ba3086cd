"""Which token the command-line tools send, and what a refusal says.

Like ``kubectl`` reading its kubeconfig, a command given no token (no ``--token``, no
``GPU_ARBITER_TOKEN``) that talks to a controller on this machine (every controller URL
a loopback address) uses the admin token of the state directory on this machine:
``$GPU_ARBITER_STATE_DIR/admin.token``, else ``~/.local/state/gpu-arbiter/admin.token``
(what ``gpu-arbiter serve`` creates there). It is sent to no other host. A refusal for
a missing or unknown token (401) says where tokens come from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..client import ApiError, parse_urls
from ..paths import ADMIN_TOKEN_FILE, STATE_DIR_ENV, is_loopback, state_dir

__all__ = ["TOKEN_HELP", "Credentials", "credentials", "refusal"]

TOKEN_ENV = "GPU_ARBITER_TOKEN"
TOKEN_HELP = (
    "Bearer token. Default for a controller on this machine: its admin token, "
    "admin.token in $GPU_ARBITER_STATE_DIR or ~/.local/state/gpu-arbiter."
)


@dataclass(frozen=True, slots=True)
class Credentials:
    token: str | None
    found_in: Path | None = None  # the admin token file it came from, if found by itself


def credentials(controller: str | None, token: str | None) -> Credentials:
    """The token given (``--token`` or ``GPU_ARBITER_TOKEN``), else this machine's admin
    token when every controller URL is on this machine and the file can be read."""
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is not None:
        return Credentials(token)
    if not all(is_loopback(urlsplit(url).hostname or "") for url in parse_urls(controller)):
        return Credentials(None)
    path = state_dir() / ADMIN_TOKEN_FILE
    try:
        found = path.read_text(encoding="utf-8").strip()
    except OSError:
        return Credentials(None)
    return Credentials(found or None, path if found else None)


def refusal(error: ApiError, used: Credentials | None = None) -> str:
    """``401 unauthorized: unknown token`` and, for a 401, where tokens come from."""
    text = f"{error.status} {error.code}: {error}"
    if error.status != 401:
        return text
    if used is not None and used.found_in is not None:
        return (
            f"{text} (the admin token of {used.found_in} was sent: this controller keeps its "
            f"state elsewhere; give its admin token with --token or {TOKEN_ENV}, or set "
            f"{STATE_DIR_ENV} to its --state-dir)"
        )
    return (
        f"{text} (give a token with --token or {TOKEN_ENV}: the controller's admin token is "
        f"{ADMIN_TOKEN_FILE} in its state directory, by default "
        f"{state_dir() / ADMIN_TOKEN_FILE}; `gpu-arbiter token create --role client` makes "
        "others)"
    )
