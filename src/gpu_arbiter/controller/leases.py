"""Leases: requests and held leases, their verbs, the queue views, the limits on
pending requests, and how a cycle's decisions are recorded.

A live request or lease exists once, in the core (its queue, its leases): this module
keeps only who owns each (the token that asked), and a live lease's
:class:`~..store.LeaseRecord` is made from the core's object and its owner whenever it
is read or stored, so that there is no second copy to reconcile. An ended lease's record
is its last word (the core's last lease or request, its end state and reason), kept among
the recent ones until the store answers for it.

Owns the owners of live leases, the recently ended records, the idempotency keys of
both in memory (an ended lease's key stays until the lease leaves the recent ones, so
that a replay finds it even before its end is stored) and the pending counts by (token,
holder). Its part of every change (a :class:`~.change.Participant`): :meth:`Leases.absorb`
records what the core decided, :meth:`Leases.encode` writes the leases a change touched.
Its clients' presence (I8's dual, :mod:`~..core.presence`): a request is watched while
its submission's answer and each long-poll of it are open (:meth:`Leases.watching`), and
seen when one closes; a request unseen for its ``ttl_s`` ends, ``cancelled`` with the
reason ``abandoned``. A grant made while nobody waited for it is taken up by its
holder's read (:meth:`Leases.claim`) or any verb on it, else given back within its claim
bound, ``released`` with the reason ``unclaimed``. The open watches are kept here too, so
that a reload's new core is told them again; when an asker was last seen is not stored:
a restart gives every pending request a whole ``ttl_s`` from then, and every grant not
taken up its whole claim bound.

Other modules record a lease's end or revocation only through :meth:`Leases.end` and
:meth:`Leases.revoked`, a cycle's decisions through :meth:`Leases.absorb`, and read
leases through :meth:`Leases.get`.

Calls the core through ``changes.scheduler``, runs changes through
:meth:`~.change.Changes.change`, and reads ended leases from the store.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..core import (
    ArbiterError,
    Conflict,
    Decisions,
    Lease,
    LeaseState,
    NotFound,
    PendingReason,
    Request,
    Scheduler,
    Unschedulable,
    WorkerStatus,
    evolve,
    hand_over,
    parse_mb,
)
from ..store import Batch, LeaseRecord, Store
from .change import Change, Changes, Participant
from .values import (
    Limits,
    NotLeader,
    PendingView,
    ServiceUnavailable,
    Submitted,
    TooManyRequests,
)

__all__ = ["Leases"]

log = logging.getLogger("gpu_arbiter.controller")


class _PendingCounts(Counter[tuple[str, str]]):
    """Pending requests by (owner, holder), and their totals by owner, kept as they
    change: the per-token limit is one look-up."""

    def __init__(self) -> None:
        super().__init__()
        self.by_owner: Counter[str] = Counter()

    def __setitem__(self, key: tuple[str, str], value: int) -> None:
        self.by_owner[key[0]] += value - self[key]
        super().__setitem__(key, value)

    def clear(self) -> None:
        super().clear()
        self.by_owner.clear()


def _holder_key(owner: str | None, request: Request) -> tuple[str, str]:
    return (owner or "", request.holder)


class Leases(Participant):
    def __init__(self, changes: Changes, store: Store, limits: Limits) -> None:
        self._changes = changes
        self._store = store
        self._limits = limits
        self._owners: dict[str, str | None] = {}  # every live request and lease: its token
        self._recent: OrderedDict[str, LeaseRecord] = OrderedDict()
        self._keys: dict[tuple[str, str], str] = {}
        self._pending_by_holder = _PendingCounts()
        self._watches: Counter[str] = Counter()  # requests: answers open to their askers

    @property
    def _scheduler(self) -> Scheduler:
        return self._changes.scheduler

    # ------------------------------------------------------------------ requests

    @staticmethod
    def new_id() -> str:
        """A new lease's id (a request keeps it when it is granted)."""
        return f"lease-{secrets.token_hex(8)}"

    def submit(self, owner: str | None, request: Request) -> Submitted:
        """Queues ``request`` (the core's, built once by the caller with :meth:`new_id`:
        nothing here checks it again) and runs a cycle; the answer is made in the same
        pass (the record as the cycle left it and, while it waits, its position and
        reason), so that nobody walks the queue again for it. A replayed idempotency key
        answers with the earlier request as it is now. Raises :class:`Unschedulable` when
        no known GPU could ever satisfy it."""
        self._changes.gate.check_available()
        if request.idempotency_key is not None:
            earlier = self._by_key(owner, request.idempotency_key)
            if earlier is not None:
                earlier = self._replay(earlier, request)
                return Submitted(earlier, False, self.pending_view(earlier.id))
        self._check_limits(owner, request)
        with self.watching(request.id):  # a grant in this change is the answer it gets
            with self._changes.change() as change:
                queued = self._scheduler.submit(request, change.now)
                self._live(owner, queued)
                self._pending_by_holder[_holder_key(owner, queued)] += 1
                change.leases.add(queued.id)
                change.event(
                    "lease.requested",
                    queued.id,
                    vram_mb=request.vram_mb,
                    gpus=request.gpus,
                    priority=request.priority,
                    holder=request.holder,
                )
            record = self.get(request.id)
            pending = record.state is LeaseState.PENDING
            return Submitted(record, True, self._view(record.id, change.now) if pending else None)

    def _replay(self, earlier: LeaseRecord, request: Request) -> LeaseRecord:
        mine = (request.vram_mb, request.gpus, request.priority, request.constraints)
        theirs = (
            earlier.request.vram_mb,
            earlier.request.gpus,
            earlier.request.priority,
            earlier.request.constraints,
        )
        if mine != theirs or request.holder != earlier.request.holder:
            raise Conflict(
                f"idempotency_key {request.idempotency_key!r} was used for a different request",
                lease_id=earlier.id,
            )
        return earlier

    def _by_key(self, owner: str | None, key: str) -> LeaseRecord | None:
        lease_id = self._keys.get((owner or "", key))
        if lease_id is not None:
            return self.get(lease_id)
        return self._store.lease_by_key(owner, key)

    def _check_limits(self, owner: str | None, request: Request) -> None:
        """Refuses a request past the per-token, then the global, then the per-holder
        limit on pending requests. A token is the caller's authenticated identity (with
        auth off every caller is one: ``anonymous``), so no name the caller picks can
        take a share of another caller's limit."""
        holder = _holder_key(owner, request)
        counts = (
            ("max_pending_per_token", self._pending_by_holder.by_owner[holder[0]]),
            ("max_pending", len(self._scheduler.queue)),
            ("max_pending_per_holder", self._pending_by_holder[holder]),
        )
        for name, current in counts:
            value = getattr(self._limits, name)
            if current >= value:
                raise TooManyRequests(
                    f"{current} requests are already pending ({name} is {value}); retry later",
                    limit=name,
                    value=value,
                    current=current,
                )

    # ------------------------------------------------------------------ reading

    def get(self, lease_id: str) -> LeaseRecord:
        """The current record of a lease, live or ended. Raises NotFound."""
        if lease_id in self._owners:
            return self._record(lease_id)
        record = self._recent.get(lease_id) or self._store.lease(lease_id)
        if record is None:
            raise NotFound(f"no lease {lease_id!r}", lease_id=lease_id)
        return record

    def _record(self, lease_id: str) -> LeaseRecord:
        """A live lease's record, made from the core's lease or queued request."""
        owner = self._owners[lease_id]
        lease = self._scheduler.leases.get(lease_id)
        if lease is not None:
            return LeaseRecord(lease.request, lease.state, owner, lease)
        return LeaseRecord(self._scheduler.queue.get(lease_id), LeaseState.PENDING, owner)

    def all(
        self,
        *,
        state: LeaseState | None = None,
        worker: str | None = None,
        holder: str | None = None,
    ) -> list[LeaseRecord]:
        """Live leases, and recently ended ones, oldest first; those in ``state``, on
        ``worker``, of ``holder`` when given."""
        found = [self._record(lease_id) for lease_id in self._owners]
        found += list(self._recent.values())
        return sorted(
            (
                r
                for r in found
                if (state is None or r.state is state)
                and (worker is None or r.worker == worker)
                and (holder is None or r.request.holder == holder)
            ),
            key=lambda r: r.request.seq,
        )

    def pending_view(self, lease_id: str) -> PendingView | None:
        """A pending request's position, effective priority and reason now; None when it
        is not pending."""
        if lease_id not in self._scheduler.queue:
            return None
        return self._view(lease_id, self._changes.clock())

    def _view(self, lease_id: str, now: float) -> PendingView:
        """The pending view of a pending request at ``now``."""
        position, effective = self._scheduler.position(lease_id, now)
        return PendingView(position, effective, self._scheduler.explain(lease_id, now))

    def positions(self) -> dict[str, tuple[int, int]]:
        """Every pending request's (position, effective priority), in one pass."""
        now = self._changes.clock()
        return {r.id: (pos, eff) for pos, r, eff in self._scheduler.pending(now)}

    def queue(self, limit: int = 100) -> list[tuple[LeaseRecord, PendingView]]:
        """The first ``limit`` pending requests in order, each with its reason."""
        now = self._changes.clock()
        scheduler = self._scheduler
        return [
            (
                LeaseRecord(request, LeaseState.PENDING, self._owners[request.id]),
                PendingView(position, effective, scheduler.explain(request.id, now)),
            )
            for position, request, effective in itertools.islice(scheduler.pending(now), limit)
        ]

    # ------------------------------------------------------------------ presence

    @contextmanager
    def watching(self, lease_id: str) -> Iterator[None]:
        """An answer to ``lease_id``'s asker is open for the body (a long-poll): while it
        is pending, its asker is present; once the answer closes it was last seen then."""
        self._watches[lease_id] += 1
        self._scheduler.watch(lease_id)
        try:
            yield
        finally:
            left = self._watches[lease_id] - 1
            if left > 0:
                self._watches[lease_id] = left
            else:
                del self._watches[lease_id]
            self._scheduler.unwatch(lease_id, self._changes.clock())
            self._changes.deadline_moved()

    def claim(self, lease_id: str) -> None:
        """Its holder read a grant: taken up, it is no longer given back (stored). Does
        nothing for a lease that is not held or already taken up."""
        lease = self._scheduler.leases.get(lease_id)
        if lease is None or lease.claimed:
            return
        try:
            self._changes.gate.check_available()
        except (NotLeader, ServiceUnavailable):
            return  # a standby's read, or one while stopping: the leader's holder reads again
        with self._changes.change() as change:
            self._scheduler.claim(lease_id)
            change.leases.add(lease_id)

    # ------------------------------------------------------------------ verbs

    def _check_held(self, lease_id: str) -> None:
        """Refuses a verb on a lease that is not held (NotFound, or Conflict naming its
        state); a lease whose TTL lapsed just before its timer ran has it run first."""
        self._changes.gate.check_available()
        held = self._scheduler.leases.get(lease_id)
        if held is not None and held.expires_at <= self._changes.clock():
            with self._changes.change():  # its TTL lapsed just before its timer ran: run it first
                pass
        record = self.get(lease_id)
        if lease_id not in self._scheduler.leases:
            raise Conflict(
                f"lease {lease_id} is {record.state}, not held",
                lease_id=lease_id,
                state=str(record.state),
            )

    def renew(self, lease_id: str, ttl_s: float | None = None) -> LeaseRecord:
        """A held lease's TTL starts again from now (``ttl_s``: a new TTL from now on)."""
        self._check_held(lease_id)
        with self._changes.change() as change:
            self._scheduler.renew(lease_id, change.now, ttl_s)
            change.leases.add(lease_id)
        return self.get(lease_id)

    def ready(self, lease_id: str) -> LeaseRecord:
        """A held lease's load finished: the GPU may start the next load (I3)."""
        self._check_held(lease_id)
        with self._changes.change() as change:
            if self._scheduler.leases[lease_id].loading:
                change.event("lease.ready", lease_id)
            self._scheduler.ready(lease_id, change.now)
            change.leases.add(lease_id)
        return self.get(lease_id)

    def set_idle(self, lease_id: str, idle: bool) -> LeaseRecord:
        """A held lease is marked idle (keep-warm: a cache that may be reclaimed, I5) or
        busy again."""
        self._check_held(lease_id)
        with self._changes.change() as change:
            if self._scheduler.leases[lease_id].idle != idle:
                change.event("lease.idle" if idle else "lease.busy", lease_id)
            self._scheduler.set_idle(lease_id, idle, change.now)
            change.leases.add(lease_id)
        return self.get(lease_id)

    def shrink(self, lease_id: str, vram_mb: int | str) -> LeaseRecord:
        """A held lease gives memory back (a model server put to sleep keeps its process):
        it holds ``vram_mb`` per GPU from now on, stored before it is answered (I9). The
        core grants that memory again only once the probe shows it free; a lease never
        grows (:class:`Conflict`). Bad input changes nothing."""
        mb = parse_mb(vram_mb, "vram_mb")
        self._check_held(lease_id)
        with self._changes.change() as change:
            before = self._scheduler.leases[lease_id].vram_mb
            lease = self._scheduler.shrink(lease_id, mb, change.now)
            if lease.vram_mb != before:
                change.leases.add(lease_id)
                change.event(
                    "lease.shrunk",
                    lease_id,
                    lease.worker,
                    from_mb=before,
                    vram_mb=lease.vram_mb,
                    granted_mb=lease.granted_mb,
                )
        return self.get(lease_id)

    def release(self, lease_id: str) -> LeaseRecord:
        """Releases a held lease, cancels a pending one; an ended one is returned as is."""
        self._changes.gate.check_available()
        record = self.get(lease_id)
        if record.state.is_final:
            return record
        with self._changes.change() as change:
            if lease_id in self._scheduler.queue:
                self._scheduler.cancel(lease_id)
                self.end(change, record.request, LeaseState.CANCELLED, "cancelled")
            else:
                ended = self._scheduler.release(lease_id, change.now)
                self.end(change, ended, LeaseState.RELEASED, "released")
        return self.get(lease_id)

    def revoke(self, lease_id: str, reason: str = "revoked_by_admin") -> LeaseRecord:
        self._changes.gate.check_available()
        record = self.get(lease_id)
        if lease_id not in self._scheduler.leases:
            raise Conflict(f"lease {lease_id} is {record.state}, not held", state=str(record.state))
        with self._changes.change() as change:
            lease = self._scheduler.revoke(lease_id, reason, change.now)
            self.revoked(change, [lease])
        return self.get(lease_id)

    # ------------------------------------------------------------------ in a change

    def absorb(self, change: Change, decisions: Decisions) -> None:
        """Records what one cycle decided in ``change``, in the core's order (causes
        before their effects, :func:`~..core.driver.hand_over`)."""
        hand_over(decisions, _Recorded(self, change))

    def granted(self, change: Change, lease: Lease) -> None:
        """Records a grant of the cycle in ``change``: its event, the wait it ended."""
        change.leases.add(lease.id)
        self._pending_by_holder[_holder_key(self._owners[lease.id], lease.request)] -= 1
        change.grants += 1
        waited_s = max(0.0, lease.granted_at - lease.request.submitted_at)
        change.waited_s.append(waited_s)
        change.event(
            "lease.granted",
            lease.id,
            lease.worker,
            gpus=[str(g) for g in lease.gpus],
            token=lease.token,
            vram_mb=lease.vram_mb,
            waited_s=round(waited_s, 6),
        )

    def revoked(self, change: Change, leases: Sequence[Lease]) -> None:
        """Leases the core just revoked: stored, with an event each."""
        for lease in leases:
            change.leases.add(lease.id)
            change.event(
                "lease.revoked",
                lease.id,
                lease.worker,
                reason=lease.revoke_reason,
                for_request=lease.preempted_for,
            )

    def end(
        self,
        change: Change,
        last: Lease | Request,
        state: LeaseState,
        reason: str,
        *,
        message: str | None = None,
    ) -> None:
        """A live lease or request reaches a final state: it leaves the live set, its
        record kept as recent. ``last``: the core's last word on it (the lease it ended,
        or the request that never had one). ``message``: the reason in words, for the
        event."""
        lease = last if isinstance(last, Lease) else None
        request = last.request if isinstance(last, Lease) else last
        owner = self._owners.pop(request.id)
        if lease is None:  # never granted: it was pending
            self._pending_by_holder[_holder_key(owner, request)] -= 1
        ended = LeaseRecord(request, state, owner, lease, change.now, reason)
        self._recent[request.id] = ended
        while len(self._recent) > self._limits.recent_final_leases:
            _, old = self._recent.popitem(last=False)
            key = (old.owner or "", old.request.idempotency_key or "")
            if self._keys.get(key) == old.id:  # long stored: the store answers for it now
                del self._keys[key]
        change.ended[request.id] = ended
        worker = None if lease is None else lease.worker
        more = {} if message is None else {"message": message}
        change.event(f"lease.{state}", request.id, worker, reason=reason, **more)

    def encode(self, change: Change, batch: Batch) -> None:
        """The leases ``change`` touched, as they are now, and those it ended."""
        for lease_id in change.leases - change.ended.keys():
            if lease_id in self._owners:
                batch.leases[lease_id] = self._record(lease_id)
        batch.leases.update(change.ended)

    def _live(self, owner: str | None, request: Request) -> None:
        """``request`` (queued or granted in the core) is live from now on, ``owner``'s."""
        self._owners[request.id] = owner
        if request.idempotency_key is not None:
            self._keys[(owner or "", request.idempotency_key)] = request.id

    # ------------------------------------------------------------------ restore

    def clear(self) -> None:
        self._owners.clear()
        self._recent.clear()
        self._keys.clear()
        self._pending_by_holder.clear()

    def restore(self, records: Sequence[LeaseRecord], change: Change) -> None:
        """Gives the (new) core the stored leases, held ones by token, then the pending
        ones in order; one that no longer fits ends in ``change``.

        No holder could renew while no controller led (a restart, a failover): each
        restored lease gets at least its TTL from now, so that none lapses for the outage
        and frees memory its holder still uses (I4); a dead holder's lapses one TTL later.
        That expiry is the core's, not written: it is derived again at every start from
        the stored one (a second restart re-arms from its own time, exactly as the first),
        so that a restart costs no write per lease. The store keeps the expiry the holder
        last renewed to until its next renew or end writes the lease."""
        held = sorted((r.lease.token, r.lease, r) for r in records if r.lease is not None)
        for _, stored, record in held:
            self._live(record.owner, record.request)
            lease, ttl = stored, stored.request.ttl_s
            if ttl is not None and lease.expires_at < change.now + ttl:
                lease = evolve(lease, expires_at=change.now + ttl)  # a revoked one too
            try:
                self._scheduler.restore_lease(lease, change.now)
            except (ArbiterError, KeyError) as error:
                log.warning("lease %s cannot be restored (%s); ending it", record.id, error)
                self.end(change, stored, LeaseState.EXPIRED, "gpu_gone")
        pending = sorted((r for r in records if r.lease is None), key=lambda r: r.request.seq)
        for record in pending:
            self._live(record.owner, record.request)
            self._pending_by_holder[_holder_key(record.owner, record.request)] += 1
            try:  # its asker has its whole ttl_s from now to show up (I8)
                self._scheduler.submit(record.request, change.now)
            except Unschedulable as error:
                self.end(change, record.request, LeaseState.REJECTED, error.reason.code)
        for lease_id, count in self._watches.items():  # long-polls still open: still there
            for _ in range(count):
                self._scheduler.watch(lease_id)


