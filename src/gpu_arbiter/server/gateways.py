"""The gateways the controller knows: what each last reported, and the commands queued
for it.

A gateway connects out to the controller, as an agent does (the controller never
connects to a URL a client gave it): it reports its models (``PUT
/v1/gateways/{name}``) every :data:`REPORT_S` seconds and soon after a change, and
long-polls the commands an admin queued for it (unload, pin, unpin a model). The
reports are held in memory only, like a worker's live probe figures: a restarted
controller learns its gateways again from their next reports, and a standby has none
(who holds each name is stored: see below).

A gateway's life here::

    (unknown) --report--> live --no report for ttl_s--> stale --forget_s more--> (forgotten)
                           ^  \\--goodbye (DELETE)--> (forgotten)    |
                           +-------------- report ------------------+

Who may be a gateway: a gateway token (``gpu-arbiter token create --role gateway
--worker W``), bound to its worker W: it reports gateways beside W only, and holds the
cluster's leases granted on W; or an admin token (tests, one host). A client or worker
token is refused (:func:`as_gateway`).

A name belongs to the token (its id) that first reported it, live or stale: another
token but an admin's is refused, so a gateway that stopped reporting keeps its name
until its own token reports again. So does the public key a gateway reports with its
name (``peer_identity.py``): only the name's token sets it, and the cluster view shows
it to the other gateways, which check the requests it relays with it (a new key, from a
restarted gateway, changes the view: every gateway's long-poll has it within a second).
The owner's goodbye (``DELETE``) forgets the report but keeps the name for it; an
admin's forgets both (``gpu-arbiter gateways forget``), so that a gateway given a new
token may take its name again. Unlike the reports, the names are stored (:class:`Names`,
the controller's ``controller.names``): a restarted controller, or a standby that takes
over, refuses a name to another token as the one before did. A name whose token was
revoked is free: the next token that reports it takes it (the revoked token can never
report again, and its id is never issued again, so keeping the name would only make the
operator forget it by hand). Commands are handed over once: in the answer to the next
report or to a long-poll, whichever comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..controller import TooManyRequests
from ..core import Conflict, NotFound
from ..store import GatewayNameRecord
from .auth import Forbidden, Principal, refuse

__all__ = [
    "CLUSTER_MODEL",
    "FORGET_S",
    "MAX_COMMANDS",
    "MAX_GATEWAYS",
    "REPORT_S",
    "TTL_S",
    "VERBS",
    "Command",
    "GatewayRegistry",
    "Names",
    "Report",
    "as_gateway",
]

REPORT_S = 5.0
"""How often a gateway reports (and soon after any change of its models)."""
TTL_S = 15.0
"""A gateway that has not reported for this long is stale: shown so, sent no command."""
FORGET_S = 600.0
"""A stale gateway is forgotten this long after it turned stale."""
MAX_GATEWAYS = 1000
MAX_COMMANDS = 32
"""Commands queued for one gateway and not handed over yet, at most."""
VERBS = ("unload", "pin", "unpin")
ADOPT_AGAIN_S = 3.0
"""A lease handed to a gateway to adopt and still not taken up is handed again after this."""
RECHECK_S = 1.0
"""How often a long-poll for commands looks for the cluster's leases to adopt."""
Adoptable = Callable[[str], list[tuple[str, str]]]
"""worker -> the cluster's leases granted there and not taken up: (model, lease id)."""
CLUSTER_MODEL = "cluster_model"
"""The metadata key of a lease asked for the cluster (``cluster.py``): its model."""


class Names(Protocol):
    """Which token holds each gateway name, kept where it outlives this process (the
    controller's :class:`~..controller.names.GatewayNames`). ``take`` and ``forget`` are
    stored before anyone is told; each raises when the controller cannot store it (and
    then holds what it held before)."""

    def get(self, name: str) -> GatewayNameRecord | None: ...

    def __len__(self) -> int: ...

    def take(self, name: str, owner: str, worker: str | None) -> GatewayNameRecord: ...

    def forget(self, name: str) -> GatewayNameRecord: ...


@dataclass(frozen=True, slots=True)
class Command:
    """What an admin asked a gateway to do with one of its models, or what the cluster
    asks of it: ``adopt`` the cluster's ``lease`` granted beside it (``cluster.py``)."""

    id: str
    model: str
    verb: str
    lease: str | None = None

    def as_dict(self) -> dict[str, str]:
        found = {"id": self.id, "model": self.model, "verb": self.verb}
        return found if self.lease is None else {**found, "lease": self.lease}


