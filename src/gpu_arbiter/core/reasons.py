"""Why a request is still pending: structured, and one human line.

Codes: :class:`~.outcomes.Why` (one enum, its values the API's codes). A reason is built
from the walk's :class:`~.diagnosis.Diagnosis` (:mod:`.explain`); its ``gpus`` are the
diagnosis' verdicts: for each outcome the GPU nearest to taking the request, with how
many GPUs said it.

The last three name what is in the way (a :class:`Blocker`: the loading lease, the
preempted lease still stopping, the request ahead), with its holder and when it ends
at the latest, in the structured fields and in the sentence alike. So does
``insufficient_vram`` when nothing but leases is in the way on a candidate GPU
(:func:`lease_blockers`): each lease that must go, idle or busy, loading or revoking,
with its priority, and when it gives way to this request and by which rule (I5: an
idle lease after ``idle_reclaim_s`` or once the request waited ``starvation_s``; a
busy one after ``preempt_exempt_s`` and ``preempt_patience_s``; a revoked one when its
holder stops, at the latest grace + TTL after its revocation; never, when this
priority may not preempt it). It is worked out only for a request that waits, on the
GPU nearest to taking it (for several GPUs, that GPU's worker).

Every figure of a reason is finite, as JSON carries it: a time that does not exist is
None (:func:`moment`): no TTL (the core's lease without one expires at ``inf``), never
giving way; a lease reclaimable at once gave way when it went idle or when the request
came, whichever is later.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from .ledger import Ledger
from .model import GpuId, Lease, LeaseState, Policy, Request
from .outcomes import Outcome, Why
from .preemption import giving_way
from .units import format_mb, format_s, priority_name

__all__ = [
    "Blocker",
    "GpuVerdict",
    "PendingReason",
    "lease_blockers",
    "leases_in_the_way",
    "moment",
]


def moment(at: float | None) -> float | None:
    """A time as a reason carries it: finite, or None where there is none (``inf``: a
    lease without a TTL never expires; a rule that never applies never gives way)."""
    return at if at is not None and math.isfinite(at) else None


def offered_mb(code: Outcome, free_mb: int) -> int:
    """The free memory a verdict shows: what the GPU's books say (never below 0), but 0 on
    a GPU that may take no new work (its worker offline, draining or drained, its probe
    stale: I2, I7), whose memory is never offered as room, however much its books hold."""
    return 0 if code.helped_by == "an event" else max(0, free_mb)


@dataclass(frozen=True, slots=True)
class GpuVerdict:
    """Why one GPU could not take the request (or ``fits``), with its figures; ``count``:
    how many GPUs say the same (this one the nearest of them to taking it). ``free_mb``:
    :func:`offered_mb`."""

    gpu: GpuId
    code: str
    need_mb: int = 0
    free_mb: int = 0
    committed_mb: int = 0
    observed_mb: int = 0
    held_mb: int = 0
    count: int = 1

    def as_dict(self) -> dict[str, object]:
        return {
            "count": self.count,
            "gpu": str(self.gpu),
            "code": self.code,
            "need_mb": self.need_mb,
            "free_mb": self.free_mb,
            "committed_mb": self.committed_mb,
            "observed_mb": self.observed_mb,
            "held_mb": self.held_mb,
        }


@dataclass(frozen=True, slots=True)
class Blocker:
    """What a pending request waits on, by name.

    ``kind``: ``loading`` (a lease whose load holds the GPU's load gate), ``revoking`` (a
    preempted lease whose holder has not stopped yet) or ``request`` (a request ahead in
    the queue that holds the memory). ``since``: loading since, revoked at, or waiting
    since. ``until``: when it ends at the latest (the load timeout; the end of the
    grace). ``expires_at``: its TTL, which ends it sooner unless it is renewed (None: it
    has no TTL).

    ``kind`` ``lease``: a lease in the way of an ``insufficient_vram`` request. Its
    ``state`` (``idle``, ``busy``, ``loading``, ``revoking``), its ``priority`` (base),
    ``until``: when it gives way to the request (None: never; for a revoked lease, its
    expiry, None when no TTL bounds it; for one reclaimable at once, when it became so:
    a time past), and ``rule``: why then (``at_once``, ``idle_reclaim_s``,
    ``starvation_s``, ``preempt_exempt_s``, ``preempt_patience_s``, ``revoking``) or why
    never (``not_preemptible``, ``never_preempt``).

    Every time is finite or None (:func:`moment`)."""

    kind: str
    id: str
    holder: str | None
    gpus: tuple[GpuId, ...]
    since: float
    until: float | None = None
    expires_at: float | None = None
    state: str | None = None
    priority: int | None = None
    rule: str | None = None

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "kind": self.kind,
            "id": self.id,
            "holder": self.holder,
            "gpus": [str(g) for g in self.gpus],
            "since": self.since,
            "until": self.until,
            "expires_at": self.expires_at,
        }
        if self.kind == "lease":
            out["state"] = self.state
            out["priority"] = self.priority
            out["priority_name"] = None if self.priority is None else priority_name(self.priority)
            out["rule"] = self.rule
        return out

    @property
    def who(self) -> str:
        """``lease L (holder 'chat')``, ``request R (holder 'big-train')``."""
        noun = "request" if self.kind == "request" else "lease"
        return f"{noun} {self.id}" + (f" (holder {self.holder!r})" if self.holder else "")


@dataclass(frozen=True, slots=True)
class PendingReason:
    """Why a request waits: a ``code``, the sentence (``message``), each GPU's verdict,
    the GPUs nominated for it, and what is in the way: ``blocker`` (named, with its
    holder and times) and ``blocked_by``, its id (for ``preempting``, only once the
    victim has let its grace pass). ``blockers``: every lease in the way of an
    ``insufficient_vram`` request (``blocker`` is the one it waits for last)."""

    code: Why
    message: str
    gpus: tuple[GpuVerdict, ...] = ()
    nominated: tuple[GpuId, ...] = ()
    blocked_by: str | None = None
    blocker: Blocker | None = None
    blockers: tuple[Blocker, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {
            "code": self.code,
            "message": self.message,
            "gpus": [v.as_dict() for v in self.gpus],
            "nominated": [str(g) for g in self.nominated],
            "blocked_by": self.blocked_by,
            "blocker": None if self.blocker is None else self.blocker.as_dict(),
            "blockers": [b.as_dict() for b in self.blockers],
        }


def summarize(verdicts: tuple[GpuVerdict, ...], need_mb: int) -> str:
    """'0/12 GPUs fit: 8 insufficient_vram (need 20480, most free 16384), 4 arch_mismatch'."""
    counts: Counter[str] = Counter()
    for verdict in verdicts:
        counts[verdict.code] += verdict.count
    parts = []
    for code, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        text = f"{count} {code}"
        if code == "insufficient_vram":
            most = max(v.free_mb for v in verdicts if v.code == code)
            text += f" (need {format_mb(need_mb)}, most free {format_mb(max(most, 0))})"
        elif code == "nominated_for":
            held = max(v.held_mb for v in verdicts if v.code == code)
            text += f" (up to {format_mb(held)} held for requests ahead)"
        parts.append(text)
    return f"0/{counts.total()} GPUs fit: " + ", ".join(parts)


def _gpus(blocker: Blocker) -> str:
    return ", ".join(map(str, blocker.gpus))


def loading_sentence(blocker: Blocker, now: float) -> str:
    """'lease L (holder 'chat') has been loading on vm:0 for 12s; the gate opens when it is
    ready, at the latest in 4.8m (its load timeout), or in 18s if its TTL lapses unrenewed'."""
    text = (
        f"{blocker.who} has been loading on {_gpus(blocker)} for "
        f"{format_s(now - blocker.since)}; the gate opens when it is ready"
    )
    if blocker.until is not None:
        text += f", at the latest in {format_s(blocker.until - now)} (its load timeout)"
    if blocker.expires_at is not None and (
        blocker.until is None or blocker.expires_at < blocker.until
    ):
        text += f", or in {format_s(blocker.expires_at - now)} if its TTL lapses unrenewed"
    return text


