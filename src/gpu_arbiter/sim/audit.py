"""Where ours' waiting went: each pending request, step by step, against the memory of
every GPU it could use.

:class:`Audit` is :class:`.ours.Ours` that, after every ``decide``, puts each pending
request in one of four kinds, by what the GPUs it matches hold beyond the memory held
there for requests ahead of it (I6: ``explain``'s ``held_mb``), on one worker, as many GPUs
as it asks for:

``free``        free memory alone would hold it: the core holds it back (a load gate,
                memory on its way back), or this is a fault (I10);
``idle_now``    free memory and the idle (keep-warm) leases it may reclaim at once would
                hold it: it waits for a victim to stop, or this is a fault;
``idle_later``  only with idle leases that I5 protects from it for now (a higher
                priority's warm model, until ``idle_reclaim_s`` or ``starvation_s``);
``busy``        only by preempting busy work, which its priority may not.

Each stretch of time a request spends in one kind with one reason is a :class:`Spell`:
the core's own reason (``explain``: its code, and the rule of the lease it waits for
last), what the core said of each GPU counted (``verdicts``), whether the load gate of
one of them was closed (``gated``, I3), whether another request could hold memory against
it (``behind``: one ahead of it in the queue, or one that holds memory its preemption
frees; I6), and whether memory is on its way back on a GPU it could use (``stopping``: a
revoked lease whose holder has not stopped yet; the core then waits for that memory
rather than revoke more). ``Audit.spells`` lists them; :func:`totals`
adds them up per class, kind and reason. A spell ends at the next step, so it counts the
time until the core looked again (it runs at every event and at every deadline a rule
sets).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..core import GpuId, PendingReason, Policy, Request
from ..core.preemption import eligible_from
from .base import Step, priority_class
from .cluster import Cluster
from .ours import Ours

__all__ = ["KINDS", "Audit", "Spell", "totals"]

KINDS = ("free", "idle_now", "idle_later", "busy")


@dataclass(frozen=True, slots=True)
class Spell:
    """``request_id`` waited from ``start`` to ``end`` in ``kind`` (see the module);
    ``reason``: the core's code, and the rule of the lease it waits for (``code/rule``);
    ``verdicts``: the core's verdict on each of ``gpus``; ``gated``: one of them had its
    load gate closed; ``behind``: another request could hold memory against it;
    ``stopping``: memory was on its way back on a GPU it could use."""

    request_id: str
    priority: int
    start: float
    end: float
    kind: str
    reason: str
    gpus: tuple[GpuId, ...]
    verdicts: tuple[str, ...] = ()
    gated: bool = False
    behind: bool = False
    stopping: bool = False

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Audit(Ours):
    """Ours, auditing every step (see the module). ``classes``: the priority classes to
    audit (:func:`.base.priority_class` names); all of them when empty."""

    name = "ours"

    def __init__(
        self, cluster: Cluster, policy: Policy | None = None, classes: Iterable[str] = ()
    ) -> None:
        super().__init__(cluster, policy)
        self.classes = frozenset(classes)
        self.spells: list[Spell] = []
        self._open: dict[str, Spell] = {}

    def decide(self, now: float) -> Step:
        step = super().decide(now)
        seen = set()
        nominated = set(self.scheduler.nominations)
        for position, request, _ in self.scheduler.pending(now):
            behind = position > 1 or bool(nominated - {request.id})
            if self.classes and priority_class(request.priority) not in self.classes:
                continue
            seen.add(request.id)
            why = self.scheduler.explain(request.id, now)
            held = {verdict.gpu: verdict.held_mb for verdict in why.gpus}
            kind, gpus = self.kind(request, now, held)
            codes = {verdict.gpu: str(verdict.code) for verdict in why.gpus}
            verdicts = tuple(codes.get(gpu_id, "") for gpu_id in gpus)
            spell = Spell(request.id, request.priority, now, now, kind, "", gpus, verdicts)
            spell = dataclasses.replace(spell, gated=self.gated(gpus), behind=behind)
            self._note(spell, _reason(why), self.stopping(request))
        for request_id in [r for r in self._open if r not in seen]:
            self._close(request_id, now)
        return step

    def finish(self, now: float) -> list[Spell]:
        """Ends every open spell at ``now``; returns all spells."""
        for request_id in list(self._open):
            self._close(request_id, now)
        return self.spells

    def kind(
        self, request: Request, now: float, held: Mapping[GpuId, int]
    ) -> tuple[str, tuple[GpuId, ...]]:
        """The first of :data:`KINDS` in which ``request.gpus`` GPUs of one worker would hold
        it beyond ``held`` (MiB held there for requests ahead), with those GPUs (none for
        ``busy``)."""
        by_worker: dict[str, list[tuple[int, GpuId]]] = {}
        for gpu_id in sorted(self.scheduler.matching(request)):
            level = self._level(request, gpu_id, now, held.get(gpu_id, 0))
            by_worker.setdefault(gpu_id.worker, []).append((level, gpu_id))
        best: tuple[int, tuple[GpuId, ...]] = (len(KINDS) - 1, ())
        for levels in by_worker.values():
            chosen = sorted(levels)[: request.gpus]
            if len(chosen) < request.gpus:
                continue
            level = max(lv for lv, _ in chosen)
            if level < best[0]:
                best = (level, tuple(g for _, g in chosen))
        return KINDS[best[0]], best[1]

    def _level(self, request: Request, gpu_id: GpuId, now: float, held_mb: int) -> int:
        scheduler = self.scheduler
        figures = scheduler.figures(gpu_id)
        room = [figures.free_mb - held_mb, 0, 0]
        for lease_id in figures.lease_ids:
            lease = scheduler.leases[lease_id]
            if not lease.idle or lease.revoke_reason is not None:
                continue
            now_or_later = 1 if eligible_from(lease, request, scheduler.policy) <= now else 2
            room[now_or_later] += lease.vram_mb
        total = 0
        for level, mb in enumerate(room):
            total += mb
            if total >= request.vram_mb:
                return level
        return len(KINDS) - 1

    def gated(self, gpus: Iterable[GpuId]) -> bool:
        """Whether a load in progress closes the load gate of one of ``gpus`` (I3)."""
        limit = self.scheduler.policy.max_concurrent_loads
        return any(self.scheduler.figures(gpu_id).loading >= limit for gpu_id in gpus)

    def stopping(self, request: Request) -> bool:
        """Whether a revoked lease still holds memory on a GPU the request could use."""
        scheduler = self.scheduler
        return any(
            scheduler.leases[lease_id].revoke_reason is not None
            for gpu_id in scheduler.matching(request)
            for lease_id in scheduler.figures(gpu_id).lease_ids
        )

    def _note(self, new: Spell, reason: str, stopping: bool) -> None:
        new = dataclasses.replace(new, reason=reason, stopping=stopping)
        spell = self._open.get(new.request_id)
        if spell is not None and _same(spell, new):
            return
        if spell is not None:
            self._close(new.request_id, new.start)
        self._open[new.request_id] = new

    def _close(self, request_id: str, now: float) -> None:
        spell = self._open.pop(request_id)
        if now > spell.start:
            self.spells.append(dataclasses.replace(spell, end=now))


def _reason(why: PendingReason) -> str:
    blocker = why.blocker
    if blocker is None:
        return why.code
    return f"{why.code}/{blocker.rule or blocker.state or blocker.kind}"


def _same(a: Spell, b: Spell) -> bool:
    return dataclasses.replace(a, start=b.start, end=b.end) == b


def totals(spells: Sequence[Spell]) -> dict[tuple[str, str, str], float]:
    """Seconds waited per (class, kind, reason)."""
    out: dict[tuple[str, str, str], float] = {}
    for spell in spells:
        key = (priority_class(spell.priority), spell.kind, spell.reason)
        out[key] = out.get(key, 0.0) + spell.seconds
    return out
