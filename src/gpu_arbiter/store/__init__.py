"""Where the controller keeps what it acknowledged: one interface, several stores.

``MemoryStore`` (tests, benchmarks, a throw-away controller) and ``SqliteStore``
(the embedded default, WAL). A PostgreSQL store implements the same
:class:`Store` protocol.
"""

from .base import Store, StoreError
from .memory import MemoryStore
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
    "Batch",
    "Event",
    "LeaseRecord",
    "MemoryStore",
    "OperationRecord",
    "OperationStep",
    "Snapshot",
    "SqliteStore",
    "Store",
    "StoreError",
    "TokenRecord",
    "WorkerRecord",
]
