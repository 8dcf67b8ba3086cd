"""The cluster's catalogue: the models declared once, at the controller, kept as numbered
revisions in the store, so that a restarted controller, or a standby that takes over,
serves the one the last leader stored.

A revision's life::

    (text) --apply (an admin; the server checked the text)--> revision N+1, current
    (text equal to the current revision's) --apply--> nothing new ("unchanged")

The controller keeps the text as it was applied, opaque: what it says is the gateway
package's to read (``gateway/catalogue.py``), which the server checks it with before it
is applied, and each gateway reads its share with. Every revision is kept (text,
SHA-256, when, by whom); they are small.

An apply is a change like any other: the revision is stored in the change's
transaction (fenced on a shared store), with a ``catalogue.applied`` event, before
anyone is told; a change that cannot be stored leaves memory as the store holds it
(the reload restores this module too). Readers that wait for a revision above the one
they have (a long-poll) are woken once one is stored, or restored (a standby's copy).

Owns the revisions. Its part of every change (a :class:`~.change.Participant`):
:meth:`CatalogueRevisions.encode` writes the revision a change made, and
:meth:`CatalogueRevisions.stored` wakes the readers that wait for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Iterable

from ..store import Batch, CatalogueRevision
from .change import Change, Changes, Participant

__all__ = ["CatalogueRevisions"]


class CatalogueRevisions(Participant):
    def __init__(self, changes: Changes) -> None:
        self._changes = changes
        self._revisions: list[CatalogueRevision] = []  # oldest first, numbered 1, 2, ...
        self._moved = asyncio.Event()

    # ------------------------------------------------------------------ readers

    @property
    def current(self) -> CatalogueRevision | None:
        """The latest revision, if one was ever applied."""
        return self._revisions[-1] if self._revisions else None

    def revision(self, number: int) -> CatalogueRevision | None:
        """Revision ``number`` (numbered 1, 2, ...: found at its place, else looked for)."""
        if 1 <= number <= len(self._revisions) and self._revisions[number - 1].revision == number:
            return self._revisions[number - 1]
        return next((r for r in self._revisions if r.revision == number), None)

    def history(self) -> list[CatalogueRevision]:
        """Every revision, newest first."""
        return self._revisions[::-1]

    async def wait_after(self, number: int, timeout_s: float) -> CatalogueRevision | None:
        """The current revision as soon as it is above ``number`` (at once if it is), or
        as it is after ``timeout_s`` or once the controller stops (a long-poll)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        stopping = self._changes.gate.stopping
        while True:
            current = self.current
            left = deadline - loop.time()
            if (current is not None and current.revision > number) or left <= 0:
                return current
            if stopping.is_set():
                return current
            moved = self._moved
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(moved.wait(), min(left, 1.0))

    # ------------------------------------------------------------------ the change

    def apply(self, text: str, file: str, by: str) -> tuple[CatalogueRevision, bool]:
        """``text`` (read from ``file``, applied by the token ``by``) becomes the next
        revision, stored with a ``catalogue.applied`` event before it returns (or once
        the change's transaction is durable, with group commit); the revision and True.
        A text equal to the current revision's makes none: that revision and False.
        The caller checked the text (the controller keeps it opaque)."""
        self._changes.gate.check_available()
        digest = hashlib.sha256(text.encode()).hexdigest()
        current = self.current
        if current is not None and current.sha256 == digest and current.text == text:
            return current, False
        with self._changes.change() as change:
            number = 1 if current is None else current.revision + 1
            revision = CatalogueRevision(number, text, digest, change.now, by, file)
            self._revisions.append(revision)
            change.catalogue.append(revision)
            change.event(
                "catalogue.applied", revision=number, by=by, sha256=digest, file=file,
                size=len(text.encode()),
            )  # fmt: skip
        return revision, True

    def encode(self, change: Change, batch: Batch) -> None:
        batch.catalogue.extend(change.catalogue)

    def stored(self, batch: Batch) -> None:
        if batch.catalogue:
            self._wake()

    def _wake(self) -> None:
        self._moved.set()
        self._moved = asyncio.Event()

    # ------------------------------------------------------------------ restore

    def restore(self, revisions: Iterable[CatalogueRevision]) -> None:
        """The revisions as the store holds them (at a start, a reload, a standby's
        copy); readers waiting for a newer one are woken when the latest moved."""
        before = self.current
        self._revisions = sorted(revisions, key=lambda r: r.revision)
        if self.current != before:
            self._wake()
