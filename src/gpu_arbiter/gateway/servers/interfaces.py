"""The things a replica's life touches, each behind a small interface, so that the
life itself (``replica.py``) is unit-tested with ten-line fakes on a virtual clock:

- :class:`~gpu_arbiter.gateway.base.clock.Clock`: the time and sleeping (real: the event
  loop's monotonic clock);
- :class:`Launcher` and :class:`ServerProcess`: starting a model server in its own
  process group and learning that it exited (real: ``process.py``);
- :class:`AgentLink`: the local agent's endpoint (real: ``agent/local.py``'s socket);
- :class:`LeaseApi`: the controller's lease routes (real: :class:`~gpu_arbiter.client.
  ArbiterClient`, which has these very methods);
- :class:`HealthCheck`: asking a model server whether it has loaded (real: HTTP).

Two more keep the replica's own modules apart (no import circle): :class:`ReplicaOwner`
is what a replica uses of its model (``model.py`` implements it), :class:`Sleeper`
what the asleep tier (``asleep.py``) uses of its replica (``replica.py``).

:class:`Parts` bundles them for a gateway's models.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..base.clock import Clock
from ..base.metrics import GatewayMetrics
from .config import ModelConfig
from .engines import Driver, EngineHttp
from .lease import Lease
from .states import Ending, ReplicaState

__all__ = [
    "AgentLink",
    "HealthCheck",
    "Launcher",
    "LeaseApi",
    "Parts",
    "ReplicaOwner",
    "ServerProcess",
    "Sleeper",
    "log_path",
]

Json = dict[str, Any]


class ServerProcess(Protocol):
    """A started model server; ``pid`` leads its own process group (the lease covers the
    whole group), or is None for a model without a group of its own (one of the models
    of one ``ollama serve``: ``ollama.py``), which is never attached to its lease."""

    @property
    def pid(self) -> int | None: ...

    async def wait(self) -> int:
        """Waits until the leader exited and nothing is left of its group; its exit code."""
        ...

    def signal(self, signum: int) -> None:
        """Sends ``signum`` to the whole group (nothing if it is gone)."""
        ...

    def tail(self, lines: int) -> list[str]:
        """The last ``lines`` lines the server wrote (stdout and stderr), oldest first."""
        ...


class Launcher(Protocol):
    def port(self) -> int:
        """A free loopback port, reserved for one server until :meth:`unreserve`."""
        ...

    def unreserve(self, port: int) -> None: ...

    async def start(
        self,
        model: str,
        command: Sequence[str],
        env: Mapping[str, str],
        *,
        lease_id: str,
        grace_s: float,
    ) -> ServerProcess:
        """Starts ``command`` in a new process group, its output to the model's log; the
        group is stopped (SIGTERM, SIGKILL after ``grace_s``) if the gateway dies, and the
        next gateway on this state directory finds what is left of it (with ``lease_id``).
        Raises ``OSError`` when it cannot be started (the program is missing, say)."""
        ...


class AgentLink(Protocol):
    async def env(self, worker: str) -> Mapping[str, str]:
        """What a process on ``worker`` must inherit (empty when no agent runs here)."""
        ...

    async def attach(self, worker: str, lease_id: str, pid: int, holder_stops_s: float) -> bool:
        """Puts group ``pid`` under the agent's supervision; False if no agent took it."""
        ...

    async def stop(self, worker: str, lease_id: str, grace_s: float) -> bool:
        """Asks the agent to stop the lease's group (one SIGTERM whoever asks); False if
        it does not supervise it."""
        ...

    async def used_mb(self, worker: str, pid: int) -> int | None:
        """The group's GPU memory as the agent's probe saw it last."""
        ...

    async def account(self, worker: str, pgid: int, shares: Mapping[str, int]) -> bool:
        """Says that group ``pgid``'s GPU memory is the memory of the leases of ``shares``
        (lease id -> MiB, the proportions it is split in; ``{}``: of none), a group the
        agent does not supervise (one ``ollama serve``); repeated every few seconds, as the
        agent drops it after 30 s. False if no agent took it."""
        ...


