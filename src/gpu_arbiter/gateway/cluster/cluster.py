"""The gateway as one of the cluster's front doors: the other gateways as the controller
shows them, the routing of a request among them, and the cluster's cold loads.

The view comes from ``GET /v1/gateways/{name}/cluster`` (``server/cluster.py``), a
long-poll answered when it changes (a gateway came, left or turned stale, a worker began
draining or went offline, a model's state moved): :meth:`Cluster.follow` keeps it, for
the gateway's life. Each request is then routed here without asking the controller
(``routing.py``: warm, then coming, then a load). The view also shows each gateway's
public key: this gateway authenticates every request it relays with the key it shares
with the peer it goes to (made from its own private key and the peer's public one:
:meth:`Cluster.sign`), and takes a relayed request as a peer's only when its MAC
verifies with the key it shares with the sender's key as this view shows it
(:meth:`Cluster.verify`, ``peer_identity.py``). A sender or key not in the view makes
this gateway ask for its view again at once (:meth:`Cluster.relearn`, at most once every
:data:`RELEARN_S`): a peer that just started, or reported a new key, is known then. A
key the view no longer shows is refused from that view on: replaced by another key (the
gateway restarted), at once; its gateway gone from the view (forgotten, or a new leader
it has not reported to yet), :data:`GONE_KEEP_S` after.

A cold load for the cluster (:meth:`Cluster.load`) is asked once per model by this
gateway however many requests wait for it (and once for the whole cluster: the
controller joins every front door that asks while one is pending or loading), and it is
the cluster's, not the caller's: a caller that hangs up leaves it to the others, and
when the last one here goes away before it served (:meth:`Cluster._withdraw`), this
gateway stops asking at once and withdraws (``DELETE /v1/gateways/{name}/loads``): the
controller ends it there and then (cancelled while pending, given back while it loads)
unless another front door asked for it too, which keeps it. While the controllers are
between leaders (none answers, or a new leader this gateway has not reported to yet),
the load is asked again, backing off, until its queue timeout: it is stored, so the new
leader has it and the ask joins it there (:meth:`Cluster._ask_again`). Once it is
granted, the gateway beside its worker adopts it (:meth:`ModelServer.adopt`): this one
when the lease is on its own worker, else the one the request is forwarded to, told by
``x-arbiter-lease``. While it is pending, its long-poll is answered as soon as its reason
moves: what its callers read (:meth:`Cluster.load_waiting`: the host nearest to taking
it, the lease in its way and when that gives way, ``queued.py``) follows it, and the
model is listed ``queued`` (:meth:`Cluster.queued`) here and, through the controller's
view (its ``loads``), at every other front door.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import ssl
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ...client import ApiError, ArbiterClient, ControllerUnreachable
from ...peer_identity import Identity, Keys, PublicKey, Refusal, Relayed, Verifier, decode_key
from ..base.clock import Clock
from ..base.race import sleep_or
from ..base.scopes import CancelScope
from ..base.upstream import Upstream
from ..profile import Affinity, Ask, Candidate, Memory, profiles
from ..servers.lease import Lease
from ..servers.model import ModelServer, Refused, tenths_up
from ..servers.replica import ReplicaState
from .liveness import Liveness, LivenessSettings
from .queued import queued_words
from .routing import Kind, Route, route

__all__ = ["UNRESPONSIVE", "Cluster", "Peer"]

log = logging.getLogger("gpu_arbiter.gateway")
T = TypeVar("T")
VIEW_WAIT_S = 20.0
LOAD_WAIT_S = 20.0
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 5.0
DOWN_S = 5.0
"""A peer that refused a connection is left out of routing this long (or until the
controller's view shows it again after a change)."""
DOWN_WHY = "refused a connection just now"
RELEARN_S = 1.0
"""A peer's sender or key not known here: the view is asked for again at most this often."""
RELEARN_WAIT_S = 3.0
UNRESPONSIVE = "the gateway does not answer its liveness check"
"""The reason a relay to a silent peer was cut (``liveness.py``)."""
RETIRING = ("draining", "drained")
"""This host's worker states in which its own copies take no new request and its
replicas end once idle (the drain completes)."""
OWN_OUT = ("draining", "drained", "offline")
"""This host's worker states in which its own copies are not routable."""
RETIRE_CHECK_S = 0.5
"""How often a retiring host looks again for replicas with nothing in flight."""
DEFAULT_QUEUE_TIMEOUT_S = 300.0
ROUTES_KEPT = 200
"""The routing decisions kept for ``GET /admin/routes`` (the newest; the report carries
the last :data:`ROUTES_REPORTED`)."""
ROUTES_REPORTED = 20
GONE_KEEP_S = 10.0
"""A peer's key is still taken this long after a view no longer shows its gateway at
all (a new leader it has not reported to yet: it reports within 5 s); a key replaced by
another in the view is refused at once."""
PEER_KEEP = 64
"""Idle connections kept to each peer gateway."""
_READY = ("warm", "busy")
_COMING = ("queued", "loading", "waking", "asleep")
_LOCAL_COMING = (
    ReplicaState.QUEUED,
    ReplicaState.LOADING,
    ReplicaState.WAKING,
    ReplicaState.ASLEEP,
)


@dataclass(slots=True)
class Peer:
    """Another gateway as the controller last showed it."""

    name: str
    url: str
    worker: str | None
    routable: bool
    why_not: str
    models: dict[str, Mapping[str, Any]]  # by id
    aliases: dict[str, str]  # a name or alias -> the model's id
    upstream: Upstream = field(repr=False)
    check: Upstream = field(repr=False)  # its liveness check's own connection
    figures: dict[str, Candidate] = field(default_factory=dict, repr=False)  # by id: routing's
    files: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # held, by name

    def model(self, name: str) -> Mapping[str, Any] | None:
        found = self.aliases.get(name)
        return None if found is None else self.models[found]


@dataclass(slots=True)
class _Load:
    """A load this gateway asked the cluster for: the task asking, and how many of its
    requests wait for it (``waiters``, and those ``also`` counts: a busy model's queue)."""

    task: asyncio.Future[Lease]
    waiters: int = 0
    waiting: str = "asking the arbiter where to load it"
    also: Callable[[], int] = lambda: 0
    taken: bool = False  # a waiter went on with its grant
    lease: Lease | None = None  # the load as its last pending answer showed it
    withdrawn: bool = False  # its last waiter went away first: the controller was told

    def wanted(self) -> bool:
        return self.waiters + self.also() > 0

    def forsaken(self) -> bool:
        """Nobody waits for it any more and no waiter took its grant, while it is still
        asked for or was granted (one refused or cancelled ended as it is)."""
        if self.wanted() or self.taken or self.withdrawn or self.task.cancelled():
            return False
        return not self.task.done() or self.task.exception() is None


@dataclass(frozen=True, slots=True)
class _Recorded:
    """A routing decision as made (:meth:`Cluster.record`): its JSON, the diagnosis
    with it, is built only when read."""

    at: float
    model: str
    route: Route

    def as_json(self) -> dict[str, Any]:
        done = self.route
        return {"at": round(self.at, 3), "model": self.model, "outcome": str(done.kind),
                "to": done.gateway, "why": done.why, "diagnosis": done.diagnosis()}  # fmt: skip


class Cluster:
    def __init__(
        self,
        client: ArbiterClient,
        *,
        name: str,
        worker: str | None,
        models: Mapping[str, ModelServer],
        routes: Mapping[str, str],
        clock: Clock,
        affinity: Affinity | None = None,
        liveness: LivenessSettings | None = None,
        peer_tls: ssl.SSLContext | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """``wall``: the wall clock (the time a relay is signed at and checked against;
        a fake one in tests)."""
        self.client = client
        self.name = name
        self.worker = worker
        self.models = models
        self.routes = routes
        self.clock = clock
        self.peers: dict[str, Peer] = {}
        self.loads: dict[str, Mapping[str, Any]] = {}  # model -> its load queued, as the view shows
        self.identity = Identity(name, wall=wall)  # this gateway's key pair, in memory only
        self.verifier = Verifier(self.identity)
        self.keys: dict[str, PublicKey | None] = {}  # each peer's, as the view shows
        self._gone_keys: dict[str, tuple[PublicKey, float]] = {}  # left it: until
        self._relearning: asyncio.Future[None] | None = None  # the view asked again now
        self._relearned_at = 0.0
        self.signature = ""
        self.seen = asyncio.Event()  # a view came once
        self.forwarding: Counter[tuple[str, str]] = Counter()  # (gateway, model) in flight
        self._down: dict[str, float] = {}  # peer -> left out of routing until
        self._down_why: dict[str, str] = {}  # peer -> why, in words
        self._loads: dict[str, _Load] = {}
        self._adopting: dict[str, asyncio.Future[None]] = {}
        self._withdrawing: dict[str, asyncio.Future[None]] = {}  # model -> telling it
        self._group: asyncio.TaskGroup | None = None  # owns the loads and adoptions
        self._changed = asyncio.Event()
        self._routed: deque[dict[str, Any] | _Recorded] = deque(maxlen=ROUTES_KEPT)
        self.own_state: str | None = None  # this host's worker, as the view shows it
        self._retiring: asyncio.Future[None] | None = None
        self.affinity = affinity  # prefix affinity (None: off)
        self._warm = profiles(affinity is not None)[0]
        self._went = Memory()  # a prefix -> the gateway it went to last
        self.relays: dict[str, set[CancelScope]] = {}  # peer -> the requests relayed there
        self.peer_tls = peer_tls  # how an https peer is reached (its own certificate shown)
        self.liveness = Liveness(
            liveness or LivenessSettings(), clock, self._ping,
            refused=self.peer_down, silent=self._wake, cut=self.cut, answers=self._wake,
        )  # fmt: skip

    def record(self, model: str, decided: Route) -> None:
        """A routing decision, as the operator reads it (``GET /admin/routes``, the
        gateway's report, the dashboard: :attr:`routed`). Kept as it is; its JSON is
        built only when read."""
        self._routed.append(_Recorded(time.time(), model, decided))

    @property
    def routed(self) -> list[dict[str, Any]]:
        """The routing decisions kept (the last :data:`ROUTES_KEPT`), oldest first, as
        JSON."""
        return self.last_routed(ROUTES_KEPT)

    def last_routed(self, count: int) -> list[dict[str, Any]]:
        """The last ``count`` routing decisions kept, oldest first, as JSON."""
        kept = self._routed
        last = itertools.islice(kept, max(0, len(kept) - count), None)
        return [r.as_json() if isinstance(r, _Recorded) else r for r in last]

    # ------------------------------------------------------------------ the view

    async def run(self) -> None:
        """The cluster's side of the gateway, for its life (cancelled at its stop): keeps
        the view (:meth:`follow`), and owns the tasks of the loads it asked for and of the
        leases it adopts, which end with it."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            group.create_task(self.liveness.watch(lambda: self.peers.keys(), self._task))
            try:
                await self.follow()
            finally:
                self._group = None

    def _task(self, work: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """``work`` run by :meth:`run`'s group; its outcome (a refusal too: no failure of
        the group) in the future returned, cancelled with the group, and cancelling it
        cancels the work. A bare task only while the group does not run (before it
        starts)."""
        if self._group is None:
            return asyncio.ensure_future(work)
        outcome: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        task = self._group.create_task(_into(work, outcome))
        outcome.add_done_callback(lambda done: task.cancel() if done.cancelled() else None)
        return outcome

    async def follow(self) -> None:
        """Keeps the cluster's view, for the gateway's life (cancelled at its stop)."""
        backoff = BACKOFF_FIRST_S
        path = f"/v1/gateways/{self.name}/cluster"
        try:
            while True:
                try:
                    view = await self.client.request(
                        "GET", path, params={"after": self.signature, "wait": VIEW_WAIT_S},
                        timeout_s=VIEW_WAIT_S + 10.0,
                    )  # fmt: skip
                except (ApiError, ControllerUnreachable) as error:
                    if isinstance(error, ApiError) and error.status not in (404, 409):
                        log.warning("gateway %s: no cluster view (%s)", self.name, error)
                    await asyncio.sleep(backoff)
                    backoff = min(BACKOFF_MAX_S, 2 * backoff)
                    continue
                backoff = BACKOFF_FIRST_S
                self.apply(view)
        finally:
            for peer in self.peers.values():
                peer.upstream.close()
                peer.check.close()
            for load in self._loads.values():
                load.task.cancel()

    def apply(self, view: Mapping[str, Any]) -> None:
        """Takes a view of the cluster (``GET /v1/gateways/{name}/cluster``)."""
        self.signature = str(view.get("signature") or "")
        self._keys(view.get("gateways") or ())
        found: dict[str, Peer] = {}
        for gateway in view.get("gateways") or ():
            name = str(gateway.get("name"))
            if name == self.name:
                self._own(gateway.get("worker_state"))
                continue
            old = self.peers.pop(name, None)
            found[name] = _peer(gateway, old, self.peer_tls)
        for gone in self.peers.values():
            gone.upstream.close()
            gone.check.close()
        self.peers = found
        self.loads = {
            str(q.get("model")): q for q in view.get("loads") or () if isinstance(q, Mapping)
        }
        self._down.clear()  # a fresh view: every peer it shows is tried again
        self.seen.set()
        self._changed.set()
        self._changed = asyncio.Event()

    def _own(self, state: object) -> None:
        """This host's worker as the view shows it: while it is draining or drained, its
        own copies take no new request (they go to the other hosts, or to a load the
        arbiter places among them) and its replicas end once nothing is in flight on them
        (:meth:`_retire`), so that the drain completes."""
        self.own_state = None if state is None else str(state)
        retiring = self.own_state in RETIRING
        if retiring and (self._retiring is None or self._retiring.done()):
            log.info("gateway %s: worker %s is %s: its replicas end once idle",
                     self.name, self.worker, self.own_state)  # fmt: skip
            self._retiring = self._task(self._retire())

    async def _retire(self) -> None:
        """Ends this host's replicas as each model has nothing in flight, while its worker
        stays draining or drained."""
        while self.own_state in RETIRING:
            for model in self.models.values():
                live = [r for r in model.replicas if r.live and r.ending is None]
                if live and not any(r.in_flight for r in live):
                    log.info("gateway %s: %s: nothing in flight, ended for the drain",
                             self.name, model.name)  # fmt: skip
                    await model.unload(f"for the drain: gateway {self.name}'s {self.own_why}")
            await sleep_or(self.clock.sleep(RETIRE_CHECK_S), self._changed)

    @property
    def own_why(self) -> str:
        """Why this host's own copies are not routable now ('' when they are): its worker
        draining, drained or offline. A worker the controller does not know (no agent
        registered it, or under another name) leaves them routable: its leases say the
        rest."""
        if self.own_state not in OWN_OUT:
            return ""
        return f"worker {self.worker} is {self.own_state}"

    # ------------------------------------------------------------------ the peers' keys

    def _keys(self, gateways: Any) -> None:
        """Each peer's public key as a new view shows it. A key the view no longer shows
        because its gateway left the view is kept :data:`GONE_KEEP_S` more; one replaced
        by another key, or by none, is dropped now."""
        now = self.clock.now()
        keys: dict[str, PublicKey | None] = {}
        for gateway in gateways:
            name = str(gateway.get("name"))
            if name != self.name:
                keys[name] = _public_key(name, gateway.get("public_key"))
        for name, key in self.keys.items():
            if name not in keys and key is not None:
                self._gone_keys[name] = (key, now + GONE_KEEP_S)
        self._gone_keys = {
            n: (k, until) for n, (k, until) in self._gone_keys.items()
            if n not in keys and until > now
        }  # fmt: skip
        self.keys = keys

    def _known_keys(self) -> Keys:
        now = self.clock.now()
        gone = {n: k for n, (k, until) in self._gone_keys.items() if until > now}
        return {**gone, **self.keys}

    def sign(self, to: str, relayed: Relayed) -> str | None:
        """The ``x-arbiter-peer`` header of a request this gateway relays to peer ``to``;
        None when the view shows no key of ``to`` (a header needs the key the two share)."""
        key = self.keys.get(to)
        return None if key is None else self.identity.sign(to, key, relayed)

    def holders(self, name: str, size: int, sha256: str) -> list[Peer]:
        """The peers whose last report says they hold this model file (routable ones
        first, then by name): where a copy of it is asked for first."""
        found = [
            p for p in self.peers.values()
            if (f := p.files.get(name)) is not None
            and (f.get("size"), f.get("sha256")) == (size, sha256)
        ]  # fmt: skip
        return sorted(found, key=lambda p: (not p.routable, p.name))

    def sign_request(self, to: str, method: str, target: str) -> str | None:
        """The ``x-arbiter-peer`` header of a request of this gateway's own to peer
        ``to`` (a model file's copy: ``files/fetch.py``); None: no key of it known."""
        return self.sign(to, Relayed(method, target.encode()))

    def verify(self, header: str, relayed: Relayed) -> str | Refusal:
        """The peer that sent ``relayed`` with ``header`` (its MAC verified with its
        key as the view shows it), or why it is not taken (``peer_identity.py``)."""
        return self.verifier.verify(header, relayed, self._known_keys())

    async def relearn(self) -> None:
        """Asks for the view again at once (a peer's sender or key is not known here: a
        gateway that just started, or restarted with a new key, relays before this
        gateway's long-poll brings it). At most once every :data:`RELEARN_S` however
        many such requests come, each waiting at most :data:`RELEARN_WAIT_S` for it."""
        now = self.clock.now()
        if self._relearning is None or (
            self._relearning.done() and now - self._relearned_at >= RELEARN_S
        ):
            self._relearned_at = now
            self._relearning = self._task(self._relearn())
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._relearning), RELEARN_WAIT_S)

    def relayed_in(self, model: str, sender: str) -> None:
        """A request a peer relayed here, its sender proven by its MAC: recorded
        beside this front door's own decisions (``GET /admin/routes``), for the audit."""
        why = f"{model}: relayed by {sender} (its MAC verified)"
        log.debug("route: %s", why)
        self._routed.append(
            {"at": round(time.time(), 3), "model": model, "outcome": "relayed", "from": sender,
             "verified": True, "to": self.name, "why": why}
        )  # fmt: skip

    async def _relearn(self) -> None:
        path = f"/v1/gateways/{self.name}/cluster"
        view = await self.client.request(
            "GET", path, params={"after": "", "wait": 0}, timeout_s=RELEARN_WAIT_S
        )
        self.apply(view)

    # ------------------------------------------------------------------ routing

    def knows(self, name: str) -> bool:
        return name in self.routes or any(p.model(name) is not None for p in self.peers.values())

    def model_id(self, name: str) -> str:
        """The model's name for a name or alias, here or at a peer."""
        if name in self.routes:
            return self.routes[name]
        for peer in self.peers.values():
            found = peer.model(name)
            if found is not None:
                return str(found.get("id"))
        return name

    def decide(self, name: str, body: bytes | bytearray | None = None) -> Route:
        """Where a request for ``name`` (a model's name or alias) goes now; ``body``: its
        JSON body, when held (its prefix, with prefix affinity on)."""
        if self.affinity is None or body is None:
            return route(name, self.hosts(name))
        prefix = self.affinity.prefix(self.model_id(name), body)
        decided = route(
            name, self.hosts(name), Ask(name, prefix, self._went.get(prefix)), self._warm
        )
        if decided.kind in (Kind.LOCAL, Kind.PEER) and decided.gateway is not None:
            self._went.put(prefix, decided.gateway)
        return decided

    def hosts(self, name: str) -> list[Candidate]:
        """The candidates for a request for ``name``: this host's copy as it is now, and
        each peer's as its report showed it (parsed once, when the view came), counting
        the requests this gateway forwards there since, and left out of routing while it
        refused a connection just now."""
        found: list[Candidate] = []
        local = self.routes.get(name)
        if local is not None:
            found.append(_local_host(self.name, self.models[local], self.own_why))
        now = self.clock.now()
        for peer in self.peers.values():
            model_id = peer.aliases.get(name)
            if model_id is None:
                continue
            figures = peer.figures[model_id]
            ours = self.forwarding.get((peer.name, model_id), 0)
            if ours > figures.in_flight:
                figures = replace(figures, in_flight=ours)
            out = self._out(peer.name, now)
            if out:
                why = f"on {peer.worker}, {out}" if peer.worker else out
                figures = replace(figures, routable=False, why_not=why)
            found.append(figures)
        return found

    def copies(self, model_id: str) -> list[dict[str, Any]]:
        """Each host's copy of model ``model_id`` as this front door routes among them
        (:meth:`hosts`): this host's first, then the peers' by name; a failed copy with
        its failure and when it may start again."""
        found = []
        for host in sorted(self.hosts(model_id), key=lambda h: (not h.local, h.gateway)):
            copy: dict[str, Any] = {
                "gateway": host.gateway, "state": host.state, "ready": host.ready,
                "in_flight": host.in_flight, "routable": host.routable,
            }  # fmt: skip
            if host.local:
                copy["worker"] = self.worker
                described = self.models[self.routes[model_id]].describe()
            else:
                peer = self.peers[host.gateway]
                copy["worker"] = peer.worker
                described = dict(peer.model(model_id) or {})
                if isinstance(described.get("retry_at"), int | float):  # counted from now
                    described["retry_in_s"] = tenths_up(described["retry_at"] - time.time())
            if not host.routable:
                copy["why_not"] = host.why_not
            if host.state == "failed":
                copy.update({k: described.get(k) for k in ("failure", "retry_at", "retry_in_s")})
            found.append(copy)
        return found

    def why_not(self, name: str) -> str:
        """Why peer ``name`` takes no request now ('' when it does, or is not known)."""
        peer = self.peers.get(name)
        if peer is None:
            return ""
        return self._out(name, self.clock.now()) or ("" if peer.routable else peer.why_not)

    def _out(self, name: str, now: float) -> str:
        """Why this front door itself leaves peer ``name`` out of routing now ('' when
        it does not): it refused a connection just now, or it is silent."""
        if self._down and self._down.get(name, 0.0) > now:
            return self._down_why.get(name, DOWN_WHY)
        return self.liveness.why(name)

    def peer_down(self, name: str, cause: str = "", *, said: bool = False) -> None:
        """A peer could not be connected to (``cause``: what the connection said; a
        refused TLS certificate is said so), or no request can be made for it (``said``:
        ``cause`` says why in words): left out of routing for :data:`DOWN_S`."""
        self._down[name] = self.clock.now() + DOWN_S
        own_words = said or "TLS" in cause
        self._down_why[name] = f"{cause} just now" if own_words else DOWN_WHY
        log.warning(
            "gateway %s: peer %s %s; routing around it",
            self.name, self.host_name(name), cause if own_words else "refused a connection",
        )  # fmt: skip

    async def _ping(self, name: str) -> None:
        """Asks peer ``name``'s ``/healthz`` once (``liveness.py``), on its own connection."""
        peer = self.peers.get(name)
        if peer is None:
            return
        answer = await peer.check.request("GET", b"/healthz", [], b"")
        try:
            while not answer.ended:
                if not await answer.read() and not answer.ended:
                    raise OSError("the answer ended short")
        finally:
            answer.close()

    def cut(self, name: str) -> None:
        """Cuts the requests relayed to peer ``name`` (silent: ``liveness.py``); each ends
        with a 504 naming it (``relay.py``)."""
        relays = self.relays.get(name)
        if relays:
            log.warning(
                "gateway %s: %d request(s) relayed to %s cut: %s",
                self.name, len(relays), self.host_name(name), self.liveness.why(name),
            )  # fmt: skip
            for scope in list(relays):
                scope.cancel(UNRESPONSIVE)

    @contextlib.contextmanager
    def relaying(self, name: str, scope: CancelScope) -> Iterator[None]:
        """A request relayed to peer ``name`` for the length of the block, cut in
        ``scope`` should that peer fall silent."""
        relays = self.relays.setdefault(name, set())
        relays.add(scope)
        try:
            yield
        finally:
            relays.discard(scope)
            if not relays and self.relays.get(name) is relays:
                del self.relays[name]

    def _wake(self, _name: str) -> None:
        """A peer fell silent or answers again: requests waiting re-route."""
        self._changed.set()
        self._changed = asyncio.Event()

    def host_name(self, gateway: str) -> str:
        """A peer as a caller reads it in an error: its gateway and its worker
        (``gw-3 (box-3)``), or its gateway alone when its worker is not known here."""
        peer = self.peers.get(gateway)
        return f"{gateway} ({peer.worker})" if peer is not None and peer.worker else gateway

    def peer_on(self, worker: str) -> Peer | None:
        return next((p for p in self.peers.values() if p.worker == worker), None)

    async def changed(self) -> None:
        await self._changed.wait()

    async def peer_on_within(self, worker: str, wait_s: float) -> Peer | None:
        """The peer beside ``worker``, waiting up to ``wait_s`` for a view that shows it:
        a new leader knows the gateways only from their next reports (within
        ``report_s``, 5 s), so a load it granted may name a host whose gateway has not
        reported to it yet."""
        deadline = self.clock.now() + wait_s
        while (peer := self.peer_on(worker)) is None:
            left = deadline - self.clock.now()
            if left <= 0:
                return None
            await sleep_or(self.clock.sleep(left), self._changed)
        return peer

    # ------------------------------------------------------------------ loads

    async def load(self, model: str, priority: int) -> Lease:
        """The cluster's lease for a cold load of ``model``, once granted (its ``worker``
        says where). Raises :class:`Refused` when it ends without a grant."""
        found = self._loads.get(model)
        if found is None or found.task.done():
            found = _Load(self._task(self._ask(model, priority)))
            self._loads[model] = found
        found.waiters += 1
        try:
            lease = await asyncio.shield(found.task)
            found.taken = True
            return lease
        finally:
            found.waiters -= 1
            if found.forsaken():
                self._withdraw(model, found)

    def _withdraw(self, model: str, found: _Load) -> None:
        """The last waiter of a load went away before it served: this gateway stops
        asking at once and tells the controller, which ends the load if no other front
        door asked for it (cancelled while pending, given back while it loads)."""
        found.withdrawn = True
        found.task.cancel()
        if self._loads.get(model) is found:
            del self._loads[model]
        log.info("route: %s: nobody waits for its load here any more: withdrawn", model)
        self._tell(model, found.task)

    def _tell(self, model: str, asking: asyncio.Future[Lease]) -> None:
        """Tells the controller, once ``asking`` ended; a new load of ``model`` asked
        meanwhile is asked only after (never joined to the load being withdrawn)."""
        telling = self._task(self._tell_withdrawn(model, asking))
        self._withdrawing[model] = telling
        telling.add_done_callback(
            lambda _: (
                self._withdrawing.pop(model) if self._withdrawing.get(model) is telling else None
            )
        )

    async def _tell_withdrawn(self, model: str, asking: asyncio.Future[Lease]) -> None:
        await asyncio.wait([asking])  # its long-poll closed first
        path = f"/v1/gateways/{self.name}/loads"
        try:
            answer = await self.client.request("DELETE", path, params={"model": model})
        except (ApiError, ControllerUnreachable) as error:
            log.warning("route: %s: its load not withdrawn (%s)", model, error)
            return
        ended, kept = answer.get("ended") or [], answer.get("kept") or []
        log.info("route: %s: load withdrawn: ended %s, kept %s", model, ended, kept)

    def load_waiting(self, model: str) -> str:
        found = self._loads.get(model)
        return found.waiting if found is not None else "asking the arbiter where to load it"

    def queued(self, model: str) -> dict[str, Any] | None:
        """The cluster's load of ``model`` while it is queued, as ``GET /v1/models`` lists
        it: its ``lease``, the front doors that asked (``asked_by``), its ``position`` and
        why it waits (``waiting``, :func:`.queued.queued_words`); this front door's own
        (with its ``waiters`` here, its reason as its long-poll last said it), else one
        another front door asked for, as the controller's view shows it; None when none
        is."""
        seen = self.loads.get(model)
        found = self._loads.get(model)
        if found is not None and not found.task.done() and found.lease is not None:
            lease = found.lease
            also = seen.get("asked_by") or () if seen and seen.get("lease") == lease.id else ()
            return {"lease": lease.id, "asked_by": sorted({self.name, *map(str, also)}),
                    "position": lease.position, "waiting": found.waiting,
                    "waiters": found.waiters + found.also()}  # fmt: skip
        if seen is None:
            return None
        lease = Lease.of({**seen, "id": seen.get("lease"), "state": "pending"})
        return {"lease": lease.id, "asked_by": [str(g) for g in seen.get("asked_by") or ()],
                "position": lease.position, "waiting": queued_words(lease, self.gateway_on),
                "waiters": 0}  # fmt: skip

    def gateway_on(self, worker: str) -> str | None:
        """The gateway beside ``worker``: this one, or a peer, if known here."""
        if worker == self.worker:
            return self.name
        peer = self.peer_on(worker)
        return None if peer is None else peer.name

    def grow(self, model: ModelServer) -> bool:
        """Requests queue here for a busy model: one more replica for the cluster, placed
        by the arbiter like any load, while the cluster holds fewer than its ``replicas``
        (max). False when no other gateway declares the model (this one grows alone)."""
        name = model.name
        if not any(p.model(name) is not None for p in self.peers.values()):
            return False
        found = self._loads.get(name)
        if found is not None and not found.task.done():
            return True
        total = self._replicas(name)
        if total >= model.config.replicas:
            return True
        task = self._task(self._ask(name, model.lease_priority(), total + 1))
        self._loads[name] = _Load(task, also=lambda: model.waiting)
        task.add_done_callback(lambda done: self._grown(model, done))
        log.info("route: %s: busy, %d replica(s): one more for the cluster", name, total)
        return True

    def _replicas(self, name: str) -> int:
        """The model's replicas in the cluster, ready or on their way."""
        here = self.models.get(self.routes.get(name, ""))
        count = 0 if here is None else sum(1 for r in here.replicas if r.live and r.ending is None)
        for peer in self.peers.values():
            model = peer.model(name) if peer.routable else None  # a lost host's: not here
            replicas = [] if model is None else model.get("replicas") or []
            count += sum(
                1 for r in replicas if isinstance(r, Mapping) and r.get("state") in _READY + _COMING
            )
        return count

    def _grown(self, model: ModelServer, done: asyncio.Future[Lease]) -> None:
        """The new replica's lease: this gateway serves under it when it is on its own
        worker (another's takes it up from the controller)."""
        if done.cancelled() or done.exception() is not None:
            return
        lease = done.result()
        if lease.worker == self.worker:
            model.adopt(lease)

    async def _ask(self, model: str, priority: int, replicas: int = 1) -> Lease:
        withdrawing = self._withdrawing.get(model)
        if withdrawing is not None:
            await asyncio.wait([withdrawing])
        local = self.routes.get(model)
        config = self.models[local].config if local is not None else None
        max_wait_s = config.queue_timeout_s if config else DEFAULT_QUEUE_TIMEOUT_S
        body = {
            "model": model,
            "priority": priority,
            "replicas": replicas,
            "ttl_s": config.ttl_s if config else 30.0,
            "max_wait_s": max_wait_s,
            "load_timeout_s": config.load_timeout_s if config else 300.0,
        }
        path = f"/v1/gateways/{self.name}/loads"
        give_up_at = self.clock.now() + max_wait_s
        backoff = BACKOFF_FIRST_S
        said = ""  # the signature of the pending reason read last: answered when it moves
        while True:
            now = self.clock.now()  # the peers out of reach as of each ask
            down = {n for n, until in self._down.items() if until > now}
            body["unreachable"] = sorted(down | set(self.liveness.silent()))
            try:
                answer: dict[str, Any] = await self.client.request(
                    "POST", path, json_body=body, params={"wait": LOAD_WAIT_S, "after": said},
                    timeout_s=LOAD_WAIT_S + 10.0,
                )  # fmt: skip
            except (ApiError, ControllerUnreachable) as error:
                await self._ask_again(model, error, give_up_at - self.clock.now(), backoff)
                backoff = min(BACKOFF_MAX_S, 2 * backoff)
                continue
            backoff = BACKOFF_FIRST_S
            lease = Lease.of(answer)
            if lease.held:
                self._say_placed(model, lease, answer)
                return lease
            if not lease.pending:
                why = lease.end_reason or lease.state
                raise Refused(503, f"model {model}: the cluster's load ended unplaced ({why})", 1.0)
            said = str(answer.get("signature") or "")
            found = self._loads.get(model)
            if found is not None:
                found.lease = lease
                found.waiting = queued_words(lease, self.gateway_on)
            self._changed.set()
            self._changed = asyncio.Event()
            if found is None or not found.wanted():
                if found is not None and not found.withdrawn:
                    found.withdrawn = True
                    self._tell(model, found.task)
                raise Refused(503, f"model {model}: nobody waits for its load any more", 1.0)

    async def _ask_again(
        self, model: str, error: ApiError | ControllerUnreachable, left_s: float, backoff: float
    ) -> None:
        """After a load's ask failed: waits ``backoff`` when the controller is only between
        leaders (none answers, or a new leader that this gateway has not reported to yet:
        404 or 409 naming it), the load is still wanted and its wait (``max_wait_s``) has
        ``left_s``; else raises :class:`Refused` with the cause. The load is stored, so a
        standby that takes over has it, and the ask joins it there."""
        if isinstance(error, ApiError) and not _unknown_here(error, self.name):
            said = str(error)
            said = said if said.startswith(f"{model}: ") else f"{model}: {said}"
            raise Refused(503 if error.status >= 500 else 404, said, 1.0) from None
        if isinstance(error, ApiError):
            why = f"the controller does not know this gateway yet ({error})"
        else:
            why = f"the controller is unreachable ({error})"
        found = self._loads.get(model)
        if found is None or not found.wanted() or left_s < backoff:
            raise Refused(503, f"{model}: {why}", 1.0) from None
        log.info("route: %s: %s; asking again in %.1fs", model, why, backoff)
        found.waiting = f"waiting for the controller: {why}"
        self._changed.set()
        self._changed = asyncio.Event()
        await self.clock.sleep(backoff)

    def _say_placed(self, model: str, lease: Lease, answer: Mapping[str, Any]) -> None:
        """The routing decision of a cold load, as the operator reads it (the load's
        ``answer`` says what every other host had free, and whether it joined a load)."""
        free: Mapping[str, int] = answer.get("free_mb") or {}
        others = "; ".join(
            f"{w} has {mb / 1024:.1f} GiB" for w, mb in sorted(free.items()) if w != lease.worker
        )
        gpus = ", ".join(lease.gpus)
        joined = " (joined)" if answer.get("joined") else ""
        here = free.get(lease.worker or "")
        room = f", {here / 1024:.1f} GiB left there" if here is not None else ""
        asked = f"{lease.vram_mb / 1024:.1f} GiB"
        why = f"{model}: cold load of {asked} on {gpus}{room}"
        why += f"; {others}{joined}" if others else joined
        log.info("route: %s", why)
        peer = self.peer_on(lease.worker or "")
        to = self.name if lease.worker == self.worker else (peer.name if peer else None)
        self._routed.append(
            {"at": round(time.time(), 3), "model": model, "outcome": "placed", "to": to,
             "why": why}
        )  # fmt: skip

    # ------------------------------------------------------------------ adoption

    async def adopt(self, model: ModelServer, lease_id: str) -> None:
        """Adopts the cluster's lease ``lease_id`` for ``model`` (a peer forwarded a
        request for it): once, however many requests name it."""
        if model.holds(lease_id):
            return
        task = self._adopting.get(lease_id)
        if task is None:
            task = self._task(self._adopt(model, lease_id))
            self._adopting[lease_id] = task
            task.add_done_callback(lambda _: self._adopting.pop(lease_id, None))
        await asyncio.shield(task)

    async def _adopt(self, model: ModelServer, lease_id: str) -> None:
        try:
            lease = Lease.of(await self.client.request("GET", f"/v1/leases/{lease_id}"))
        except (ApiError, ControllerUnreachable) as error:
            log.warning("gateway %s: lease %s not adopted (%s)", self.name, lease_id, error)
            return
        if lease.worker == self.worker and not model.holds(lease_id):
            model.adopt(lease)


