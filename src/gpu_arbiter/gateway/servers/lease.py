"""A lease as the gateway reads it: the controller's JSON made a value in one place
(:meth:`Lease.of`), with the fields the gateway uses.

The controller's answer carries more (its holder, constraints, timestamps...): what the
gateway does not read is not kept. A lease is replaced by a new value each time the
controller answers about it (ready, idle, busy, shrink, a long-poll), never changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ...client import pending_text

__all__ = ["HELD", "Lease"]

HELD = frozenset({"loading", "active"})
"""The states in which a lease's holder may use its memory (the grant came)."""

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Lease:
    id: str
    state: str  # pending, loading, active, revoking, released, expired, timed_out...
    worker: str | None = None  # where it was granted (None while pending)
    gpus: tuple[str, ...] = ()  # ``worker:index`` of each GPU (empty while pending)
    vram_mb: int = 0  # per GPU, as shrunk
    priority: int | None = None  # its base priority, as asked
    token: int | None = None  # the fencing token
    ttl_s: float | None = None
    idle: bool = False  # marked idle: a cache the arbiter may reclaim
    supervised: bool = False  # an agent supervises its process
    metadata: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    submitted_at: float | None = None  # on the controller's clock
    # why it is pending, structured (code, message, blockers...)
    reason: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    position: int | None = None  # its place in the queue, while pending
    ended_at: float | None = None
    end_reason: str | None = None
    revoke_reason: str | None = None
    preempted_for: str | None = None

    @classmethod
    def of(cls, found: Mapping[str, Any]) -> Lease:
        """The lease in the controller's JSON (``GET /v1/leases/{id}`` and the lease
        verbs' answers); a field it lacks or has null takes the default."""

        def text(key: str) -> str | None:
            value = found.get(key)
            return None if value is None else str(value)

        def number(key: str) -> float | None:
            value = found.get(key)
            return None if value is None else float(value)

        def whole(key: str) -> int | None:
            value = found.get(key)
            return None if value is None else int(value)

        return cls(
            id=str(found["id"]),
            state=str(found["state"]),
            worker=text("worker"),
            gpus=tuple(str(gpu) for gpu in found.get("gpus") or ()),
            vram_mb=int(found.get("vram_mb") or 0),
            priority=whole("priority"),
            token=whole("token"),
            ttl_s=number("ttl_s"),
            idle=bool(found.get("idle")),
            supervised=bool(found.get("supervised")),
            metadata=MappingProxyType(dict(found.get("metadata") or {})),
            submitted_at=number("submitted_at"),
            reason=MappingProxyType(dict(found.get("reason") or {})),
            position=whole("position"),
            ended_at=number("ended_at"),
            end_reason=text("end_reason"),
            revoke_reason=text("revoke_reason"),
            preempted_for=text("preempted_for"),
        )

    @property
    def held(self) -> bool:
        """Granted and not ended: its holder may use its memory."""
        return self.state in HELD

    @property
    def pending(self) -> bool:
        return self.state == "pending"

    def pending_text(self) -> str:
        """Its wait in words, as the controller's reason says it, with its position."""
        return pending_text({"reason": dict(self.reason), "position": self.position})