class LeaseApi(Protocol):
    async def create_lease(self, **request: Any) -> Json: ...

    async def lease(
        self, lease_id: str, *, wait_s: float | None = None, state: str | None = None
    ) -> Json: ...

    async def renew(self, lease_id: str, ttl_s: float | None = None) -> Json: ...

    async def ready(self, lease_id: str) -> Json: ...

    async def idle(self, lease_id: str) -> Json: ...

    async def busy(self, lease_id: str) -> Json: ...

    async def release(self, lease_id: str) -> Json: ...

    async def shrink(self, lease_id: str, vram_mb: int | str) -> Json: ...

    async def workers(self) -> list[Json]: ...


class HealthCheck(Protocol):
    async def status(self, port: int, path: str) -> int | None:
        """The HTTP status of ``GET path`` on the server's port; None when nothing answered."""
        ...


@dataclass(frozen=True, slots=True)
class Parts:
    clock: Clock
    launcher: Launcher
    agent: AgentLink
    leases: LeaseApi
    health: HealthCheck
    engines: EngineHttp | None = None  # the engines' own routes (None: none reachable)


R = TypeVar("R")


class ReplicaOwner(Protocol[R]):
    """What a replica (``R``: :class:`~.replica.Replica`) uses of its model
    (:class:`~.model.ModelServer`): its settings and parts, the figures a lease is asked
    for with, and the calls by which the replica tells it what happened."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> ModelConfig: ...

    @property
    def parts(self) -> Parts: ...

    @property
    def driver(self) -> Driver: ...

    @property
    def metrics(self) -> GatewayMetrics: ...

    @property
    def pinned(self) -> bool: ...

    @property
    def vram_mb(self) -> int:
        """The size a lease is asked for at (measured, for ``vram = "auto"``)."""
        ...

    @property
    def waiting(self) -> int:
        """How many requests wait for a slot."""
        ...

    @property
    def replicas(self) -> Sequence[R]: ...

    def lease_priority(self) -> int: ...

    def lease_request(self, number: int) -> dict[str, Any]: ...

    def swap_due(self, priority: int) -> float | None: ...

    def notify(self) -> None:
        """A replica's state, pending reason or requests changed."""
        ...

    def loaded(self, replica: R, load_s: float) -> None: ...

    async def measure(self, replica: R) -> None: ...

    def ended(self, replica: R) -> None:
        """``replica`` ended (its lease released): the model forgets it."""
        ...

    def file_kept(self) -> AbstractContextManager[None]:
        """Its model file kept while a replica lives (``files/ensure.py``)."""
        ...

    async def file_ready(self, replica: R) -> bool:
        """Its model file in place (copied if need be) before the lease is asked for."""
        ...


class FileKeeper(Protocol):
    """A model's file as its replicas see it (``files/ensure.py``): kept while one lives,
    put in place before one asks for its lease."""

    def kept(self, model: Any) -> AbstractContextManager[None]: ...

    async def ready(self, model: Any, replica: Any) -> bool: ...


class Sleeper(Protocol):
    """What the asleep tier (``asleep.py``) uses of its replica."""

    number: int
    lease: Lease | None
    pending_reason: str
    quiet_since: float

    @property
    def model(self) -> ReplicaOwner[Any]: ...

    @property
    def holding(self) -> Lease: ...

    @property
    def parts(self) -> Parts: ...

    @property
    def port(self) -> int: ...

    @property
    def arrivals(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def ending(self) -> Ending | None: ...

    @property
    def asleep(self) -> bool: ...

    @property
    def activity(self) -> asyncio.Event: ...

    @property
    def ended(self) -> asyncio.Event: ...

    @property
    def group(self) -> asyncio.TaskGroup | None: ...

    def move(self, to: ReplicaState, *, notify: bool = True) -> None: ...

    def tail(self) -> str: ...

    async def used_mb(self) -> int | None: ...

    async def mark_busy(self) -> None: ...

    async def mark_idle(self, arrivals: int) -> None: ...

    async def watch(self, extra: bool = False) -> None: ...

    async def release(self, lease_id: str) -> None: ...


def log_path(state_dir: Path, model: str) -> Path:
    """Where model ``model``'s server writes its output (rotated beside, ``.1``)."""
    return state_dir / "gateway" / "logs" / f"{model}.log"
