"""Whether an asker is still there (I8's dual): a pending request whose asker is gone
ends, and a grant nobody takes up is given back, each within a bound.

Where a driver's askers can vanish without a word (the service: a client killed while it
waits), each pending request has a deadline ``ttl_s`` after its asker was last seen, and
each grant made while nobody waited for its answer has a claim deadline,
``policy.claim_bound_s(ttl_s)`` (``min(claim_s, ttl_s / 3)``) after the grant::

    submit -seen- long-poll open (watched: no deadline) -closed, seen- ... ttl_s unseen
                                                                       -> abandoned
    grant, unwatched -- renew | ready | idle | shrink | read | process reported -> claimed
          `---------- claim bound passed, nothing of that ------------------> unclaimed

A request watched when it is granted (its submission or a long-poll still open: the
grant is the answer it gets) is claimed as granted. An in-process driver (the engine,
the simulator) has its askers present while they are awaited: it leaves this off, and
every grant is claimed as made.

The deadlines are the core's timers (:class:`~.timers.Timers`), on the time passed in; a
restart arms them again from the restart's time, so that no restart ends everyone's
request at once. Like every timer, an entry is not removed when what it times moves: it
is checked when it comes due (:meth:`Presence.absent`, :meth:`Presence.unclaimed`).

Owns the deadlines and the count of open watches per request; the scheduler asks it.
"""

from __future__ import annotations

from collections import Counter

from .model import Lease, Request
from .timers import TimerKind, Timers

__all__ = ["Presence"]


class Presence:
    __slots__ = ("_absent_at", "_claim_by", "_timers", "_watching", "on")

    def __init__(self, timers: Timers, on: bool) -> None:
        self.on = on
        self._timers = timers
        self._absent_at: dict[str, float] = {}  # pending request -> when its asker is gone
        self._claim_by: dict[str, float] = {}  # unclaimed lease -> when it is given back
        self._watching: Counter[str] = Counter()  # request -> long-polls (or a submit) open

    # ------------------------------------------------------------------ pending requests

    def seen(self, request: Request, now: float) -> None:
        """``request``'s asker showed up at ``now``: gone ``ttl_s`` later unless seen again
        (no TTL: never)."""
        if not self.on or request.ttl_s is None:
            return
        at = now + request.ttl_s
        self._absent_at[request.id] = at
        if not self.watched(request.id):  # else its unwatch arms it
            self._timers.push(at, TimerKind.ABSENT, request.id)

    def watch(self, request_id: str) -> None:
        """An answer to the asker is open (a long-poll): present until :meth:`unwatch`."""
        self._watching[request_id] += 1

    def unwatch(self, request: Request | None, request_id: str, now: float) -> None:
        """An answer opened by :meth:`watch` closed at ``now``; ``request``: the request if
        still pending (its asker was there until now)."""
        left = self._watching.get(request_id, 0) - 1
        if left > 0:
            self._watching[request_id] = left
        else:
            self._watching.pop(request_id, None)
        if request is not None:
            self.seen(request, now)

    def watched(self, request_id: str) -> bool:
        return self._watching.get(request_id, 0) > 0

    def watches(self) -> dict[str, int]:
        """Open watches by request (a copy): what a new core must be told again."""
        return dict(self._watching)

    def absent(self, request_id: str, at: float) -> bool:
        """Whether a deadline at ``at`` for ``request_id`` (pending) is its asker's last."""
        return not self.watched(request_id) and self._absent_at.get(request_id) == at

    def claimed_at_grant(self, request_id: str) -> bool:
        """Whether a grant of ``request_id`` now is taken up as made."""
        return not self.on or self.watched(request_id)

    # ------------------------------------------------------------------ grants

    def granted(self, lease: Lease, since: float, bound_s: float) -> None:
        """A held lease (a new grant, or one restored at ``since``) that its holder has not
        taken up: given back ``bound_s`` after ``since`` unless claimed first."""
        if lease.claimed:
            return
        at = since + bound_s
        self._claim_by[lease.id] = at
        self._timers.push(at, TimerKind.CLAIM, lease.id)

    def unclaimed(self, lease_id: str, at: float) -> bool:
        """Whether a deadline at ``at`` is the claim deadline of ``lease_id``."""
        return self._claim_by.get(lease_id) == at

    def forget(self, request_id: str) -> None:
        """The request or lease left the state, or its grant was claimed: no deadline."""
        self._absent_at.pop(request_id, None)
        self._claim_by.pop(request_id, None)
