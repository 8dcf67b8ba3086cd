"""A profile: filters, then weighted scorers, then a picker, over a request's candidates.

    candidates --filters--> kept --scorers (weighted)--> totals --picker--> one, or none

- a **filter** keeps a candidate or drops it with a reason (:class:`Drop`): the first
  filter that drops it is the one named, and the later ones are not asked;
- a **scorer** gives each kept candidate a raw score in [0, 1], multiplied by its weight;
- the **picker** takes the highest total; equal totals go to this host first, then to
  the highest rendezvous weight of the request's prefix (when it has one), then to the
  lowest gateway name and replica number: the same figures always give the same pick.

Every step is kept (:class:`Verdict` per candidate, :class:`Pick` per profile run) as
the gateway's own diagnosis of the decision (``GET /admin/routes``). Nothing here does
I/O, reads a clock or keeps state: a profile is a value, and picking is a function.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .figures import Ask, Candidate

__all__ = ["Drop", "Filter", "Pick", "Profile", "Scorer", "Verdict", "rendezvous", "tie_break"]


class Drop(NamedTuple):
    """Why a filter dropped a candidate: the ``filter``'s name and the ``why``. (A named
    tuple, as :class:`Verdict`: one is built per candidate and decision.)"""

    filter: str
    why: str


@dataclass(frozen=True, slots=True)
class Filter:
    """``drops(ask, candidate)``: why the candidate cannot take the request, or None."""

    name: str
    drops: Callable[[Ask, Candidate], str | None]


@dataclass(frozen=True, slots=True)
class Scorer:
    """``score(ask, candidate)``: how well the candidate suits the request, in [0, 1];
    counted ``weight`` times in the total."""

    name: str
    weight: float
    score: Callable[[Ask, Candidate], float]


class Verdict(NamedTuple):
    """One candidate's passage through a profile: ``dropped`` (and no scores), or each
    scorer's raw score (in the profile's order) and the ``total``."""

    candidate: Candidate
    dropped: Drop | None = None
    scores: tuple[float, ...] = ()
    total: float = 0.0


@dataclass(frozen=True, slots=True)
class Pick:
    """A profile's decision on a request's candidates: every ``verdict`` (in the
    candidates' order) and the one ``picked`` (None: every candidate was dropped)."""

    profile: Profile
    verdicts: tuple[Verdict, ...]
    picked: Candidate | None

    def dropped(self, name: str) -> list[Verdict]:
        """The verdicts of the candidates that filter ``name`` dropped."""
        return [v for v in self.verdicts if v.dropped is not None and v.dropped.filter == name]

    def as_json(self) -> dict[str, Any]:
        """The diagnosis as ``GET /admin/routes`` shows it (the raw scores unrounded)."""
        scorers = self.profile.scorers
        names = [s.name for s in scorers]
        return {
            "profile": self.profile.name,
            "picked": None if self.picked is None else self.picked.name,
            "weights": {s.name: s.weight for s in scorers},
            "candidates": [_verdict_json(v, names) for v in self.verdicts],
        }


def _verdict_json(verdict: Verdict, names: Sequence[str]) -> dict[str, Any]:
    c = verdict.candidate
    found: dict[str, Any] = {
        "name": c.name, "local": c.local, "ready": c.ready, "slots": c.slots,
        "in_flight": c.in_flight, "coming": c.coming,
    }  # fmt: skip
    dropped = verdict.dropped
    if dropped is not None:
        found["dropped"] = {"filter": dropped.filter, "why": dropped.why}
    else:
        found["scores"] = dict(zip(names, verdict.scores, strict=True))
        found["total"] = verdict.total
    return found


@dataclass(frozen=True, slots=True)
class Profile:
    """A named routing rule: ``filters`` in order, then ``scorers`` (weighted), then the
    picker (the highest total, its tie-break explicit: :meth:`pick`)."""

    name: str
    filters: tuple[Filter, ...] = ()
    scorers: tuple[Scorer, ...] = ()

    def pick(self, ask: Ask, candidates: Sequence[Candidate]) -> Pick:
        """Every candidate judged, and the one picked: the highest total; on equal
        totals, the first in :func:`tie_break`'s order."""
        verdicts: list[Verdict] = []
        best: Candidate | None = None
        best_total = 0.0
        for candidate in candidates:
            verdict = self._judge(ask, candidate)
            verdicts.append(verdict)
            if verdict.dropped is not None:
                continue
            total = verdict.total
            if (
                best is None
                or total > best_total
                or (total == best_total and tie_break(ask, candidate) < tie_break(ask, best))
            ):
                best, best_total = candidate, total
        return Pick(self, tuple(verdicts), best)

    def _judge(self, ask: Ask, candidate: Candidate) -> Verdict:
        for rule in self.filters:
            why = rule.drops(ask, candidate)
            if why is not None:
                return Verdict(candidate, Drop(rule.name, why))
        scores = tuple([s.score(ask, candidate) for s in self.scorers])
        total = 0.0
        for scorer, raw in zip(self.scorers, scores, strict=True):
            total += scorer.weight * raw
        return Verdict(candidate, None, scores, total)


def tie_break(ask: Ask, c: Candidate) -> tuple[bool, float, str, int]:
    """The picker's order among equal totals, lowest first: this host, then the
    prefix's rendezvous weight (highest), then the gateway's name and replica number."""
    weight = rendezvous(ask.prefix, c.name) if ask.prefix else 0.0
    return (not c.local, -weight, c.gateway, c.replica)


def rendezvous(key: str, name: str) -> float:
    """The rendezvous (highest random weight) hash of ``key`` on ``name``, in [0, 1): a
    key's order of preference among names, the same wherever it is worked out and
    unchanged for the others when a name comes or goes."""
    digest = hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64
