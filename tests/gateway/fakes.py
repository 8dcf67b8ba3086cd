"""Fakes behind the gateway's interfaces (``gateway/interfaces.py``): a virtual clock, a
controller's lease routes, processes, an agent and a health check, so that a replica's
whole life runs in a unit test in milliseconds, with time moved by the test."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpu_arbiter.client import ApiError, ControllerUnreachable
from gpu_arbiter.gateway.base.metrics import GatewayMetrics
from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.servers.engines import Answer, EngineHttp
from gpu_arbiter.gateway.servers.interfaces import Parts
from gpu_arbiter.gateway.servers.model import ModelServer

Json = dict[str, Any]


async def settle(rounds: int = 50) -> None:
    """Lets every task that can run, run."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class FakeClock:
    def __init__(self) -> None:
        self.time = 1000.0
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self.time + max(0.0, seconds), next(self._seq), future))
        await future

    async def advance(self, seconds: float) -> None:
        """Moves time on by ``seconds``, firing each timer due on the way, in order."""
        target = self.time + seconds
        await settle()
        while self._timers and self._timers[0][0] <= target:
            at, _, future = heapq.heappop(self._timers)
            self.time = max(self.time, at)
            if not future.done():
                future.set_result(None)
            await settle()
        self.time = target
        await settle()


@dataclass
class FakeLeases:
    """The controller's lease routes over a dict; ``calls`` records (verb, lease id)."""

    grant: bool = True
    unreachable: int = 0  # the next N calls to release fail as unreachable
    leases: dict[str, Json] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    requests: dict[str, Json] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def _set(self, lease_id: str, **changes: Any) -> Json:
        self.leases[lease_id].update(changes)
        self.changed.set()
        self.changed = asyncio.Event()
        return dict(self.leases[lease_id])

    async def create_lease(self, **request: Any) -> Json:
        lease_id = f"L{len(self.leases) + 1}"
        state = "loading" if self.grant else "pending"
        self.requests[lease_id] = request
        self.leases[lease_id] = {
            "id": lease_id, "state": state, "worker": "box", "gpus": ["box:0"],
            "token": 7, "ttl_s": request.get("ttl_s", 30.0), "ended_at": None,
            "vram_mb": request["vram_mb"], "reason": {"code": "insufficient_vram"},
        }  # fmt: skip
        self.calls.append(("create", lease_id))
        return dict(self.leases[lease_id])

    async def lease(
        self, lease_id: str, *, wait_s: float | None = None, state: str | None = None
    ) -> Json:
        while state is not None and self.leases[lease_id]["state"] == state:
            await self.changed.wait()
        return dict(self.leases[lease_id])

    def _held(self, verb: str, lease_id: str) -> Json:
        self.calls.append((verb, lease_id))
        lease = self.leases[lease_id]
        if lease["ended_at"] is not None:
            raise ApiError(409, "lease_ended", "the lease ended", {})
        return dict(lease)

    async def renew(self, lease_id: str, ttl_s: float | None = None) -> Json:
        return self._held("renew", lease_id)

    async def ready(self, lease_id: str) -> Json:
        self._held("ready", lease_id)
        return self._set(lease_id, state="active")

    async def idle(self, lease_id: str) -> Json:
        self._held("idle", lease_id)
        return self._set(lease_id, idle=True)

    async def busy(self, lease_id: str) -> Json:
        self._held("busy", lease_id)
        return self._set(lease_id, idle=False)

    async def release(self, lease_id: str) -> Json:
        if self.unreachable:
            self.unreachable -= 1
            self.calls.append(("unreachable", lease_id))
            raise ControllerUnreachable("no controller")
        self.calls.append(("release", lease_id))
        return self._set(lease_id, state="released", ended_at=1.0)

    async def shrink(self, lease_id: str, vram_mb: int | str) -> Json:
        lease = self._held("shrink", lease_id)
        assert isinstance(vram_mb, int) and 1 <= vram_mb <= lease["vram_mb"]
        return self._set(lease_id, vram_mb=vram_mb)

    async def workers(self) -> list[Json]:
        gpu = {"id": "box:0", "total_mb": 24576, "used_mb": 1024}
        return [{"name": "box", "gpus": [gpu]}]

    # the controller's side
    def revoke(self, lease_id: str, reason: str = "preempted") -> None:
        self._set(lease_id, state="revoking", revoke_reason=reason, preempted_for="L9")

    def give(self, lease_id: str) -> None:
        self._set(lease_id, state="loading")

    def verbs(self) -> list[str]:
        return [verb for verb, _ in self.calls if verb != "renew"]


