"""The gateway tells the controller about itself, and takes the commands queued for it.

The controller never connects to a gateway (no URL a client gave it is ever fetched):
the gateway connects out, as the agents do. Three loops, for the gateway's life:

- report: ``PUT /v1/gateways/{name}`` with every model as ``GET /v1/models`` describes
  it, the gateway's public key (its peers check its relays with it) and the model files
  it holds (name, size, sha256: its peers copy them from it, ``files/``), at start,
  every ``report_s`` (5 s; the controller shows a gateway stale after 15 s without
  one), ``debounce_s`` (0.25 s) after a model's state changed, and at once when the
  model set changed (:meth:`Reporter.models_changed`); with the clashes of the
  set's two sources (``conflicts``: a name both the own file and the catalogue declare,
  ``live.py``), when there are some;
- watch: waits on the models' changes (``ModelServer.changed``) and asks for that early
  report when what the operator sees moved (a state, a pin, a lease), not when only a
  request count did: a busy gateway does not report four times a second;
- commands: long-polls ``GET /v1/gateways/{name}/commands`` and runs each one (unload,
  pin, unpin) through the very code of the gateway's own admin routes
  (``GatewayApp.administer``); ``adopt``: a lease the cluster's load was granted beside
  this gateway, which no front door brought it (``GatewayApp.adopt``).

A controller that cannot be reached is waited through: the loops back off (1 s,
doubling, at most ``report_s``) and log one line when it goes and one when it is back.
At a clean stop, :meth:`Reporter.goodbye` says ``DELETE /v1/gateways/{name}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from ...client import ApiError, ArbiterClient, ControllerUnreachable
from ..base.race import first
from ..servers.model import ModelServer
from .cluster import ROUTES_REPORTED

__all__ = ["Reporter", "default_name", "listen_url", "model_report"]

log = logging.getLogger("gpu_arbiter.gateway")

REPORT_S = 5.0
DEBOUNCE_S = 0.25
COMMANDS_WAIT_S = 30.0
BACKOFF_FIRST_S = 1.0
MAX_TEXT = 2000
MAX_CONFLICTS = 256  # as the controller takes them
MAX_FILES = 256  # model files reported at most (the controller takes no more)
REPORTED = (
    "id", "object", "owned_by", "state", "aliases", "vram_mb", "gpus", "max_parallel",
    "priority", "held_mb", "in_flight", "queued", "last_used_ago_s", "keep_alive_left_s",
    "pinned", "preemptible_by", "pending_reason", "failure", "retry_at", "retry_in_s",
    "replicas", "file",
)  # fmt: skip
"""The fields of a model's description the controller takes (it refuses others)."""

Administer = Callable[[str, str, str], Awaitable[Any]]
Adopt = Callable[[str, str], Awaitable[None]]
"""(model, lease id): the cluster's lease granted beside this gateway, to serve under."""


def default_name(port: int, host: str | None = None) -> str:
    """This host's name and the port, as a worker name: ``box-1-8080``."""
    base = re.sub(r"[^a-z0-9._-]+", "-", (host or socket.gethostname()).lower()).strip("-._")
    suffix = f"-{port}"
    return (base or "gateway")[: 63 - len(suffix)] + suffix


