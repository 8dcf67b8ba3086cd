"""Where the controller keeps what it acknowledged: one interface, several stores.

``MemoryStore`` (tests, benchmarks, a throw-away controller), ``SqliteStore``
(the embedded default, WAL) and ``PostgresStore`` (several controllers sharing one
database, one of them leading: see :mod:`.postgres`). The PostgreSQL store's module,
and asyncpg with it, is imported only once one of its names is asked for
(:func:`__getattr__`): a controller on another store never pays for it at its start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import Fenced, Store, StoreError
from .memory import MemoryStore
from .records import (
    Batch,
    CatalogueRevision,
    Event,
    GatewayNameRecord,
    LeaseRecord,
    OperationRecord,
    OperationStep,
    Snapshot,
    TokenRecord,
    WorkerRecord,
)
from .sqlite import SqliteStore

if TYPE_CHECKING:
    from .postgres import MIGRATIONS, Leader, PostgresStore

_POSTGRES = frozenset({"MIGRATIONS", "Leader", "PostgresStore"})


def __getattr__(name: str) -> Any:
    """The PostgreSQL store's names, from its module, imported at the first of them."""
    if name in _POSTGRES:
        return getattr(importlib.import_module(".postgres", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_postgres_url(text: str) -> bool:
    """``postgresql://...`` or ``postgres://...``: the setting names the PostgreSQL store
    (asked before its module is imported)."""
    return text.startswith(("postgresql://", "postgres://"))


__all__ = [
    "MIGRATIONS",
    "Batch",
    "CatalogueRevision",
    "Event",
    "Fenced",
    "GatewayNameRecord",
    "Leader",
    "LeaseRecord",
    "MemoryStore",
    "OperationRecord",
    "OperationStep",
    "PostgresStore",
    "Snapshot",
    "SqliteStore",
    "Store",
    "StoreError",
    "TokenRecord",
    "WorkerRecord",
    "is_postgres_url",
]
