"""What the controller persists: lease records, worker records, events, tokens, which
token holds each gateway name, and the revisions of the cluster's catalogue.

Each record is a frozen value; :mod:`.codec` turns them into JSON documents and
back, so every store keeps exactly the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core import Gpu, Lease, LeaseState, Request, WorkerStatus

__all__ = [
    "Batch",
    "CatalogueRevision",
    "Event",
    "GatewayNameRecord",
    "LeaseRecord",
    "OperationRecord",
    "OperationStep",
    "Snapshot",
    "TokenRecord",
    "WorkerRecord",
]


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """One request and, once granted, its lease — through to its final state: what the
    store keeps and the API shows of a lease.

    While the lease is live the core holds its one copy (the queued request, or the
    lease, whose own request and state these are) and the controller makes this record
    from it whenever it is read or stored; a final record is the core's last word on
    it. ``owner`` is the principal (token id) that created it; ``end_reason`` says why a
    final record ended (``released``, ``expired``, ``holder_stopped``, ...)."""

    request: Request
    state: LeaseState
    owner: str | None = None
    lease: Lease | None = None
    ended_at: float | None = None
    end_reason: str | None = None

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def worker(self) -> str | None:
        return None if self.lease is None else self.lease.worker

    @property
    def token(self) -> int | None:
        return None if self.lease is None else self.lease.token


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A worker as registered, with its status.

    ``status_after_offline`` is where a heartbeat brings it back after it went offline
    (``draining`` if it was draining or drained, else ``online``). ``simulated``: this
    controller simulates it (``serve --simulate``); ``simulated_gpus``: its agent's GPUs
    are simulated (a fake probe)."""

    name: str
    status: WorkerStatus
    gpus: tuple[Gpu, ...]
    labels: Mapping[str, str] = field(default_factory=dict)
    url: str = ""
    agent_version: str = ""
    registered_at: float = 0.0
    drain_deadline: float | None = None
    status_after_offline: WorkerStatus = WorkerStatus.ONLINE
    simulated: bool = False
    simulated_gpus: bool = False


@dataclass(frozen=True, slots=True)
class Event:
    """One typed, sequenced event (``lease.granted``, ``worker.offline``, ...)."""

    seq: int
    at: float
    kind: str
    lease_id: str | None = None
    worker: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OperationStep:
    """One step of an operation: what (``drain``, ``update_command``, ...), its outcome
    (``started``, ``ok``, ``failed``), when, and a word on it."""

    name: str
    outcome: str
    at: float
    detail: str = ""


@dataclass(frozen=True, slots=True)
class OperationRecord:
    """An admin operation on a worker carried out in steps (an update), with each step's
    time and outcome. ``state``: ``running``, ``succeeded`` or ``failed`` (``reason``).
    ``deadline``: when a still running operation fails (controller clock), if ever."""

    id: str
    kind: str
    worker: str
    state: str
    created_at: float
    steps: tuple[OperationStep, ...] = ()
    reason: str | None = None
    from_version: str = ""
    to_version: str | None = None
    deadline: float | None = None

    @property
    def running(self) -> bool:
        return self.state == "running"

    def step(self, name: str) -> OperationStep | None:
        """The latest record of step ``name``."""
        return next((s for s in reversed(self.steps) if s.name == name), None)

    @property
    def waiting_on(self) -> str:
        """The step an update waits on: ``drain``, ``update_command`` or ``restart``."""
        if self.step("restart") is not None:
            return "restart"
        drain = self.step("drain")
        if self.step("update_command") is not None or (drain and drain.outcome == "ok"):
            return "update_command"
        return "drain"


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """A bearer token, kept only as its SHA-256 digest."""

    id: str
    digest: str
    role: str
    worker: str | None = None
    created_at: float = 0.0


@dataclass(frozen=True, slots=True)
class GatewayNameRecord:
    """A gateway name and the token (its id) that holds it: the first that reported it,
    until an admin forgets the name or the token is revoked. ``worker``: the worker its
    gateway reported beside when it took the name."""

    name: str
    owner: str
    worker: str | None = None
    taken_at: float = 0.0


@dataclass(frozen=True, slots=True)
class CatalogueRevision:
    """One revision of the cluster's catalogue: its number (1, 2, ... in the order they
    were applied), its text as applied (from ``file``, as the applier named it), the
    SHA-256 of the text (hex), when and by whom (a token id) it was applied. Every
    revision is kept: they are small, and an operator reads or compares old ones."""

    revision: int
    text: str
    sha256: str
    applied_at: float
    applied_by: str
    file: str = ""


@dataclass(slots=True)
class Batch:
    """Everything one change writes, committed in one transaction."""

    leases: dict[str, LeaseRecord] = field(default_factory=dict)
    workers: dict[str, WorkerRecord] = field(default_factory=dict)
    removed_workers: set[str] = field(default_factory=set)
    events: list[Event] = field(default_factory=list)
    meta: dict[str, int] = field(default_factory=dict)
    operations: dict[str, OperationRecord] = field(default_factory=dict)
    gateway_names: dict[str, GatewayNameRecord | None] = field(default_factory=dict)
    """A name taken (its record), or forgotten (None)."""
    catalogue: list[CatalogueRevision] = field(default_factory=list)
    """New revisions of the catalogue, oldest first (a revision is never rewritten)."""

    def __bool__(self) -> bool:
        return bool(
            self.leases
            or self.workers
            or self.removed_workers
            or self.events
            or self.meta
            or self.operations
            or self.gateway_names
            or self.catalogue
        )

    def merge(self, later: Batch) -> None:
        """Adds ``later``'s writes to this batch, as if committed after it in one
        transaction (group commit): a record written by both is ``later``'s, a worker
        ``later`` removes is removed, events keep their order."""
        for name in later.removed_workers:
            self.workers.pop(name, None)
        self.removed_workers |= later.removed_workers
        self.workers.update(later.workers)
        self.leases.update(later.leases)
        self.events.extend(later.events)
        self.meta.update(later.meta)
        self.operations.update(later.operations)
        self.gateway_names.update(later.gateway_names)
        self.catalogue.extend(later.catalogue)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The state a controller starts from: workers, live (non-final) leases, counters."""

    workers: tuple[WorkerRecord, ...] = ()
    leases: tuple[LeaseRecord, ...] = ()
    meta: Mapping[str, int] = field(default_factory=dict)
    last_event_seq: int = 0
    operations: tuple[OperationRecord, ...] = ()  # the running ones
    gateway_names: tuple[GatewayNameRecord, ...] = ()  # by name
    catalogue: tuple[CatalogueRevision, ...] = ()  # every revision, oldest first
