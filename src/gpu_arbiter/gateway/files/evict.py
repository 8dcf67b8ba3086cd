"""Which model files to remove to keep a host within its ``disk_budget``: pure.

The files no replica uses go, least recently used first (the store's record of last
use; ties by name), and only as many as it takes for the files held, plus a copy about
to be made (``incoming``), to fit the budget. A file a replica uses never goes. When
even all of those would not make it fit, :func:`evictions` says so (``fits`` False):
the caller then refuses a copy before its first byte and removes nothing for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Eviction", "Held", "evictions"]


@dataclass(frozen=True, slots=True)
class Held:
    """A file of the store: its size in bytes, when it was last used (the store's
    clock), and whether a replica uses it now."""

    name: str
    size: int
    last_used: float
    in_use: bool = False


@dataclass(frozen=True, slots=True)
class Eviction:
    """The files to remove, in the order to remove them, and whether the store fits its
    budget once they are gone."""

    remove: tuple[str, ...]
    fits: bool


def evictions(held: Sequence[Held], budget: int | None, incoming: int = 0) -> Eviction:
    """The least recently used files nobody uses whose removal brings the held files plus
    ``incoming`` bytes within ``budget`` (None: no budget); when no removal can, every
    file nobody uses, and ``fits`` False."""
    total = sum(h.size for h in held) + incoming
    if budget is None or total <= budget:
        return Eviction((), True)
    unused = sorted((h for h in held if not h.in_use), key=lambda h: (h.last_used, h.name))
    remove: list[str] = []
    for found in unused:
        remove.append(found.name)
        total -= found.size
        if total <= budget:
            return Eviction(tuple(remove), True)
    return Eviction(tuple(remove), False)
