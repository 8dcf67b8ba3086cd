"""This machine: where a controller keeps its state by default, which addresses name
this machine, and a token read from a file of its own."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path

from .core import InvalidInput

__all__ = [
    "ADMIN_TOKEN_FILE",
    "STATE_DIR_ENV",
    "default_state_dir",
    "is_loopback",
    "read_token_file",
    "state_dir",
]

STATE_DIR_ENV = "GPU_ARBITER_STATE_DIR"
ADMIN_TOKEN_FILE = "admin.token"


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/gpu-arbiter``, else ``~/.local/state/gpu-arbiter``."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpu-arbiter"


def state_dir() -> Path:
    """``$GPU_ARBITER_STATE_DIR`` when set, else :func:`default_state_dir`."""
    given = os.environ.get(STATE_DIR_ENV)
    return Path(given).expanduser() if given else default_state_dir()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, no port) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token_file(path: Path, field: str = "--token-file") -> str:
    """The token in the file at ``path`` (its first line): a secret named by its path,
    never written on a command line. Raises :class:`InvalidInput` (``field``: where the
    path was given) when the file cannot be read, is empty, or may be read by anyone
    but its owner (group or others: a mode beyond 0600, say 0644), naming the path and
    its mode."""
    try:
        with path.open(encoding="utf-8") as handle:
            mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
            text = handle.read(4096)
    except (OSError, UnicodeDecodeError) as error:
        why = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise InvalidInput(field, f"cannot read the token file {path}: {why}") from None
    if mode & 0o077:
        raise InvalidInput(
            field,
            f"the token file {path} has mode {mode:04o}: others than its owner may read "
            f"it; make it 0600 (chmod 600 {path})",
        )
    token = text.strip().partition("\n")[0].strip()
    if not token:
        raise InvalidInput(field, f"the token file {path} is empty")
    return token
