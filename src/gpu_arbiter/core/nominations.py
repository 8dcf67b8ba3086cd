"""Nominations: memory held for requests that cannot be granted yet (I6, with I5's rights).

A pending request that cannot be placed *holds* memory on its best GPUs: every request
behind it in the walk may use only what a GPU has beyond the holds ahead of it. So a
large request is never starved by a stream of small ones::

    walk order:   r1  needs 20 GiB, fits nowhere: holds 20 GiB of gpu A (most room)
                  r2  needs  8 GiB: room on A = free(A) - 20 GiB
                  r3  ...           room on A = free(A) - 20 GiB - what r2 holds there

    room(g, r) = free(g) - sum of the holds on g made before r's turn, less those lifted
    r is granted on g only if room(g, r) >= r.vram_mb

A hold lasts one cycle (:class:`Holds`: the cycle's scratch), but for the memory a
preemption frees, which its preemptor keeps from one cycle to the next
(:class:`Nomination`) while its victims are stopping, until the probe shows their memory
back, and for as long as the preemptor fits there. That memory is *pre-held* at the start
of each cycle against every request of equal or lower base priority, even one that aging
moved ahead of it (else a stream of aged requests could take it, and the preemption would
repeat); for a request of higher base priority it is *lifted* during that request's turn
(I5: that request could preempt the preemptor right after its grant anyway)::

    prehold(preemptor)  ──►  turn(request):  own prehold lifted for good (it may use it),
                                             lower-priority preholds lifted for the turn
                             end_turn()      the lifted ones held again

A GPU pre-held for a preemptor of equal or higher base priority is not held again by the
nomination of a request that is no more important: a GPU's memory is claimed once.
"""

from __future__ import annotations

from collections.abc import KeysView
from dataclasses import dataclass, field
from typing import NamedTuple

from .ledger import Ledger
from .model import GpuId, Request

__all__ = ["Hold", "Holds", "Nomination"]


@dataclass(slots=True)
class Nomination:
    """Memory being freed by preemption, held for its preemptor across cycles.

    ``victims``: the revoked leases not yet ended; ``probe_seqs``: for each GPU, the probe
    reading current when the last victim there ended (the memory counts as back only once
    a later reading shows it)."""

    gpus: tuple[GpuId, ...]
    victims: set[str]
    probe_seqs: dict[GpuId, int] = field(default_factory=dict)

    def victim_ended(self, lease_id: str, ledger: Ledger) -> None:
        """A victim ended: its memory is back once the next probe reading shows it."""
        if lease_id not in self.victims:
            return
        self.victims.discard(lease_id)
        for gpu_id in self.gpus:
            if gpu_id in ledger and ledger.has_probe(gpu_id):
                self.probe_seqs[gpu_id] = ledger.probe_seq(gpu_id)

    def preempting(self, ledger: Ledger) -> bool:
        """Victims still stopping, or gone but not yet shown free by the probe."""
        if self.victims:
            return True
        return any(g in ledger and ledger.probe_seq(g) == seq for g, seq in self.probe_seqs.items())


class Hold(NamedTuple):
    """One hold of a cycle's walk, as a check reads it: ``request_id`` held ``vram_mb`` on
    each of ``gpus`` against the requests behind it in walk order. ``preheld``: memory its
    own preemption freed, held from the start of the walk against every request of equal or
    lower base priority until its own turn (lifted, for the turn, for a request of higher
    base priority); otherwise a hold made at its turn, standing for the rest of the walk."""

    request_id: str
    gpus: tuple[GpuId, ...]
    vram_mb: int
    preheld: bool


@dataclass(slots=True)
class _Prehold:
    gpus: tuple[GpuId, ...]
    vram_mb: int
    priority: int


class Holds:
    """The holds of one cycle's walk, and the journal of who held what, in walk order
    (a request's :class:`~.diagnosis.Turn` counts the entries before it; its "why" names
    the first of them on the GPU whose hold stands in the way)."""

    __slots__ = ("_preheld", "by_gpu", "journal", "preholds")

    def __init__(self) -> None:
        self.by_gpu: dict[GpuId, int] = {}
        self.journal: list[tuple[str, tuple[GpuId, ...], int]] = []
        self.preholds = 0  # the journal's first entries are the preholds
        self._preheld: dict[str, _Prehold] = {}

    def __contains__(self, gpu_id: object) -> bool:
        return gpu_id in self.by_gpu

    def held_mb(self, gpu_id: GpuId) -> int:
        return self.by_gpu.get(gpu_id, 0)

    @property
    def preheld(self) -> KeysView[str]:
        """The preemptors whose memory is pre-held and whose turn has not come."""
        return self._preheld.keys()

    def prehold(self, request: Request, gpus: tuple[GpuId, ...]) -> None:
        """Holds a preemptor's memory from the start of the walk (see the module); made
        before the walk's first turn, so the journal's first :attr:`preholds` entries are
        the preholds."""
        self.hold(request, gpus, own=True)
        self.preholds += 1
        self._preheld[request.id] = _Prehold(gpus, request.vram_mb, request.priority)

    def turn(self, request: Request) -> tuple[bool, list[tuple[GpuId, int]]]:
        """``request``'s turn begins: its own prehold no longer stands in its way, and the
        preholds of preemptors of lower base priority are lifted for the turn. Returns
        whether it was pre-held, and what was lifted (for :meth:`end_turn`)."""
        own = self._preheld.pop(request.id, None)
        if own is not None:
            for gpu_id in own.gpus:
                self.by_gpu[gpu_id] -= own.vram_mb
        lifted = []
        for other in self._preheld.values():
            if other.priority < request.priority:
                for gpu_id in other.gpus:
                    self.by_gpu[gpu_id] -= other.vram_mb
                    lifted.append((gpu_id, other.vram_mb))
        return own is not None, lifted

    def end_turn(self, lifted: list[tuple[GpuId, int]]) -> None:
        for gpu_id, mb in lifted:
            self.by_gpu[gpu_id] += mb

    def hold(self, request: Request, gpus: tuple[GpuId, ...], *, own: bool = False) -> None:
        """Holds ``gpus`` for ``request`` against the requests behind it. Memory its own
        preemption frees (``own``) is always held; otherwise a GPU pre-held for a preemptor
        of equal or higher base priority stays that preemptor's."""
        held = gpus
        if not own and self._preheld:
            reserved = self._reserved(exclude=request.id)
            held = tuple(g for g in gpus if reserved.get(g, -1) < request.priority)
        for gpu_id in held:
            self.by_gpu[gpu_id] = self.by_gpu.get(gpu_id, 0) + request.vram_mb
        self.journal.append((request.id, held, request.vram_mb))

    def _reserved(self, exclude: str) -> dict[GpuId, int]:
        """GPUs pre-held for other preemptors -> the highest base priority among them."""
        reserved: dict[GpuId, int] = {}
        for rid, other in self._preheld.items():
            if rid != exclude:
                for gpu_id in other.gpus:
                    reserved[gpu_id] = max(reserved.get(gpu_id, -1), other.priority)
        return reserved
