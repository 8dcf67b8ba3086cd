"""What routing reads of a candidate and of the request: one frozen value each, built
once where the figures come in (a peer's model from the controller's view, this host's
own model, a replica of it), so that no rule reads a report's raw mapping."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Ask", "Candidate"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A place a request may go: a gateway's copy of a model (``replica`` 0: all its
    replicas together) or one replica of it (``replica``: its number). ``ready``
    replicas with ``slots`` in all, ``in_flight`` requests on them, whether one is
    ``coming`` (queued for its lease, loading, waking, asleep); ``routable`` and, when
    not, ``why_not``; ``worker_state`` as the controller showed it (None: this host's
    own, or unknown); ``state``: the replica's, or the copy's most advanced one."""

    gateway: str
    replica: int = 0
    local: bool = False
    routable: bool = True
    why_not: str = ""
    state: str = ""
    ready: int = 0
    slots: int = 0
    in_flight: int = 0
    coming: bool = False
    worker_state: str | None = None

    @property
    def slots_free(self) -> int:
        return max(0, self.slots - self.in_flight)

    @property
    def name(self) -> str:
        """How the diagnosis names it: ``gw-2``, or ``gw-2/3`` for its replica 3."""
        return f"{self.gateway}/{self.replica}" if self.replica else self.gateway


@dataclass(frozen=True, slots=True)
class Ask:
    """What routing reads of the request: the ``model`` asked for and, with prefix
    affinity on, its conversation's ``prefix`` (a digest; "" when off or none) and where
    that prefix ``went`` last (a :attr:`Candidate.name`; "" when nowhere known)."""

    model: str
    prefix: str = ""
    went: str = ""