class FakeProcess:
    def __init__(self, pid: int, command: Sequence[str], obeys_term: bool = True) -> None:
        self.pid = pid
        self.command = list(command)
        self.obeys_term = obeys_term
        self.signals: list[int] = []
        self.lines: list[str] = []
        self.code: int | None = None
        self._gone = asyncio.Event()

    def exit(self, code: int) -> None:
        if self.code is None:
            self.code = code
            self._gone.set()

    async def wait(self) -> int:
        await self._gone.wait()
        assert self.code is not None
        return self.code

    def signal(self, signum: int) -> None:
        if self.code is not None:
            return
        self.signals.append(signum)
        if signum == signal.SIGKILL:
            self.exit(-9)
        elif signum == signal.SIGTERM and self.obeys_term:
            self.exit(-15)

    def tail(self, lines: int) -> list[str]:
        return self.lines[-lines:]


class FakeLauncher:
    def __init__(self) -> None:
        self.processes: list[FakeProcess] = []
        self.reserved: set[int] = set()
        self.obeys_term = True
        self.missing = False  # the program is not there
        self.on_start: Callable[[FakeProcess], None] | None = None
        self._ports = itertools.count(9000)

    def port(self) -> int:
        port = next(self._ports)
        self.reserved.add(port)
        return port

    def unreserve(self, port: int) -> None:
        self.reserved.discard(port)

    async def start(
        self,
        model: str,
        command: Sequence[str],
        env: Mapping[str, str],
        *,
        lease_id: str,
        grace_s: float,
    ) -> FakeProcess:
        if self.missing:
            raise FileNotFoundError(2, "No such file or directory")
        process = FakeProcess(100 + len(self.processes), command, self.obeys_term)
        process.env = dict(env)  # type: ignore[attr-defined]
        self.processes.append(process)
        if self.on_start is not None:
            self.on_start(process)
        return process


class FakeAgent:
    def __init__(self, launcher: FakeLauncher, supervises: bool = True) -> None:
        self.launcher = launcher
        self.supervises = supervises
        self.stops: list[str] = []
        self.used: int | None = None
        self.accounts: list[tuple[str, int, dict[str, int]]] = []  # (worker, pgid, shares)

    async def env(self, worker: str) -> Mapping[str, str]:
        return {"FROM_AGENT": "1"}

    async def attach(self, worker: str, lease_id: str, pid: int, holder_stops_s: float) -> bool:
        return self.supervises

    async def stop(self, worker: str, lease_id: str, grace_s: float) -> bool:
        if not self.supervises:
            return False
        self.stops.append(lease_id)
        for process in self.launcher.processes:
            if process.env["GPU_ARBITER_LEASE"] == lease_id:  # type: ignore[attr-defined]
                process.signal(signal.SIGTERM)
        return True

    async def used_mb(self, worker: str, pid: int) -> int | None:
        return self.used

    async def account(self, worker: str, pgid: int, shares: Mapping[str, int]) -> bool:
        self.accounts.append((worker, pgid, dict(shares)))
        return self.supervises


