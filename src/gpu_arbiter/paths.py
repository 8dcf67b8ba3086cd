"""This machine: where a controller keeps its state by default, and which addresses
name this machine."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

__all__ = ["ADMIN_TOKEN_FILE", "STATE_DIR_ENV", "default_state_dir", "is_loopback", "state_dir"]

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
