"""Where the controller keeps what it acknowledged: one interface, several stores.

``MemoryStore`` (tests, benchmarks, a throw-away controller), ``SqliteStore``
(the embedded default, WAL) and ``PostgresStore`` (several controllers sharing one
database, one of them leading: see :mod:`.postgres`).
"""

from .base import Fenced, Store, StoreError
from .memory import MemoryStore
from .postgres import MIGRATIONS, Leader, PostgresStore, is_postgres_url
from .records import (
    Batch,
    Event,
    LeaseRecord,
    OperationRecord,
    OperationStep,
    Snapshot,
    TokenRecord,
    WorkerRecord,
)
from .sqlite import SqliteStore

__all__ = [
    "MIGRATIONS",
    "Batch",
    "Event",
    "Fenced",
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
