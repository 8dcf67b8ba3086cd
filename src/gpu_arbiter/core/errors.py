"""The one exception tree of gpu-arbiter.

A "no" from the scheduler is a value (a :class:`~gpu_arbiter.core.reasons.PendingReason`),
not an exception. Exceptions are for invalid input, conflicts, bugs and broken
infrastructure::

    ArbiterError
     ├── InvalidInput (also ValueError)     a field failed validation
     ├── NotFound (also KeyError)           no such lease, request, worker or GPU
     ├── Conflict                           the object is in the wrong state for this
     ├── Unschedulable                      no known GPU could ever satisfy the request
     ├── WaitTimeout (also TimeoutError)    max_wait_s passed before a grant
     ├── LeaseRevoked                       the arbiter took the lease back
     │    └── LeasePreempted                ... for a more important request
     └── ArbiterStopped                     the arbiter stopped while the caller waited

Only the HTTP server maps these to statuses.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ArbiterError",
    "ArbiterStopped",
    "Conflict",
    "InvalidInput",
    "LeasePreempted",
    "LeaseRevoked",
    "NotFound",
    "Unschedulable",
    "WaitTimeout",
]


class ArbiterError(Exception):
    """Base of every error gpu-arbiter raises on purpose."""

    code = "error"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __str__(self) -> str:
        return self.message


class InvalidInput(ArbiterError, ValueError):
    """A field failed validation; ``field`` names it, the message says why."""

    code = "invalid_input"

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}", field=field, reason=reason)
        self.field = field
        self.reason = reason


class NotFound(ArbiterError, KeyError):
    code = "not_found"

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class Conflict(ArbiterError):
    code = "conflict"


class Unschedulable(ArbiterError):
    """No known GPU could ever satisfy the request; ``reason`` says why."""

    code = "unschedulable"

    def __init__(self, reason: Any) -> None:
        super().__init__(reason.message, reason=reason)  # the code already says "unschedulable"
        self.reason = reason


class WaitTimeout(ArbiterError, TimeoutError):
    code = "wait_timeout"


class LeaseRevoked(ArbiterError):
    code = "lease_revoked"

    def __init__(self, lease_id: str, reason: str) -> None:
        super().__init__(
            f"lease {lease_id} was revoked: {reason}", lease_id=lease_id, reason=reason
        )
        self.lease_id = lease_id
        self.reason = reason


class LeasePreempted(LeaseRevoked):
    code = "lease_preempted"


class ArbiterStopped(ArbiterError):
    code = "arbiter_stopped"