def revoking_sentence(blocker: Blocker, now: float, grace_s: float) -> str:
    """'lease V (holder 'batch') was preempted 3s ago; 7.0s of its 10s grace left to stop', or,
    past its grace, 'lease V has ignored its revocation for 24s (grace 10s)'."""
    ago = format_s(now - blocker.since)
    if blocker.until is not None and now > blocker.until:
        return f"{blocker.who} has ignored its revocation for {ago} (grace {format_s(grace_s)})"
    text = f"{blocker.who} was preempted {ago} ago"
    if blocker.until is None:
        return text
    left = format_s(blocker.until - now)
    return f"{text}; {left} of its {format_s(grace_s)} grace left to stop"


def holding_sentence(blocker: Blocker, held_mb: int) -> str:
    """'up to 20.0 GiB of vm:0 is held for request R (holder 'big-train'), ahead in the
    queue'."""
    where = _gpus(blocker)
    return f"up to {format_mb(held_mb)} of {where} is held for {blocker.who}, ahead in the queue"


# ---------------------------------------------------------------------- leases in the way

_NEVER = (math.inf, ())


def lease_blockers(
    request: Request,
    verdicts: tuple[GpuVerdict, ...],
    leases: Mapping[str, Lease],
    ledger: Ledger,
    policy: Policy,
) -> tuple[Blocker, ...]:
    """The leases an ``insufficient_vram`` request waits for, on the GPU (the worker, for
    several GPUs) where they give way first, those that give way last first; () when
    something other than leases is in the way everywhere (memory the arbiter does not know
    of, too few GPUs)."""
    if request.gpus > 1:
        return _on_worker(request, verdicts, leases, ledger, policy)
    best: tuple[float, tuple[Blocker, ...]] = _NEVER
    for verdict in verdicts:
        if verdict.code == "insufficient_vram":
            found = _on_gpu(request, verdict.gpu, leases, ledger, policy)
            if found[1] and (not best[1] or found[0] < best[0]):
                best = found
    return _last_first(best[1])


