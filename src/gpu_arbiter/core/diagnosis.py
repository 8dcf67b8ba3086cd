"""Why a request is not placed, as the walk finds it (Kubernetes keeps the filters'
``Diagnosis`` the same way).

For a request it examines and does not place, the walk writes down how many GPUs said
each :class:`~.outcomes.Outcome` (the first stage of :mod:`.stages` that says no, or
``fits``) and, for each outcome, the GPU nearest to taking it (most room beyond the
holds), with its figures. The plan carries these; every "why" (a 202's reason, the
queue, the dashboard, a gateway's comment lines) is read from them (:mod:`.explain`),
and a rejection is a diagnosis whose every outcome is one nothing will help.

It costs no pass over the GPUs. What does not match is counted once per shape (the
state caches it with the matching GPUs); GPUs that may take no new work, GPUs held this
cycle, changed by the plan or loading are few and each is asked the stages; the rest
differ only by free memory, so the ledger's free-memory index counts them by bisection
when every GPU matches (else the matching GPUs are counted one by one: a constrained
request matches few). A property test checks the counts against the stages asked of
every GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .model import GpuId, Request, slot_init
from .nominations import Holds
from .outcomes import Outcome
from .overlay import Overlay
from .reasons import GpuVerdict, offered_mb
from .stages import State, fit_code, outcome

__all__ = ["Diagnosis", "Turn", "diagnose"]

_ORDER = {code: i for i, code in enumerate(Outcome)}


class Reads(State, Protocol):
    """What a diagnosis reads: the stages' state, over the ledger under the plan's own
    changes, with the state's caches."""

    @property
    def ledger(self) -> Overlay: ...
    @property
    def index(self) -> Sequence[tuple[int, GpuId]]: ...
    def mismatches(self, request: Request) -> Mapping[Outcome, tuple[int, GpuId]]: ...
    def unusable(self) -> Mapping[GpuId, Outcome]: ...


@slot_init
@dataclass(frozen=True, slots=True)
class Turn:
    """Where the walk stood when it examined a request and did not place it: the holds
    ahead of it (``held``: GPU -> MiB, as the request saw them; ``holds``: how many of the
    plan's holds came before it) and how many of the plan's grants it saw (``grants``).
    What its diagnosis is worked out from, on the first "why" that asks. ``waits_on``: the
    post-filter's answer, when memory already being revoked there will make room for it
    (the why names those leases, there)."""

    held: Mapping[GpuId, int]
    holds: int
    grants: int
    waits_on: tuple[GpuId, ...] = ()


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """``verdicts``: for each outcome, the GPU nearest to taking the request, its figures
    and ``count``, how many GPUs said that outcome (most first); ``loading``: the GPUs
    whose load gate alone is in the way; ``held``: the memory held against it at its turn,
    per GPU (MiB; the holds ahead of it, I6), what the walk placed it against.

    ``journal`` and ``ahead``: the walk's holds in walk order, the first ``ahead`` of them
    made before its turn (:meth:`holds_on` reads them: who held a GPU)."""

    need_mb: int
    verdicts: tuple[GpuVerdict, ...]
    loading: tuple[GpuId, ...] = ()
    held: Mapping[GpuId, int] = field(default_factory=dict)
    journal: Sequence[tuple[str, tuple[GpuId, ...], int]] = field(
        default=(), compare=False, repr=False
    )
    ahead: int = field(default=0, compare=False, repr=False)

    def holds_on(self, gpu_id: GpuId) -> Iterator[tuple[int, str]]:
        """The holds made before its turn that cover ``gpu_id``, in walk order: each one's
        place in the walk's journal (the plan's preholds come first,
        :attr:`~.plan.Plan.preholds`) and its request."""
        for i in range(min(self.ahead, len(self.journal))):
            request_id, gpus, _ = self.journal[i]
            if gpu_id in gpus:
                yield i, request_id

    def count(self, code: Outcome) -> int:
        return next((v.count for v in self.verdicts if v.code == code), 0)

    @property
    def codes(self) -> frozenset[Outcome]:
        return frozenset(Outcome(v.code) for v in self.verdicts)

    @property
    def total(self) -> int:
        return sum(v.count for v in self.verdicts)


def diagnose(at: Reads, request: Request, holds: Holds) -> Diagnosis:
    """Why ``request`` is not placed against the holds ahead of it (see the module)."""
    ledger, need = at.ledger, request.vram_mb
    held = holds.by_gpu
    matching = at.matching(request)
    counts: dict[Outcome, int] = {}
    nearest: dict[Outcome, tuple[int, GpuId]] = {}

    def note(code: Outcome, gpu_id: GpuId, room: int, n: int = 1) -> None:
        counts[code] = counts.get(code, 0) + n
        best = nearest.get(code)
        if best is None or (-room, gpu_id) < (-best[0], best[1]):
            nearest[code] = (room, gpu_id)

    for code, (n, sample) in at.mismatches(request).items():
        note(code, sample, ledger.free_mb(sample), n)
    asked: set[GpuId] = set()
    for gpu_id, code in at.unusable().items():
        if gpu_id in matching:
            asked.add(gpu_id)
            note(code, gpu_id, ledger.free_mb(gpu_id))
    loading = _ask(at, request, holds, matching, asked, note)
    index = at.index
    if len(matching) == len(index) and request.gpus == 1:
        _by_bisection(at, need, asked, note)
    else:
        for gpu_id in matching:
            if gpu_id not in asked:
                free = ledger.free_mb(gpu_id)
                note(Outcome.INSUFFICIENT_VRAM if free < need else Outcome.FITS, gpu_id, free)
    if request.gpus > 1 and Outcome.FITS in counts:
        _too_few(at, request, held, counts, nearest)
    verdicts = tuple(  # nearest to fitting first: the stages' order, backwards
        _verdict(ledger, code, gpu_id, need, held.get(gpu_id, 0), counts[code])
        for code, (_, gpu_id) in sorted(nearest.items(), key=lambda item: -_ORDER[item[0]])
    )
    journal = holds.journal
    return Diagnosis(need, verdicts, tuple(sorted(loading)), dict(held), journal, len(journal))