@dataclass(frozen=True, slots=True)
class Report:
    """What a gateway says of itself: where it listens, on which host and beside which
    worker, and its models (each as its own ``GET /v1/models`` describes it)."""

    url: str
    host: str
    worker: str | None
    models: Sequence[Mapping[str, Any]]
    routes: Sequence[Mapping[str, Any]] = ()  # its last routing decisions, as a front door
    public_key: str | None = None  # its X25519 key, that its peers check its relays with
    conflicts: Sequence[Mapping[str, str]] = ()  # names both its models' sources declare
    files: Sequence[Mapping[str, Any]] = ()  # the model files it holds: name, size, sha256
    left_out: Sequence[Mapping[str, str]] = ()  # the catalogue's models not served there


@dataclass(slots=True)
class _Gateway:
    name: str
    report: Report
    reported_at: float
    commands: list[Command] = field(default_factory=list)
    queued: asyncio.Event = field(default_factory=asyncio.Event)
    handed: dict[str, float] = field(default_factory=dict)  # lease to adopt -> handed at


class GatewayRegistry:
    """The gateways, by name, and who holds each name (``names``). ``clock``: monotonic
    seconds (a fake one in tests)."""

    def __init__(
        self,
        names: Names,
        *,
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float = TTL_S,
        forget_s: float = FORGET_S,
        max_gateways: int = MAX_GATEWAYS,
        max_commands: int = MAX_COMMANDS,
    ) -> None:
        self._clock = clock
        self.ttl_s = ttl_s
        self.forget_s = forget_s
        self.max_gateways = max_gateways
        self.max_commands = max_commands
        self._gateways: dict[str, _Gateway] = {}
        self._names = names
        self.token_exists: Callable[[str], bool] = lambda token_id: True
        """Whether a token (its id) is still known: a name whose token was revoked is
        free (set by the server; tests keep every token)."""
        self.adoptable: Adoptable = lambda worker: []
        """The cluster's leases a gateway's worker should adopt (set by the server)."""
        self._moved = asyncio.Event()  # a gateway came, left, or its report changed

    # ------------------------------------------------------------------ the gateway's side

    def report(self, name: str, who: Principal, report: Report) -> list[Command]:
        """Stores ``report`` as the gateway's latest; returns the commands queued for it
        (handed over: they are not queued any more). A name nobody holds (or whose token
        was revoked) is taken by ``who`` first, stored. Raises :class:`Forbidden` when
        another token holds the name (its report live, stale or gone)."""
        self._prune()
        held = self._holder(name, who, "report as")
        found = self._gateways.get(name)
        now = self._clock()
        if held is not None and found is not None:
            if found.report != report or self._stale(found, now):
                self._moved_now()
            found.report, found.reported_at = report, now
            return self._hand_over(found)
        if held is None:
            self._take(name, who, report)
        if found is not None:  # the report of a token that no longer holds the name
            found.queued.set()
        self._gateways[name] = _Gateway(name, report, now)
        self._moved_now()
        return []

    def _holder(self, name: str, who: Principal, doing: str) -> GatewayNameRecord | None:
        """Who holds ``name``, unless it is free (nobody, or a revoked token). Raises
        :class:`Forbidden` when another token than ``who`` holds it (an admin may)."""
        held = self._names.get(name)
        if held is None or held.owner == who.id or who.is_admin:
            return held
        if self.token_exists(held.owner):
            raise self._taken(name, held.owner, who, doing)
        return None

    def _take(self, name: str, who: Principal, report: Report) -> None:
        """``who`` takes ``name``, stored before the report is (a failure changes
        nothing). Raises :class:`TooManyRequests` when :attr:`max_gateways` names are
        held already (taking a revoked token's name holds none more)."""
        names = self._names
        if names.get(name) is None and len(names) >= self.max_gateways:
            raise TooManyRequests(
                f"{len(names)} gateway names are held already (max_gateways is "
                f"{self.max_gateways}); retry later, or forget one",
                limit="max_gateways",
                value=self.max_gateways,
                current=len(names),
            )
        names.take(name, who.id, report.worker)

    async def commands(self, name: str, who: Principal, wait_s: float) -> list[Command]:
        """The commands queued for the gateway, handed over: at once when there are
        some, else as soon as one is queued, else ``[]`` after ``wait_s``."""
        found = self._owned(name, who, "take the commands of")
        deadline = asyncio.get_running_loop().time() + wait_s
        while not found.commands:
            self._adoptions(found)
            left = deadline - asyncio.get_running_loop().time()
            if found.commands or left <= 0 or self._gateways.get(name) is not found:
                break
            found.queued.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(found.queued.wait(), min(left, RECHECK_S))
        return self._hand_over(found)

    def forget(self, name: str, who: Principal) -> None:
        """The gateway's goodbye at a clean stop (its report is forgotten now, its name
        kept for its token), or an admin's forgetting of it (the name is free again,
        stored before the report is dropped). Raises :class:`NotFound` for a name nobody
        holds."""
        self._prune()
        held = self._names.get(name)
        if held is None and (name not in self._gateways or not who.is_admin):
            raise NotFound(f"no gateway {name!r} reports to this controller", gateway=name)
        if held is not None and held.owner != who.id and not who.is_admin:
            raise self._taken(name, held.owner, who, "forget")
        if who.is_admin and held is not None:
            self._names.forget(name)
        found = self._gateways.pop(name, None)
        if found is not None:
            found.queued.set()  # a long-poll of it ends now, empty
            self._moved_now()

    # ------------------------------------------------------------------ the cluster

    def owned(self, name: str, who: Principal, doing: str) -> Report:
        """The live report of gateway ``name``, which ``who`` reports (or an admin).
        Raises :class:`NotFound`, :class:`Forbidden`, and :class:`Conflict` when stale."""
        found = self._owned(name, who, doing)
        if self._stale(found, self._clock()):
            raise Conflict(
                f"gateway {name} has not reported for {self._ago(found):.0f}s: report first",
                gateway=name,
            )
        return found.report

    def live(self) -> list[tuple[str, Report]]:
        """The gateways whose report is live, by name: the cluster's front doors."""
        self._prune()
        now = self._clock()
        return [(n, g.report) for n, g in sorted(self._gateways.items()) if not self._stale(g, now)]

    def known(self) -> list[tuple[str, Report, float | None]]:
        """Every gateway this controller knows, live or stale (until it is forgotten), by
        name: (name, report, seconds since its last report if it is stale, else None)."""
        self._prune()
        now = self._clock()
        return [
            (n, g.report, self._ago(g) if self._stale(g, now) else None)
            for n, g in sorted(self._gateways.items())
        ]

    def declaring(self, model: str) -> list[tuple[str, Report, float | None]]:
        """Every gateway this controller knows (live or stale) that declares ``model`` by
        name or alias: (name, report, seconds since its last report if it is stale, else
        None)."""
        self._prune()
        now = self._clock()
        return [
            (n, g.report, self._ago(g) if self._stale(g, now) else None)
            for n, g in sorted(self._gateways.items())
            if any(_names(m, model) for m in g.report.models)
        ]

    @staticmethod
    def holds_lease(who: Principal, worker: str | None) -> bool:
        """Whether ``who`` holds the cluster's leases granted on ``worker`` (renews,
        readies, idles, releases, adopts them), whichever front door asked for them: the
        gateway token bound to that worker."""
        return worker is not None and who.role == "gateway" and who.worker == worker

    async def moved(self, timeout_s: float) -> None:
        """Returns at the next change of the gateways, or after ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._moved.wait(), timeout_s)

    def _moved_now(self) -> None:
        self._moved.set()
        self._moved = asyncio.Event()

    # ------------------------------------------------------------------ the operator's side

    def queue(self, name: str, model: str, verb: str) -> Command:
        """Queues ``verb`` for ``model`` (a name or an alias of its last report).
        Raises :class:`NotFound` for an unknown gateway or model, :class:`Conflict`
        when the gateway is stale (nobody would take it), or too many are queued."""
        self._prune()
        found = self._gateways.get(name)
        if found is None:
            raise NotFound(f"no gateway {name!r} reports to this controller", gateway=name)
        if self._stale(found, self._clock()):
            raise Conflict(
                f"gateway {name} has not reported for {self._ago(found):.0f}s (stale after "
                f"{self.ttl_s:g}s): nobody would take the command",
                gateway=name,
            )
        named = next((m for m in found.report.models if _names(m, model)), None)
        if named is None:
            known = ", ".join(str(m.get("id")) for m in found.report.models) or "none"
            raise NotFound(
                f"gateway {name} has no model {model!r}; its models: {known}",
                gateway=name,
                model=model,
            )
        if len(found.commands) >= self.max_commands:
            raise Conflict(
                f"{len(found.commands)} commands already wait for gateway {name} "
                f"(max_commands is {self.max_commands}); retry once it took them",
                gateway=name,
            )
        command = Command(f"cmd-{secrets.token_hex(6)}", str(named.get("id")), verb)
        found.commands.append(command)
        found.queued.set()
        return command

    def views(self) -> list[dict[str, Any]]:
        """Every gateway known, by name: its last report, how long ago, whether stale."""
        self._prune()
        return [self._view(found) for _, found in sorted(self._gateways.items())]

    def view(self, name: str) -> dict[str, Any]:
        self._prune()
        found = self._gateways.get(name)
        if found is None:
            raise NotFound(f"no gateway {name!r} reports to this controller", gateway=name)
        return self._view(found)

    # ------------------------------------------------------------------ inside

    def _view(self, found: _Gateway) -> dict[str, Any]:
        report = found.report
        return {
            "name": found.name,
            "url": report.url,
            "host": report.host,
            "worker": report.worker,
            "reported_ago_s": round(self._ago(found), 1),
            "stale": self._stale(found, self._clock()),
            "commands_queued": len(found.commands),
            "models": [dict(model) for model in report.models],
            "routes": [dict(route) for route in report.routes],
            "conflicts": [dict(conflict) for conflict in report.conflicts],
            "files": [dict(file) for file in report.files],
            "left_out": [dict(model) for model in report.left_out],
        }

    def _owned(self, name: str, who: Principal, doing: str) -> _Gateway:
        self._prune()
        found = self._gateways.get(name)
        held = self._names.get(name)
        if found is None or (held is None and not who.is_admin):
            raise NotFound(f"no gateway {name!r} reports to this controller", gateway=name)
        if held is not None and not who.is_admin and who.id != held.owner:
            raise self._taken(name, held.owner, who, doing)
        return found

    @staticmethod
    def _taken(name: str, owner: str, who: Principal, doing: str) -> Forbidden:
        return Forbidden(
            f"gateway {name} belongs to another token ({owner}): only the token that first "
            f"reported it, or an admin, may {doing} it (you are {who.described()}; an admin "
            f"frees the name with `gpu-arbiter gateways forget {name}`)",
            owner=owner,
            owner_rule="a name belongs to the token that first reported it, live or stale, "
            "until an admin forgets it or the token is revoked",
        )

    def _hand_over(self, found: _Gateway) -> list[Command]:
        self._adoptions(found)
        taken, found.commands = found.commands, []
        return taken

    def _adoptions(self, found: _Gateway) -> None:
        """Queues ``adopt`` for each of the cluster's leases loading beside the gateway
        that its report does not show it holding (a front door that asked for it died
        before it forwarded a request there): handed again after :data:`ADOPT_AGAIN_S`
        while its reports still do not show it."""
        worker = found.report.worker
        if worker is None:
            return
        now = self._clock()
        held = {
            replica.get("lease")
            for model in found.report.models
            for replica in model.get("replicas") or ()
            if isinstance(replica, Mapping)
        }
        leases = [(m, lease_id) for m, lease_id in self.adoptable(worker) if lease_id not in held]
        alive = {lease_id for _, lease_id in leases}
        found.handed = {k: v for k, v in found.handed.items() if k in alive}
        for model, lease_id in leases:
            if now - found.handed.get(lease_id, -ADOPT_AGAIN_S) >= ADOPT_AGAIN_S:
                found.handed[lease_id] = now
                command_id = f"cmd-{secrets.token_hex(6)}"
                found.commands.append(Command(command_id, model, "adopt", lease_id))

    def _ago(self, found: _Gateway) -> float:
        return max(0.0, self._clock() - found.reported_at)

    def _stale(self, found: _Gateway, now: float) -> bool:
        return now - found.reported_at >= self.ttl_s

    def _prune(self) -> None:
        """Forgets the gateways stale for longer than ``forget_s``."""
        cutoff = self._clock() - self.ttl_s - self.forget_s
        for name in [n for n, g in self._gateways.items() if g.reported_at < cutoff]:
            self._gateways.pop(name).queued.set()


def as_gateway(who: Principal, doing: str) -> None:
    """Raises :class:`Forbidden` unless ``who`` may act as a gateway: a gateway token,
    or an admin."""
    if who.role not in ("admin", "gateway"):
        raise refuse(who, doing, needs="a gateway token (gpu-arbiter token create --role gateway)")


def _names(model: Mapping[str, Any], wanted: str) -> bool:
    """Whether a reported model is ``wanted``, by its id or one of its aliases."""
    aliases = model.get("aliases")
    return model.get("id") == wanted or (isinstance(aliases, list) and wanted in aliases)