def listen_url(host: str, port: int, scheme: str = "http") -> str:
    """The URL the gateway listens on; this host's name for every interface."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def model_report(model: ModelServer) -> dict[str, Any]:
    """A model as ``GET /v1/models`` describes it, in the fields the controller takes."""
    described = model.describe()
    found = {key: described[key] for key in REPORTED if key in described}
    for key in ("pending_reason", "failure"):
        if isinstance(found.get(key), str):
            found[key] = found[key][:MAX_TEXT]
    return found


def _reported(route: Mapping[str, Any]) -> dict[str, Any]:
    """A routing decision as the controller takes it: without the diagnosis (each
    candidate's scores, for ``GET /admin/routes`` on the gateway itself)."""
    return {key: value for key, value in route.items() if key != "diagnosis"}


def _signature(models: Mapping[str, ModelServer]) -> tuple[Any, ...]:
    """What the operator sees move: each model's state, pin, memory and replicas."""
    return tuple(
        (
            m.state(),
            m.pinned,
            m.waiting > 0,
            tuple((str(r.state), r.lease_id) for r in m.replicas),
        )
        for m in models.values()
    )


class _Link:
    """Whether the controller answers: one log line when it goes, one when it is back."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.up = True
        self.refused = ""

    def gone(self, error: Exception) -> None:
        if self.up:
            log.warning(
                "gateway %s: the controller is unreachable (%s); retrying", self.name, error
            )
        self.up = False

    def back(self) -> None:
        if not self.up:
            log.info("gateway %s: the controller answers again", self.name)
        self.up = True
        self.refused = ""

    def refusal(self, error: ApiError) -> None:
        text = f"{error.status} {error.code}: {error}"
        if text != self.refused:
            log.warning("gateway %s: the controller refused its report: %s", self.name, text)
        self.refused = text


class Reporter:
    """One gateway's reporter: ``name`` (a worker name), its ``url``, ``host`` and
    ``worker``, its ``models``; ``administer(model, verb, by)`` runs a command; a
    controller that does not answer is tried again after ``backoff_s``, doubling up to
    ``report_s``."""

    def __init__(
        self,
        client: ArbiterClient,
        *,
        name: str,
        url: str,
        host: str,
        worker: str | None,
        models: Mapping[str, ModelServer],
        administer: Administer,
        adopt: Adopt | None = None,
        routes: Callable[[], Iterable[Mapping[str, Any]]] = lambda: (),
        conflicts: Callable[[], Iterable[Mapping[str, Any]]] = lambda: (),
        left_out: Callable[[], Iterable[Mapping[str, Any]]] = lambda: (),
        public_key: str | None = None,
        files: Callable[[], Iterable[Mapping[str, Any]]] = lambda: (),
        report_s: float = REPORT_S,
        debounce_s: float = DEBOUNCE_S,
        backoff_s: float = BACKOFF_FIRST_S,
    ) -> None:
        self.client = client
        self.name = name
        self.url = url
        self.host = host
        self.worker = worker
        self.models = models
        self.administer = administer
        self.adopt = adopt
        self.routes = routes  # the front door's last routing decisions
        self.conflicts = conflicts  # the model set's name clashes between its sources
        self.left_out = left_out  # the catalogue's models this host does not serve, and why
        self.public_key = public_key  # this gateway's (``peer_identity.Identity``)
        self.files = files  # the model files it holds, verified (``files/store.py``)
        self.report_s = report_s
        self.debounce_s = debounce_s
        self.backoff_s = backoff_s
        self._link = _Link(name)
        self._soon = asyncio.Event()  # report now: a change, or the controller forgot it
        self._known = asyncio.Event()  # the controller has the last report
        self._reported: tuple[Any, ...] = ()
        self._new_set = asyncio.Event()  # the model set changed: watched anew
        self._group: asyncio.TaskGroup | None = None

    async def run(self) -> None:
        """Reports, watches and takes commands until cancelled."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            group.create_task(self._reporting())
            group.create_task(self._watching())
            group.create_task(self._commands())

    def models_changed(self) -> None:
        """The model set changed (a model added or removed): reported now, and each
        model of the new set watched."""
        self._soon.set()
        self._new_set.set()
        self._new_set = asyncio.Event()

    async def goodbye(self, timeout_s: float = 3.0) -> None:
        """``DELETE /v1/gateways/{name}``: gone from the controller's list now."""
        try:
            await asyncio.wait_for(self.client.forget_gateway(self.name), timeout_s)
        except (ApiError, ControllerUnreachable, TimeoutError) as error:
            log.info("gateway %s: no goodbye to the controller (%s)", self.name, error)

    # ------------------------------------------------------------------ loops

    async def _reporting(self) -> None:
        backoff = self.backoff_s
        while True:
            wait_s = self.report_s
            if not await self._report():
                wait_s, backoff = min(backoff, self.report_s), min(2 * backoff, self.report_s)
            else:
                backoff = self.backoff_s
            self._soon.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._soon.wait(), wait_s)

    async def _report(self) -> bool:
        """One report; whether the controller took it. Its commands are run."""
        signature = self._signature()
        body = {
            "url": self.url,
            "host": self.host,
            "worker": self.worker,
            "models": [model_report(m) for m in self.models.values()],
            "routes": [_reported(r) for r in list(self.routes())[-ROUTES_REPORTED:]],
            "files": [dict(f) for f in self.files()][:MAX_FILES],
        }
        if self.public_key is not None:
            body["public_key"] = self.public_key
        conflicts = [dict(c) for c in self.conflicts()][:MAX_CONFLICTS]
        if conflicts:  # a controller that does not know the field is sent none
            body["conflicts"] = conflicts
        left_out = [dict(m) for m in self.left_out()][:MAX_CONFLICTS]
        if left_out:  # likewise
            body["left_out"] = left_out
        try:
            answer = await self.client.report_gateway(self.name, body)
        except ControllerUnreachable as error:
            self._link.gone(error)
            return False
        except ApiError as error:
            self._link.back()
            self._link.refusal(error)
            return False
        self._link.back()
        self._reported = signature
        self._known.set()
        for command in answer.get("commands") or []:
            self._spawn(command)
        return True

    def _signature(self) -> tuple[Any, ...]:
        """What the operator and the peers see move: the models, and the files held."""
        files = tuple(sorted(str(f.get("name")) for f in self.files()))
        return (*_signature(self.models), files)

    async def _watching(self) -> None:
        while True:
            await _first_change(self.models, self._new_set)
            await asyncio.sleep(self.debounce_s)
            if self._signature() != self._reported:
                self._soon.set()

    async def _commands(self) -> None:
        backoff = self.backoff_s
        while True:
            await self._known.wait()
            try:
                commands = await self.client.gateway_commands(self.name, wait_s=COMMANDS_WAIT_S)
            except (ControllerUnreachable, ApiError) as error:
                if isinstance(error, ApiError) and error.status == 404:
                    self._known.clear()  # forgotten (a restarted controller): report again
                    self._soon.set()
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, self.report_s)
                continue
            backoff = self.backoff_s
            for command in commands:
                self._spawn(command)

    def _spawn(self, command: Mapping[str, Any]) -> None:
        """Runs a command beside the loops: an unload takes its models' grace."""
        assert self._group is not None
        self._group.create_task(self._run(command))

    async def _run(self, command: Mapping[str, Any]) -> None:
        model, verb = str(command.get("model")), str(command.get("verb"))
        if verb == "adopt" and self.adopt is not None:
            await self.adopt(model, str(command.get("lease")))
            self._soon.set()
            return
        try:
            done = await self.administer(model, verb, f"the controller ({command.get('id')})")
        except ValueError as error:  # a verb this gateway does not know
            log.warning("gateway %s: command ignored: %s", self.name, error)
            return
        except Exception:
            log.exception("gateway %s: command %s %s failed", self.name, verb, model)
            return
        if done is None:
            log.warning("gateway %s: command %s for unknown model %s", self.name, verb, model)
        self._soon.set()  # the outcome, reported soon


async def _first_change(models: Mapping[str, ModelServer], new_set: asyncio.Event) -> None:
    """Returns at the first change of any of ``models``, or of the set (``new_set``)."""
    waits: list[Awaitable[Any]] = [m.changed() for m in models.values()]
    await first(new_set.wait(), *waits)