class _Recorded:
    """The controller's :class:`~..core.driver.Outcomes`: each decision of a cycle recorded
    in the change being made (its records, its events), to be stored with it."""

    __slots__ = ("_change", "_leases")

    def __init__(self, leases: Leases, change: Change) -> None:
        self._leases = leases
        self._change = change

    def expired(self, lease: Lease) -> None:
        self._leases.end(self._change, lease, LeaseState.EXPIRED, "expired")

    def timed_out(self, request: Request) -> None:
        self._leases.end(self._change, request, LeaseState.TIMED_OUT, "max_wait")

    def abandoned(self, request: Request) -> None:
        message = f"nobody asked for it for {request.ttl_s:g} s (ttl_s): its asker is gone"
        self._leases.end(self._change, request, LeaseState.CANCELLED, "abandoned", message=message)

    def unclaimed(self, lease: Lease) -> None:
        message = "granted, but its holder never took it up (no read, renew or ready)"
        self._leases.end(self._change, lease, LeaseState.RELEASED, "unclaimed", message=message)

    def rejected(self, request: Request, reason: PendingReason) -> None:  # the cluster shrank
        self._leases.end(
            self._change, request, LeaseState.REJECTED, reason.code, message=reason.message
        )

    def loaded(self, lease: Lease) -> None:
        self._change.leases.add(lease.id)
        self._change.event("lease.loaded", lease.id, lease.worker, reason="load_timeout")

    def drained(self, worker: str, previous: WorkerStatus, status: WorkerStatus) -> None:
        self._change.workers.add(worker)
        self._change.event(
            "worker.drained", worker=worker, previous=str(previous), state=str(status)
        )

    def revoked(self, leases: Sequence[Lease]) -> None:
        self._leases.revoked(self._change, leases)

    def granted(self, lease: Lease) -> None:
        self._leases.granted(self._change, lease)
