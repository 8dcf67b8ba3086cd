"""``Controller``: the decision core driven for a whole cluster, with durable state.

It is the service's one authority: every change — a request, a release, a
heartbeat, a drain, a timer — runs in one *change*::

    now = clock()
    apply the event to the core          (Scheduler: submit, release, drain ...)
    core.decide(now)                     (grants, revocations, expiries, drains)
    one store transaction                (leases + worker statuses + events + counters)
    wake long-polls and event streams

and the caller is answered only after the transaction committed. Changes run
one at a time on the event loop (they never await), so no reader ever sees a
lease table and a worker status that disagree. The only timer is one
``call_at`` for the earliest of the core's next deadline and the next
heartbeat deadline: nothing polls.

One request's path, ``POST /v1/leases``, route to store and back, each step once::

    server/schemas.py    the body: strict JSON, then LeaseCreate (types, bounds)
    server/routes.py     create_lease: may this token ask? LeaseCreate.to_request: the
                         core's Request, built once (core/model.py), handed over typed
    leases.py            Leases.submit: the gate; an idempotency key seen before; the
                         pending limits; in the change's body Scheduler.submit; after
                         it, the answer, made in the same pass (:class:`Submitted`):
                         the record, and for a pending one its position and reason (the
                         queue walked up to it once, Scheduler.explain)
    change.py            Changes.change: the body, then each hook for each participant
                         in the order facade.py declares them (leases, workers,
                         updates, events, timer, roles): sweep (Workers: offline,
                         Updates: late), Scheduler.decide, absorb (Leases), encode
                         (Leases, Workers, Updates, Events), Store.commit
                         (store/sqlite.py, store/codec.py), stored (Events), committed
                         (Timer); any failure: recover (Roles)
    server/schemas.py    lease_out (the API's own JSON); server/durable.py: it leaves
                         once stored

One rule for every failure: memory and store are never left apart. When a change
cannot be encoded or stored — any exception, not only a :class:`StoreError` — or
fails half-applied (a bug, an interruption), the controller drops what it held in
memory and *reloads* what the store holds, as ``start()`` does (without a new
term); the caller gets the error (503 ``unavailable`` for a store failure) and
nothing was acknowledged. The event sequence advances only with a stored commit,
so ``events.last_seq`` is never ahead of the events it can return. After a reload
the controller keeps serving; GPUs of agents are unknown again (no grants there)
until each agent's next heartbeat. If the store cannot be read either, the
controller refuses every change (503, and ``/readyz`` says why) and retries the
reload, backing off up to :data:`RELOAD_RETRY_MAX_S`, until it succeeds. A commit
refused because another controller leads (:class:`~.store.Fenced`) reloads too,
then refuses changes until this controller is demoted.

The package, one module per concern around the one change (each module's opening
comment says what it owns and what it may call; none reaches into another's state):

- :mod:`.change` — the change and its commit (build, encode, store, apply, wake) and
  the gate that says whether changes are accepted now;
- :mod:`.leases` — submit, the lease verbs, the queue views, the pending limits, and
  how a cycle's decisions are recorded;
- :mod:`.workers` — register, heartbeat, the offline sweep, drain, cancel-drain, remove;
- :mod:`.updates` — update operations, driving drains through the workers' own calls;
- :mod:`.names` — which token holds each gateway name; :mod:`.catalogue` — the
  cluster's catalogue, as numbered revisions;
- :mod:`.events` — the event history, the lease waiters and the stream fan-out;
- :mod:`.timer` — the one timer; :mod:`.roles` — leader, standby, mirror, and the
  reload after a failure;
- :mod:`.facade` — ``Controller``, which builds them, declares in one ordered tuple
  which take part in every change (``changes.participants``), and exposes each
  one as an attribute (``controller.leases``, ``.workers``, ``.updates``, ``.events``,
  ``.changes``, ``.gate``): the service calls the module that owns what it asks for,
  and the controller itself only what concerns the whole arbiter (start, mirror,
  demote, close, pause, resume, status); :mod:`.values` — errors, limits, views and
  histograms.

Roles, when several controllers share one store (PostgreSQL): see :mod:`.roles`. A
*standby* holds a read-only copy of what the leader committed (``mirror()``
reloads it): reads are answered from it, every change raises
:class:`NotLeader`, and no timer runs. ``start()`` makes a controller the
leader: it reloads the acknowledged state, so a new leader continues the fencing
tokens and leases of the old one exactly where its last commit left them.
"""

from .facade import Controller
from .values import (
    RELOAD_RETRY_MAX_S,
    UPDATE_TIMEOUT_S,
    DrainOutcome,
    GpuProbeReport,
    Histogram,
    Limits,
    NotLeader,
    PendingView,
    ServiceUnavailable,
    Submitted,
    TooManyRequests,
)

__all__ = [
    "RELOAD_RETRY_MAX_S",
    "UPDATE_TIMEOUT_S",
    "Controller",
    "DrainOutcome",
    "GpuProbeReport",
    "Histogram",
    "Limits",
    "NotLeader",
    "PendingView",
    "ServiceUnavailable",
    "Submitted",
    "TooManyRequests",
]
