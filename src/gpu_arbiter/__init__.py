"""gpu-arbiter: the single authority for GPU memory.

Work asks for a lease of VRAM before touching a GPU; leases are granted so that
memory is never over-committed, model loads never overlap on a GPU, important
work goes first and can safely preempt less important work.
"""

from .core import (
    ArbiterError,
    ArbiterStopped,
    Conflict,
    Constraints,
    Gpu,
    GpuId,
    GpuProbe,
    InvalidInput,
    Lease,
    LeasePreempted,
    LeaseRevoked,
    LeaseState,
    NotFound,
    PendingReason,
    Policy,
    Request,
    Unschedulable,
    WaitTimeout,
    parse_mb,
    parse_priority,
)
from .engine import Arbiter, ArbiterEvent, ArbiterStats, LeaseHandle, PendingInfo

__version__ = "0.1.0"

__all__ = [
    "Arbiter",
    "ArbiterError",
    "ArbiterEvent",
    "ArbiterStats",
    "ArbiterStopped",
    "Conflict",
    "Constraints",
    "Gpu",
    "GpuId",
    "GpuProbe",
    "InvalidInput",
    "Lease",
    "LeaseHandle",
    "LeasePreempted",
    "LeaseRevoked",
    "LeaseState",
    "NotFound",
    "PendingInfo",
    "PendingReason",
    "Policy",
    "Request",
    "Unschedulable",
    "WaitTimeout",
    "__version__",
    "parse_mb",
    "parse_priority",
]
