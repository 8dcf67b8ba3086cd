"""Process groups whose GPU memory is the memory of several leases, as their holder says.

One ``ollama serve`` is one process group holding many models, each under a lease of
its own (``gateway/servers/ollama.py``). The agent cannot attach that group to those leases: it
would stop the whole serve when one of them is revoked. Without more, a per-process
probe shows the group's memory as belonging to no lease, and the controller counts it as
external on top of the leases' reservations: twice. So the holder *accounts* for the
group (the local endpoint's ``account`` op): "group G's memory is the memory of these
leases, in these proportions". The agent then splits the group's memory on each GPU
among those leases in its heartbeats (:func:`split_groups`), and neither supervises,
signals nor persists the group: the holder repeats its account every few seconds, and
an account not repeated within :data:`ACCOUNT_TTL_S`, or whose group leader is gone, is
dropped (:class:`Accounts`), so a holder that dies leaves the memory external again.

Attributing memory never hides it (I2): a lease's figure counts as ``max(reserved,
used)``, and memory attributed to a lease the GPU does not hold stays external.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ACCOUNT_TTL_S",
    "MAX_SHARES",
    "MAX_SHARE_MB",
    "Accounts",
    "parse_shares",
    "split_groups",
    "split_mb",
]

ACCOUNT_TTL_S = 30.0
"""An account not said again within this is dropped (its holder repeats it every 5 s)."""
MAX_SHARES = 256
"""Leases in one account, and in all of them: a heartbeat carries at most 256 per GPU."""
MAX_SHARE_MB = 1 << 40


@dataclass(slots=True)
class _Account:
    shares: dict[str, int]
    started: int | None  # the leader's start time: a pid reused since is not it
    said_at: float


class Accounts:
    """The accounts said to this agent, by process group. ``clock``: monotonic seconds;
    ``started(pid)``: the process's start time, None once it is gone."""

    def __init__(
        self,
        started: Callable[[int], int | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._started = started
        self._clock = clock
        self._accounts: dict[int, _Account] = {}

    def put(self, pgid: int, shares: Mapping[str, int]) -> str | None:
        """Group ``pgid``'s memory is now that of ``shares`` (``{}``: of none, dropped at
        once). The reason it is refused, naming the field, or None."""
        self._expire()
        if not shares:
            self._accounts.pop(pgid, None)
            return None
        others = sum(len(a.shares) for g, a in self._accounts.items() if g != pgid)
        if others + len(shares) > MAX_SHARES:
            return f"shares: at most {MAX_SHARES} leases in all the accounts of this agent"
        self._accounts[pgid] = _Account(dict(shares), self._started(pgid), self._clock())
        return None

    def current(self) -> dict[int, Mapping[str, int]]:
        """The accounts in force: group -> its shares."""
        self._expire()
        return {pgid: dict(account.shares) for pgid, account in self._accounts.items()}

    def _expire(self) -> None:
        now = self._clock()
        for pgid, account in list(self._accounts.items()):
            stale = now - account.said_at > ACCOUNT_TTL_S
            if stale or account.started is None or self._started(pgid) != account.started:
                del self._accounts[pgid]


def parse_shares(value: Any) -> dict[str, int] | str:
    """The ``shares`` of an ``account`` request, or the reason they are refused."""
    if not isinstance(value, dict):
        return "shares must be an object of lease id -> MiB"
    if len(value) > MAX_SHARES:
        return f"shares: at most {MAX_SHARES} leases"
    for lease_id, mb in value.items():
        if not isinstance(lease_id, str) or not 0 < len(lease_id) <= 64:
            return "shares: each key must be a lease id"
        if isinstance(mb, bool) or not isinstance(mb, int) or not 0 <= mb <= MAX_SHARE_MB:
            return f"shares[{lease_id!r}] must be MiB, an integer 0 to 2**40"
    return dict(value)


def split_mb(total_mb: int, shares: Mapping[str, int]) -> dict[str, int]:
    """``total_mb`` split among the leases in proportion to their shares (equally when all
    are 0), in whole MiB that add up to ``total_mb`` exactly: the remainder goes to the
    largest share (the first lease id among equals)."""
    if not shares:
        return {}
    weights = dict(shares) if any(shares.values()) else dict.fromkeys(shares, 1)
    whole = sum(weights.values())
    parts = {lease_id: total_mb * weight // whole for lease_id, weight in weights.items()}
    largest = min(weights, key=lambda lease_id: (-weights[lease_id], lease_id))
    parts[largest] += total_mb - sum(parts.values())
    return parts


def split_groups(
    processes: Mapping[int, int | None] | None,
    group_of: Mapping[int, int],
    accounts: Mapping[int, Mapping[str, int]],
    supervised: Collection[int] = (),
) -> dict[str, int] | None:
    """One GPU's memory of the accounted groups, per lease: each group's processes
    (``processes``: pid -> MiB on this GPU; ``group_of``: pid -> its group) summed and
    split by :func:`split_mb`. A process supervised for a lease (``supervised``) is that
    lease's alone. None where the probe cannot say per process: nothing is attributed."""
    if processes is None or any(mb is None for mb in processes.values()):
        return None
    group_mb: dict[int, int] = {}
    for pid, mb in processes.items():
        group = group_of.get(pid)
        if mb is None or group is None or group not in accounts or pid in supervised:
            continue
        group_mb[group] = group_mb.get(group, 0) + mb
    used: dict[str, int] = {}
    for group, mb in sorted(group_mb.items()):
        for lease_id, part in split_mb(mb, accounts[group]).items():
            used[lease_id] = used.get(lease_id, 0) + part
    return used