def leases_in_the_way(
    request: Request, gpu_id: GpuId, leases: Mapping[str, Lease], ledger: Ledger, policy: Policy
) -> tuple[Blocker, ...]:
    """The leases that must go for ``request`` to fit on ``gpu_id``, those that give way
    last first; () when even all of them would not make room (memory the arbiter does not
    know of)."""
    return _last_first(_on_gpu(request, gpu_id, leases, ledger, policy)[1])


def _on_worker(
    request: Request,
    verdicts: tuple[GpuVerdict, ...],
    leases: Mapping[str, Lease],
    ledger: Ledger,
    policy: Policy,
) -> tuple[Blocker, ...]:
    """For a request of several GPUs: the worker whose ``gpus`` GPUs have room first (a GPU
    with room already counts at once)."""
    per_worker: dict[str, list[tuple[float, tuple[Blocker, ...]]]] = {}
    for verdict in verdicts:
        if verdict.code == "too_few_gpus_on_worker" and verdict.free_mb >= request.vram_mb:
            found: tuple[float, tuple[Blocker, ...]] = (-math.inf, ())  # room there already
        elif verdict.code == "insufficient_vram":
            found = _on_gpu(request, verdict.gpu, leases, ledger, policy)
        else:
            continue
        if found[1] or found[0] == -math.inf:
            per_worker.setdefault(verdict.gpu.worker, []).append(found)
    best: tuple[float, str, tuple[Blocker, ...]] | None = None
    for worker, found_on in sorted(per_worker.items()):
        if len(found_on) < request.gpus:
            continue
        chosen = sorted(found_on, key=lambda item: item[0])[: request.gpus]
        at = max(item[0] for item in chosen)
        if best is None or at < best[0]:
            best = (at, worker, tuple(b for _, named in chosen for b in named))
    return () if best is None else _last_first(tuple({b.id: b for b in best[2]}.values()))


def _last_first(blockers: tuple[Blocker, ...]) -> tuple[Blocker, ...]:
    if len(blockers) < 2:
        return blockers
    return tuple(sorted(blockers, key=lambda b: (-_until(b), -_never(b), b.id)))


def _until(blocker: Blocker) -> float:
    return math.inf if blocker.until is None else blocker.until


def _never(blocker: Blocker) -> int:
    """1 for a lease that never gives way, after one that does at a time unbounded (a
    revoked lease without a TTL, back when its holder stops)."""
    return int(blocker.until is None and blocker.rule != "revoking")


