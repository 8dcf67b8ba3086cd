"""A replica's life in words: its states and why it ends (``replica.py`` draws the
life; ``asleep.py`` the tier between warm and stopped)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Ending", "ReplicaState"]


class ReplicaState(StrEnum):
    QUEUED = "queued"
    LOADING = "loading"
    WARM = "warm"
    BUSY = "busy"
    ASLEEP = "asleep"  # the process kept, its memory given back (engines that sleep)
    WAKING = "waking"  # the memory asked for again (queue, load gate), then the wake
    STOPPING = "stopping"
    ENDED = "ended"


@dataclass(frozen=True, slots=True)
class Ending:
    """Why a replica stops: ``kind`` (keep_alive, reclaimed, preempted, revoked, failed,
    cancelled, shutdown, unloaded) and the words for logs and error bodies."""

    kind: str
    reason: str
