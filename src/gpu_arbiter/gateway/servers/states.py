"""A replica's life in words: its states, the moves allowed between them, and why it
ends. ``replica.py`` draws the life and ``asleep.py`` the tier between warm and stopped;
:data:`TRANSITIONS` is those two drawings as one table. Every change of state goes
through :meth:`.replica.Replica.move`, which refuses a move the table does not allow (a
bug: ``AssertionError`` naming both states). ``ended`` has no way out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

__all__ = [
    "MODEL_STATES",
    "TRANSITIONS",
    "EndKind",
    "Ending",
    "ReplicaState",
    "check_move",
    "most_advanced",
]


class ReplicaState(StrEnum):
    QUEUED = "queued"
    LOADING = "loading"
    WARM = "warm"
    BUSY = "busy"
    ASLEEP = "asleep"  # the process kept, its memory given back (engines that sleep)
    WAKING = "waking"  # the memory asked for again (queue, load gate), then the wake
    STOPPING = "stopping"
    ENDED = "ended"


_S = ReplicaState
TRANSITIONS: Mapping[ReplicaState, frozenset[ReplicaState]] = MappingProxyType(
    {
        # granted (or a lease adopted: made loading); nobody waits any more: ended
        _S.QUEUED: frozenset({_S.LOADING, _S.ENDED}),
        # ready; or not ready, failed, revoked: stopped
        _S.LOADING: frozenset({_S.WARM, _S.STOPPING}),
        # a request came; idle sleep_after; keep_alive, a revocation, the server exited
        _S.WARM: frozenset({_S.BUSY, _S.ASLEEP, _S.STOPPING}),
        # all requests left; stopped with requests in flight (they get the grace)
        _S.BUSY: frozenset({_S.WARM, _S.STOPPING}),
        # a request waits: waking; the engine did not sleep after all: warm again
        _S.ASLEEP: frozenset({_S.WAKING, _S.WARM, _S.STOPPING}),
        # woken; nobody waits any more (or not granted): asleep again
        _S.WAKING: frozenset({_S.WARM, _S.ASLEEP, _S.STOPPING}),
        # the process group gone, the lease released
        _S.STOPPING: frozenset({_S.ENDED}),
        _S.ENDED: frozenset(),
    }
)
"""The moves a replica's state may make: from -> the states it may go to."""


MODEL_STATES = (
    "busy", "warm", "waking", "asleep", "loading", "queued", "stopping", "cold", "failed",
)  # fmt: skip
"""A model's states, the most advanced first: a copy's state is its most advanced
replica's (``busy`` to ``stopping``), else ``cold`` (nothing runs; the next request
starts it) or ``failed`` (its last start failed: the next request starts it once the
back-off is over). The cluster's state of a model is the most advanced of its routable
hosts' in the same order: a host that serves, or wakes or loads it, comes before one
where it would have to start, and a host where it may start before one where its last
start failed."""


def most_advanced(states: Iterable[str]) -> str | None:
    """The first of ``states`` in :data:`MODEL_STATES`' order (a word it does not know
    last); None when there is none."""
    found = list(states)
    if not found:
        return None
    return min(
        found, key=lambda s: MODEL_STATES.index(s) if s in MODEL_STATES else len(MODEL_STATES)
    )


def check_move(now: ReplicaState, to: ReplicaState) -> None:
    """Raises ``AssertionError`` (a bug) naming both when ``now -> to`` is not allowed."""
    if to not in TRANSITIONS[now]:
        raise AssertionError(f"replica state {now} -> {to} is not an allowed move")


class EndKind(StrEnum):
    """Why a replica ended, as a word (its ``str`` is the word, for logs, metrics' labels
    and error texts)."""

    KEEP_ALIVE = "keep_alive"  # nothing came for keep_alive
    RECLAIMED = "reclaimed"  # its lease, marked idle, taken as a cache
    PREEMPTED = "preempted"  # its busy lease revoked for a higher priority
    REVOKED = "revoked"  # its lease revoked or lost otherwise (drain, removal, expiry)
    FAILED = "failed"  # it could not start, was not ready in time, or its server exited
    CANCELLED = "cancelled"  # queued, and nobody waits for it any more
    SHUTDOWN = "shutdown"  # the gateway stops
    UNLOADED = "unloaded"  # an operator's unload
    DROPPED = "dropped"  # Ollama unloaded it by itself (no failure: no backoff)
    RETIRED = "retired"  # its model removed or replaced: ended once nothing was in flight

    @property
    def graced(self) -> bool:
        """Whether the requests in flight get the model's grace to finish (the others
        find none to wait for, or the server gone)."""
        return _MEANING[self][1]

    @property
    def status(self) -> int:
        """What a request this ending cuts off gets: 503 (the replica was stopped: try
        again) or 502 (the model server failed)."""
        return _MEANING[self][0]

    @property
    def retry_elsewhere(self) -> bool:
        """Whether the ending says nothing against the model (its host or its lease
        ended it): a request it cut off before any of it was sent may go to another
        replica or host. Nothing retries on it yet: a relay once begun is the caller's."""
        return _MEANING[self][2]


_E = EndKind
_MEANING: Mapping[EndKind, tuple[int, bool, bool]] = MappingProxyType(
    {
        #               status, graced, retry elsewhere
        _E.KEEP_ALIVE: (503, False, True),  # idle: nothing in flight to grace
        _E.RECLAIMED: (503, True, True),
        _E.PREEMPTED: (503, True, True),
        _E.REVOKED: (503, True, True),
        _E.FAILED: (502, False, False),
        _E.CANCELLED: (502, False, True),  # queued: no request was ever relayed to it
        _E.SHUTDOWN: (503, True, True),
        _E.UNLOADED: (503, True, True),
        # Not a failure (no backoff), yet a request it cuts off is told 502 "failed" and
        # gets no grace, as before the meanings were written here; likely a 503 stop.
        _E.DROPPED: (502, False, True),
        # ends only once its requests in flight have finished (``Replica.retire``)
        _E.RETIRED: (503, True, True),
    }
)
"""What each ending means to the requests it cuts off: the status they get, whether
they get the grace first, and whether they may go elsewhere (:class:`EndKind`)."""


@dataclass(frozen=True, slots=True)
class Ending:
    """Why a replica stops: ``kind`` and the words for logs and error bodies."""

    kind: EndKind
    reason: str
