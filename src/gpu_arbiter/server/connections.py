"""The controller's listener has the bounds every listener of the project has: see
:mod:`gpu_arbiter.web.connections` (the gateway's port uses the same implementation)."""

from __future__ import annotations

from ..web.connections import HeadLimits, bounded_http, raise_open_files_limit

__all__ = ["HeadLimits", "bounded_http", "raise_open_files_limit"]