async def _into(work: Coroutine[Any, Any, T], outcome: asyncio.Future[T]) -> None:
    """Runs ``work`` into ``outcome``: its result or exception; cancelled with it."""
    try:
        found = await work
    except asyncio.CancelledError:
        outcome.cancel()
        raise
    except Exception as error:  # the work's own outcome (a refusal): its awaiters' to see
        if not outcome.done():
            outcome.set_exception(error)
        return
    if not outcome.done():
        outcome.set_result(found)


def _unknown_here(error: ApiError, gateway: str) -> bool:
    """Whether the controller refused because ``gateway`` has not reported to it (yet):
    a new leader knows the gateways only from their next reports."""
    return error.status in (404, 409) and error.details.get("gateway") == gateway


def _public_key(name: str, text: object) -> PublicKey | None:
    """A peer's public key as the view shows it (the controller checked it); None when it
    shows none, or one that is not a key."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return _decoded(text)
    except ValueError:
        log.warning("gateway %s: its public key in the view is not one: its relays refused", name)
        return None


@functools.lru_cache(maxsize=256)
def _decoded(text: str) -> PublicKey:
    """:func:`decode_key`, once per key text: every view brings every peer's key again,
    and a decode tries an exchange with it (keys are immutable; a refusal is not kept)."""
    return decode_key(text)


def _peer(gateway: Mapping[str, Any], old: Peer | None, tls: ssl.SSLContext | None) -> Peer:
    """A peer from the view; an ``https`` one is reached over TLS with ``tls`` (the
    cluster's CA trusted, this gateway's own certificate shown: mutual TLS)."""
    url = str(gateway.get("url") or "")
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if old is not None and old.url == url:
        upstream, check = old.upstream, old.check
    else:
        if old is not None:
            old.upstream.close()
            old.check.close()
        secure = tls if parts.scheme == "https" else None
        if parts.scheme == "https" and secure is None:
            secure = ssl.create_default_context()  # the system's CAs
        upstream = Upstream(port, PEER_KEEP, host, secure)
        check = Upstream(port, 1, host, secure)
    models: dict[str, Mapping[str, Any]] = {}
    aliases: dict[str, str] = {}
    for model in gateway.get("models") or ():
        model_id = str(model.get("id"))
        models[model_id] = model
        aliases[model_id] = model_id
        for alias in model.get("aliases") or ():
            aliases.setdefault(str(alias), model_id)
    name, state = str(gateway.get("name")), gateway.get("worker_state")
    routable = bool(gateway.get("routable"))
    why = "" if routable else f"worker {gateway.get('worker')} is {state}"
    reported = gateway.get("reported_at")
    if gateway.get("stale") and isinstance(reported, int | float) and state in ("online", None):
        when = time.strftime("%H:%M:%S", time.localtime(reported))
        why = f"its gateway has not reported since {when}"
    worker_state = None if state is None else str(state)
    figures = {
        model_id: _peer_host(name, model, routable, why, worker_state)
        for model_id, model in models.items()
    }
    files = {str(f.get("name")): f for f in gateway.get("files") or () if isinstance(f, Mapping)}
    return Peer(
        name, url, gateway.get("worker"), routable, why, models, aliases, upstream, check,
        figures, files,
    )  # fmt: skip


def _local_host(name: str, model: ModelServer, why_not: str = "") -> Candidate:
    ready = [r for r in model.replicas if r.accepting]
    coming = any(r.state in _LOCAL_COMING and r.ending is None for r in model.replicas)
    return Candidate(
        name, local=True, routable=not why_not, why_not=why_not, state=model.state(),
        ready=len(ready),
        slots=len(ready) * model.config.max_parallel, in_flight=sum(r.in_flight for r in ready),
        coming=coming,
    )  # fmt: skip


def _peer_host(
    name: str, model: Mapping[str, Any], routable: bool, why: str, worker_state: str | None
) -> Candidate:
    """A peer's copy of a model, from its report as the controller's view carries it."""
    replicas = [r for r in model.get("replicas") or () if isinstance(r, Mapping)]
    ready = sum(1 for r in replicas if r.get("state") in _READY)
    coming = any(r.get("state") in _COMING for r in replicas)
    parallel = int(model.get("max_parallel") or 1)
    return Candidate(
        name, routable=routable, why_not=why, state=str(model.get("state") or ""), ready=ready,
        slots=ready * parallel, in_flight=int(model.get("in_flight") or 0), coming=coming,
        worker_state=worker_state,
    )  # fmt: skip