class FakeHealth:
    """``answers[path]``: the status a path answers (200 by default, once ``loaded``);
    nothing answers on the port of a process that exited."""

    def __init__(self, launcher: FakeLauncher) -> None:
        self.launcher = launcher
        self.loaded = True
        self.answers: dict[str, int | None] = {}
        self.asked: list[str] = []

    async def status(self, port: int, path: str) -> int | None:
        self.asked.append(path)
        on_port = [p for p in self.launcher.processes if str(port) in p.command]
        if not on_port or on_port[-1].code is not None:
            return None
        if path in self.answers:
            return self.answers[path]
        return 200 if self.loaded else 503


class FakeEngine(EngineHttp):
    """An engine's own routes (vLLM's sleep mode): a sleep leaves ``resident_mb`` in the
    agent's figure for the process, a wake takes ``awake_mb`` again."""

    def __init__(self, agent: FakeAgent, resident_mb: int = 300, awake_mb: int = 1000) -> None:
        self.agent = agent
        self.resident_mb = resident_mb
        self.awake_mb = awake_mb
        self.sleeping = False
        self.queue_busy = False  # ComfyUI: a job runs after the answer that queued it
        self.calls: list[str] = []

    async def call(
        self,
        method: str,
        port: int,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Answer | None:
        self.calls.append(path)
        if path == "/sleep":
            self.sleeping, self.agent.used = True, self.resident_mb
        elif path == "/wake_up":
            self.sleeping, self.agent.used = False, self.awake_mb
        elif path == "/queue":
            return Answer(200, {"queue_running": [1] if self.queue_busy else []})
        elif path == "/is_sleeping":
            return Answer(200, {"is_sleeping": self.sleeping})
        elif path == "/props":  # llama.cpp: asleep by itself once asked about it
            self.sleeping, self.agent.used = True, self.resident_mb
            return Answer(200, {"is_sleeping": True})
        elif path == "/completion":  # llama.cpp: a request wakes it
            self.sleeping, self.agent.used = False, self.awake_mb
        return Answer(200, {})

    async def aclose(self) -> None:
        pass


class World:
    """One model over the fakes."""

    def __init__(self, **keys: Any) -> None:
        self.clock = FakeClock()
        self.leases = FakeLeases()
        self.launcher = FakeLauncher()
        self.agent = FakeAgent(self.launcher)
        self.health = FakeHealth(self.launcher)
        self.engine = FakeEngine(self.agent)
        parts = Parts(self.clock, self.launcher, self.agent, self.leases, self.health, self.engine)
        spec = {"command": ["server", "--port", "{port}"], "vram": "1G", **keys}
        config = parse_config({"models": {"chat": spec}}).models["chat"]
        self.tasks: set[asyncio.Task[None]] = set()
        self.model = ModelServer(
            config, parts=parts, metrics=GatewayMetrics(), worker="box", vram_mb=1024
        )
        self.run(self.model)

    def run(self, model: ModelServer) -> None:
        """Runs ``model``'s life (its replicas') until :meth:`close`."""
        task = asyncio.ensure_future(model.run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def request(self, hold_s: float = 0.0) -> Any:
        """One request: takes a slot, holds it ``hold_s`` of virtual time, leaves."""
        replica, _ = await self.model.acquire()
        try:
            if hold_s:
                await self.clock.sleep(hold_s)
        finally:
            replica.leave()
        return replica

    def start(self, hold_s: float = 0.0) -> asyncio.Task[Any]:
        return asyncio.ensure_future(self.request(hold_s))

    @property
    def replica(self) -> Any:
        [replica] = self.model.replicas
        return replica

    @property
    def process(self) -> FakeProcess:
        return self.launcher.processes[-1]

    async def close(self) -> None:
        """Cancels what still runs, moving time on while it cleans up."""
        for task in self.tasks:
            task.cancel()
        for _ in range(100):
            if not self.tasks:
                return
            await self.clock.advance(10)
        raise AssertionError(f"still running after cancel: {self.tasks}")