Note = Callable[[Outcome, GpuId, int, int], None]


def _ask(
    at: Reads,
    request: Request,
    holds: Holds,
    matching: frozenset[GpuId],
    asked: set[GpuId],
    note: Note,
) -> list[GpuId]:
    """The GPUs the index cannot count: changed by the plan (their free memory is not the
    index's), and, with room for the request, held this cycle or loading (a hold ahead or
    the load gate may be in the way): asked the fit stages one by one (they are few; every
    other GPU's outcome is its free memory's). Returns those whose load gate alone is in
    the way."""
    held, ledger, need = holds.by_gpu, at.ledger, request.vram_mb
    raw, limit = ledger.ledger, at.policy.max_concurrent_loads
    candidates = [*ledger.touched]
    for group in (held, ledger.loading_ids()):
        candidates += [g for g in group if g in raw and raw.free_mb(g) >= need]
    loading: list[GpuId] = []
    for gpu_id in candidates:
        if gpu_id in asked or gpu_id not in matching:
            continue
        asked.add(gpu_id)
        free, hold = ledger.free_mb(gpu_id), held.get(gpu_id, 0)
        code = fit_code(free, hold, ledger.loading(gpu_id), need, limit) or Outcome.FITS
        note(code, gpu_id, free if code is Outcome.INSUFFICIENT_VRAM else free - hold, 1)
        if code is Outcome.LOAD_IN_PROGRESS:
            loading.append(gpu_id)
    return loading


def _by_bisection(at: Reads, need: int, asked: set[GpuId], note: Note) -> None:
    """Every GPU matches: those not asked one by one differ only by the ledger's free
    memory, counted in its index. The nearest of each outcome: the most free, then the
    lowest GPU id (as one by one)."""
    index = at.index
    cut = bisect.bisect_left(index, (need,))
    raw = at.ledger.ledger
    below = cut - sum(1 for g in asked if raw.free_mb(g) < need)
    if below:
        note(Outcome.INSUFFICIENT_VRAM, *_most_free(index, 0, cut, asked), below)
    above = len(index) - cut - sum(1 for g in asked if raw.free_mb(g) >= need)
    if above:
        note(Outcome.FITS, *_most_free(index, cut, len(index), asked), above)


def _most_free(
    index: Sequence[tuple[int, GpuId]], start: int, stop: int, asked: set[GpuId]
) -> tuple[GpuId, int]:
    """The entry of ``index[start:stop]`` not asked with the most free memory, the lowest
    GPU id among equals (the index ascends by free memory, then id)."""
    i = stop - 1
    while index[i][1] in asked:
        i -= 1
    most = index[i][0]
    j = max(start, bisect.bisect_left(index, (most,)))
    while index[j][1] in asked:
        j += 1
    return index[j][1], most


def _too_few(
    at: Reads,
    request: Request,
    held: Mapping[GpuId, int],
    counts: dict[Outcome, int],
    nearest: dict[Outcome, tuple[int, GpuId]],
) -> None:
    """A request of several GPUs: GPUs that fit, on no worker with enough of them, say
    ``too_few_gpus_on_worker`` (GPUs that fit on a worker with enough stay ``fits``)."""
    per_worker: dict[str, int] = {}
    for gpu_id in at.matching(request):
        if outcome(at, request, gpu_id, held) is None:
            per_worker[gpu_id.worker] = per_worker.get(gpu_id.worker, 0) + 1
    if any(n >= request.gpus for n in per_worker.values()):
        return
    n = counts.pop(Outcome.FITS)
    room, gpu_id = nearest.pop(Outcome.FITS)
    counts[Outcome.TOO_FEW_GPUS_ON_WORKER] = counts.get(Outcome.TOO_FEW_GPUS_ON_WORKER, 0) + n
    nearest.setdefault(Outcome.TOO_FEW_GPUS_ON_WORKER, (room, gpu_id))


def _verdict(
    ledger: Overlay, code: Outcome, gpu_id: GpuId, need: int, held: int, count: int
) -> GpuVerdict:
    return GpuVerdict(
        gpu_id,
        code,
        need_mb=need,
        free_mb=offered_mb(code, ledger.free_mb(gpu_id)),
        committed_mb=ledger.committed_mb(gpu_id),
        observed_mb=ledger.observed_mb(gpu_id),
        held_mb=held,
        count=count,
    )
