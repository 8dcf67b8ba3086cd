"""The pure decision core: stdlib only, synchronous, no I/O, no clock reads."""

from .errors import (
    ArbiterError,
    ArbiterStopped,
    Conflict,
    InvalidInput,
    LeasePreempted,
    LeaseRevoked,
    NotFound,
    Unschedulable,
    WaitTimeout,
)
from .ledger import GpuFigures
from .model import (
    Constraints,
    Gpu,
    GpuId,
    GpuProbe,
    Lease,
    LeaseState,
    Policy,
    Request,
    Worker,
    WorkerStatus,
    compute_capability,
    validate_worker_name,
)
from .reasons import GpuVerdict, PendingReason
from .scheduler import Decisions, Scheduler
from .units import (
    PRIORITY_NAMES,
    format_mb,
    parse_duration_s,
    parse_mb,
    parse_priority,
    priority_name,
)

__all__ = [
    "PRIORITY_NAMES",
    "ArbiterError",
    "ArbiterStopped",
    "Conflict",
    "Constraints",
    "Decisions",
    "Gpu",
    "GpuFigures",
    "GpuId",
    "GpuProbe",
    "GpuVerdict",
    "InvalidInput",
    "Lease",
    "LeasePreempted",
    "LeaseRevoked",
    "LeaseState",
    "NotFound",
    "PendingReason",
    "Policy",
    "Request",
    "Scheduler",
    "Unschedulable",
    "WaitTimeout",
    "Worker",
    "WorkerStatus",
    "compute_capability",
    "format_mb",
    "parse_duration_s",
    "parse_mb",
    "parse_priority",
    "priority_name",
    "validate_worker_name",
]
