"""Where a controller keeps its state on this machine by default."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ADMIN_TOKEN_FILE", "STATE_DIR_ENV", "default_state_dir", "state_dir"]

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