def _on_gpu(
    request: Request, gpu_id: GpuId, leases: Mapping[str, Lease], ledger: Ledger, policy: Policy
) -> tuple[float, tuple[Blocker, ...]]:
    """When ``gpu_id`` has room for ``request`` if only leases give way, and the leases that
    must (soonest first until the room is made); never if all of them would not do."""
    ids = ledger.lease_ids(gpu_id)
    if not ids or ledger.free_after(gpu_id, set(ids)) < request.vram_mb:
        return _NEVER
    if len(ids) == 1:  # the common case: one lease in the way, and it is enough
        blocker = _blocker(leases[ids[0]], request, policy)
        return _until(blocker), (blocker,)
    named = sorted(
        (_blocker(leases[lid], request, policy) for lid in ids),
        key=lambda b: (_until(b), _never(b), b.id),
    )
    gone: set[str] = set()
    for count, blocker in enumerate(named, start=1):
        gone.add(blocker.id)
        if ledger.free_after(gpu_id, gone) >= request.vram_mb:
            return _until(blocker), tuple(named[:count])
    return _NEVER


def _blocker(lease: Lease, request: Request, policy: Policy) -> Blocker:
    if lease.state is LeaseState.REVOKING:
        until = moment(lease.expires_at)  # capped at revoked_at + grace + TTL; None: no TTL
        rule = "revoking"
        since = lease.granted_at if lease.revoked_at is None else lease.revoked_at
    else:
        at, rule = giving_way(lease, request, policy)
        # at once: since it went idle or since the request came, whichever is later
        at_once = at == -math.inf
        until = max(lease.last_used_at, request.submitted_at) if at_once else moment(at)
        since = lease.last_used_at if lease.idle else lease.granted_at
    return Blocker(
        "lease",
        lease.id,
        lease.request.holder or None,
        lease.gpus,
        since=since,
        until=until,
        expires_at=moment(lease.expires_at),
        state=_state(lease),
        priority=lease.base_priority,
        rule=rule,
    )


def _state(lease: Lease) -> str:
    if lease.state is LeaseState.REVOKING:
        return "revoking"
    if lease.loading:
        return "loading"
    return "idle" if lease.idle else "busy"


_WHY_NEVER = {
    "not_preemptible": "not preemptible by {prio} (I5)",
    "never_preempt": "never preempted for this request (constraints.never_preempt)",
}


def lease_sentence(blocker: Blocker, request_priority: int, now: float) -> str:
    """'idle lease L (holder 'chat', interactive) on w1:0: reclaimable by batch in 55s
    (idle_reclaim_s)'; 'busy lease B (...): not preemptible by batch (I5)'; 'revoking
    lease V (...): memory back when its holder stops, at the latest in 40s (grace + TTL)'."""
    prio = priority_name(request_priority)
    holder = f"holder {blocker.holder!r}, " if blocker.holder else ""
    own = "" if blocker.priority is None else priority_name(blocker.priority)
    who = f"{blocker.state} lease {blocker.id} ({holder}{own}) on {_gpus(blocker)}"
    rule = blocker.rule or ""
    if blocker.until is None and rule == "revoking":
        return f"{who}: memory back when its holder stops (it has no TTL to bound that)"
    if blocker.until is None:
        return f"{who}: " + _WHY_NEVER.get(rule, "not preemptible by {prio}").format(prio=prio)
    left = "now" if blocker.until <= now else f"in {format_s(blocker.until - now)}"
    if rule == "revoking":
        return f"{who}: memory back when its holder stops, at the latest {left} (grace + TTL)"
    if rule == "at_once":
        return f"{who}: reclaimable by {prio} now (equal or higher priority)"
    verb = "reclaimable" if blocker.state == "idle" else "preemptible"
    return f"{who}: {verb} by {prio} {left} ({rule})"


def waiting_sentence(blockers: tuple[Blocker, ...], request_priority: int, now: float) -> str:
    """'waiting for <the lease it waits for last>; and <each other>'."""
    parts = [lease_sentence(b, request_priority, now) for b in blockers]
    return "waiting for " + "; and ".join(parts)
