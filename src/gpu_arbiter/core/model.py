"""The values of the decision core: GPUs, workers, requests, leases.

All are frozen dataclasses; the scheduler replaces them, it never mutates them. This is
the module to read to learn what a lease is; what the values use but a reader of them
need not, lives beside it: the checks of human input (:mod:`.checks`), the scheduling
settings (:mod:`.policy`) and what makes building and copying a value cheap
(:mod:`._slots`). A lease's life::

    pending --grant--> loading --ready--> active --release--> released
       |                  |  load_timeout -> active            |
       |                  +--------- revoke -------------------+--> revoking --stopped--> released
       +--> timed_out | cancelled | rejected         TTL lapsed (any held state) --> expired
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, final

from ._slots import HashedOnce, evolve, slot_init
from .checks import (
    MAX_GPUS_PER_REQUEST,
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    MAX_METADATA_KEYS,
    MAX_NEVER_PREEMPT,
    MAX_TEXT,
    MAX_WORKER_NAMES,
    check_gpus,
    check_metadata,
    check_text,
    checked_scalars,
    compute_capability,
    gpu_id_parts,
    is_arch,
    json_value_problem,
    parse_archs,
    parse_capability,
    parse_gpu_ids,
    parse_labels,
    parse_lease_ids,
    parse_worker_names,
    validate_worker_name,
)
from .errors import InvalidInput
from .policy import Policy
from .units import PRIORITY_NAMES

# With the values, what was defined here before the checks, the policy and the slot
# machinery had modules of their own: still importable from here.
__all__ = [
    "MAX_GPUS_PER_REQUEST",
    "MAX_METADATA_BYTES",
    "MAX_METADATA_DEPTH",
    "MAX_METADATA_KEYS",
    "MAX_NEVER_PREEMPT",
    "MAX_TEXT",
    "MAX_WORKER_NAMES",
    "Constraints",
    "Gpu",
    "GpuId",
    "GpuProbe",
    "Lease",
    "LeaseState",
    "Policy",
    "Request",
    "Worker",
    "WorkerStatus",
    "check_metadata",
    "check_text",
    "compute_capability",
    "evolve",
    "json_value_problem",
    "slot_init",
    "validate_worker_name",
]


@dataclass(frozen=True, slots=True, order=True)
class GpuId(HashedOnce):
    """``worker:index``, parsed exactly on the single ``:`` (never by prefix)."""

    worker: str
    index: int

    __hash__ = HashedOnce.cached_hash

    def __str__(self) -> str:
        return f"{self.worker}:{self.index}"

    @classmethod
    def parse(cls, text: str) -> GpuId:
        return cls(*gpu_id_parts(text))


@dataclass(frozen=True, slots=True)
class Gpu:
    """One device of a worker. ``capacity_mb = total_mb - headroom_mb`` is what leases may use."""

    index: int
    total_mb: int
    arch: str = ""
    worker: str = "local"
    vendor: str = "nvidia"
    model: str = ""
    uuid: str = ""
    headroom_mb: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise InvalidInput("gpu.index", "must be an integer >= 0")
        if isinstance(self.total_mb, bool) or not isinstance(self.total_mb, int):
            raise InvalidInput("gpu.total_mb", "must be an integer number of MiB")
        if self.total_mb <= 0:
            raise InvalidInput("gpu.total_mb", "must be > 0")
        if not isinstance(self.headroom_mb, int) or not 0 <= self.headroom_mb < self.total_mb:
            raise InvalidInput("gpu.headroom_mb", "must be >= 0 and below total_mb")
        if self.arch and not is_arch(self.arch):
            raise InvalidInput("gpu.arch", f"{self.arch!r} is not an architecture like sm_86")
        object.__setattr__(self, "worker", validate_worker_name(self.worker, "gpu.worker"))
        object.__setattr__(self, "vendor", self.vendor.strip().lower())

    @property
    def id(self) -> GpuId:
        return GpuId(self.worker, self.index)

    @property
    def capacity_mb(self) -> int:
        return self.total_mb - self.headroom_mb


class WorkerStatus(StrEnum):
    ONLINE = "online"
    DRAINING = "draining"
    DRAINED = "drained"
    OFFLINE = "offline"


@dataclass(frozen=True, slots=True)
class Worker:
    name: str
    status: WorkerStatus = WorkerStatus.ONLINE
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", validate_worker_name(self.name, "name"))


@dataclass(frozen=True, slots=True)
class GpuProbe:
    """One probe reading of a GPU: used MiB, and per lease where the agent knows it."""

    used_mb: int
    lease_used_mb: Mapping[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Constraints(HashedOnce):
    """Where a request may run. Hashable: requests of one shape share work.

    ``workers``: any of these workers (empty: any worker; with ``worker`` a GPU must
    satisfy both). ``prefer_workers``: no filter but a rank: among the GPUs where the
    request fits now, those of these workers come first (a model whose file one of them
    read last); it never changes whether, nor which victims, only where it is placed."""

    vendor: str | None = None
    min_compute_capability: tuple[int, int] | None = None
    gpu_arch: tuple[str, ...] = ()
    gpu_model: str | None = None
    worker: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    gpu_ids: tuple[GpuId, ...] = ()
    never_preempt: tuple[str, ...] = ()  # lease ids this request never takes (I5 aside)
    workers: tuple[str, ...] = ()  # sorted, distinct
    prefer_workers: tuple[str, ...] = ()  # sorted, distinct

    __hash__ = HashedOnce.cached_hash

    @classmethod
    def build(
        cls,
        *,
        vendor: str | None = None,
        min_compute_capability: str | float | None = None,
        gpu_arch: list[str] | tuple[str, ...] | str | None = None,
        gpu_model: str | None = None,
        worker: str | None = None,
        labels: Mapping[str, str] | None = None,
        gpu_ids: list[str] | tuple[str, ...] | None = None,
        never_preempt: list[str] | tuple[str, ...] | None = None,
        workers: list[str] | tuple[str, ...] | None = None,
        prefer_workers: list[str] | tuple[str, ...] | None = None,
    ) -> Constraints:
        """Validates human input; every error names its field."""
        cc = parse_capability(min_compute_capability)
        archs = parse_archs(gpu_arch)
        for name, text in (("vendor", vendor), ("gpu_model", gpu_model)):
            if text is not None and (not isinstance(text, str) or not 0 < len(text) <= MAX_TEXT):
                raise InvalidInput(f"constraints.{name}", f"must be text of 1..{MAX_TEXT} chars")
        pairs = parse_labels(labels)
        folded = validate_worker_name(worker, "constraints.worker") if worker else None
        any_of = () if workers is None else parse_worker_names(workers, "constraints.workers", 1)
        return cls(
            vendor=vendor.lower() if vendor else None,
            min_compute_capability=cc,
            gpu_arch=archs,
            gpu_model=gpu_model,
            worker=folded,
            labels=pairs,
            gpu_ids=()
            if gpu_ids is None
            else tuple(GpuId(*pair) for pair in parse_gpu_ids(gpu_ids, folded, any_of)),
            never_preempt=parse_lease_ids(never_preempt),
            workers=any_of,
            prefer_workers=()
            if prefer_workers is None
            else parse_worker_names(prefer_workers, "constraints.prefer_workers", 0),
        )

    def describe(self) -> str:
        parts = []
        if self.vendor:
            parts.append(f"vendor={self.vendor}")
        if self.min_compute_capability:
            parts.append("min_cc={}.{}".format(*self.min_compute_capability))
        if self.gpu_arch:
            parts.append("arch=" + "|".join(self.gpu_arch))
        if self.gpu_model:
            parts.append(f"model={self.gpu_model}")
        if self.worker:
            parts.append(f"worker={self.worker}")
        if self.workers:
            parts.append("workers=" + "|".join(self.workers))
        parts.extend(f"{k}={v}" for k, v in self.labels)
        if self.gpu_ids:
            parts.append("gpu_ids=" + "|".join(map(str, self.gpu_ids)))
        if self.never_preempt:
            parts.append("never_preempt=" + "|".join(self.never_preempt))
        if self.prefer_workers:
            parts.append("prefer_workers=" + "|".join(self.prefer_workers))
        return ",".join(parts) or "any GPU"


_ANY_GPU = Constraints()  # no constraint: one shared value, valid as it is


@final  # see slot_init
@slot_init
@dataclass(frozen=True, slots=True)
class Request:
    """What a client asks for. Build with :meth:`build` to validate human input."""

    id: str
    vram_mb: int
    gpus: int = 1
    priority: int = PRIORITY_NAMES["normal"]
    preemptible: bool = True
    constraints: Constraints = _ANY_GPU
    holder: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    ttl_s: float | None = 30.0
    max_wait_s: float | None = None
    load_timeout_s: float = 300.0
    idempotency_key: str | None = None
    seq: int = 0
    submitted_at: float = 0.0

    @property
    def base_priority(self) -> int:
        return self.priority

    @property
    def shape(self) -> tuple[int, int, Constraints]:
        return (self.vram_mb, self.gpus, self.constraints)

    @classmethod
    def build(
        cls,
        id: str,
        *,
        vram_mb: int | str,
        gpus: int | None = None,
        priority: int | str = "normal",
        preemptible: bool | None = None,
        constraints: Constraints | None = None,
        holder: str = "",
        metadata: Mapping[str, Any] | None = None,
        ttl_s: float | None = 30.0,
        max_wait_s: float | None = None,
        load_timeout_s: float = 300.0,
        idempotency_key: str | None = None,
    ) -> Request:
        """Validates every field (errors name it). ``ttl_s=None``: no TTL, for a holder in
        this very process whose lease ends with its block. ``gpus``: by default the number
        of ``constraints.gpu_ids``, else 1; with them it must equal their number.

        What is left at its default (no metadata, no holder) is valid as it is and is not
        checked again, and the scalar fields are checked once per distinct set of values:
        an in-process ``acquire`` builds one request per lease, mostly alike."""
        args = (vram_mb, priority, preemptible, ttl_s, max_wait_s, load_timeout_s)
        try:
            scalars = checked_scalars(*args)
        except TypeError:  # an unhashable value: checked without the cache, to name its field
            scalars = checked_scalars.__wrapped__(*args)
        mb, prio, preemptible, ttl_s, max_wait_s, load_timeout_s = scalars
        constraints = constraints or _ANY_GPU
        gpus = check_gpus(gpus, len(constraints.gpu_ids))
        if holder != "":
            check_text("holder", holder)
        meta = check_metadata(metadata) if metadata else {}
        if idempotency_key is not None:
            check_text("idempotency_key", idempotency_key, min_len=1)
        return cls(
            id=id,
            vram_mb=mb,
            gpus=gpus,
            priority=prio,
            preemptible=preemptible,
            constraints=constraints,
            holder=holder,
            metadata=meta,
            ttl_s=ttl_s,
            max_wait_s=max_wait_s,
            load_timeout_s=load_timeout_s,
            idempotency_key=idempotency_key,
        )


class LeaseState(StrEnum):
    PENDING = "pending"
    LOADING = "loading"
    ACTIVE = "active"
    REVOKING = "revoking"
    RELEASED = "released"
    EXPIRED = "expired"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    REJECTED = "rejected"

    @property
    def holds_memory(self) -> bool:
        return self in _HELD

    @property
    def is_final(self) -> bool:
        return self in _FINAL


_HELD = frozenset({LeaseState.LOADING, LeaseState.ACTIVE, LeaseState.REVOKING})
_FINAL = frozenset(LeaseState) - _HELD - {LeaseState.PENDING}  # the five ends


@final  # see slot_init
@slot_init
@dataclass(frozen=True, slots=True)
class Lease:
    """A grant of ``vram_mb`` on each of ``gpus``, fenced by a strictly increasing ``token``.

    ``revoked_at``: when its revocation started (None while not revoked). ``supervised``: an
    agent watches the lease's process and will confirm when it exited; a lapsed TTL then
    revokes the lease instead of freeing its memory (I4). ``shrunk_to_mb``: what it holds
    per GPU since its holder shrank it (None: all it was granted, the request's
    ``vram_mb``); a lease shrinks, it never grows back. ``claimed``: its holder has taken
    the grant up (False from a grant made while nobody waited for the answer until the
    holder renews, reads, readies or runs it: see :class:`~.presence.Presence`)."""

    request: Request
    gpus: tuple[GpuId, ...]
    token: int
    state: LeaseState
    granted_at: float
    expires_at: float
    load_deadline: float
    idle: bool = False
    last_used_at: float = 0.0
    loading: bool = True
    revoke_reason: str | None = None
    preempted_for: str | None = None
    ended_at: float | None = None
    revoked_at: float | None = None
    supervised: bool = False
    shrunk_to_mb: int | None = None
    claimed: bool = True

    @property
    def id(self) -> str:
        return self.request.id

    def grace_ends_at(self, grace_s: float) -> float | None:
        """When a revoked lease's grace ends: after it, the lease cannot be renewed."""
        return None if self.revoked_at is None else self.revoked_at + grace_s

    @property
    def vram_mb(self) -> int:
        """What the lease holds per GPU now (committed, I1)."""
        return self.request.vram_mb if self.shrunk_to_mb is None else self.shrunk_to_mb

    @property
    def granted_mb(self) -> int:
        """What it was granted per GPU: the request's ``vram_mb``."""
        return self.request.vram_mb

    @property
    def base_priority(self) -> int:
        return self.request.priority

    @property
    def worker(self) -> str:
        return self.gpus[0].worker
