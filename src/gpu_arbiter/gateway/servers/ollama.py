"""Ollama: one ``ollama serve`` holds many models; each is a model of the gateway with a
lease of its own, and all of them share the one serve of their config entry.

::

    [models.local]  ollama_models = {"llama3.2:3b" = "3G", "qwen3:8b" = "6G"}

    "llama3.2:3b" -> ModelServer -> Replica -> OllamaProcess --+
    "qwen3:8b"    -> ModelServer -> Replica -> OllamaProcess --+--> OllamaServe
                    (each: queue, lease, keep_alive, pin, ...)      (one ``ollama serve``
                                                                   process group, no lease)

The replica's life does not change: it talks to a :class:`~.interfaces.Launcher` (here
:class:`OllamaLauncher`, one per Ollama model) and a :class:`~.interfaces.ServerProcess`
(here :class:`OllamaProcess`, one per load):

- **start** = the shared serve up (started through the real launcher in a process group
  of its own, ``OLLAMA_KEEP_ALIVE=-1`` so that Ollama never unloads on its own clock: the
  gateway decides; ``OLLAMA_MAX_LOADED_MODELS`` large; ready once ``/api/version``
  answers), then ``POST /api/generate {"model": M, "keep_alive": -1}`` without a prompt,
  which answers once M is loaded;
- **SIGTERM** = unload M (``keep_alive: 0``); **SIGKILL** = the same, and the serve
  stopped if M does not unload (the other models of the serve then end too);
- **wait()** returns once ``/api/ps`` no longer lists M (polled every ``POLL_S``), or with
  the serve's exit code when the serve exits; the serve is stopped when the last of its
  models is unloaded, before that model's wait returns (its group's memory is counted
  in that model's lease until it is gone: I4);
- **tail()** = the serve's output.

Memory: an Ollama model's lease is not attached to a pid (attaching one group to
several leases would make the agent stop every model when one lease is revoked: ``pid``
is None). Instead the serve *accounts* for its group to the agent (the ``account`` op:
the group's memory is that of its models' leases, in proportion to each one's
``size_vram``, the lease's size until ``/api/ps`` lists it), every ``ACCOUNT_S`` and at
once when a model loads or unloads, ``{}`` once it stops: a per-process probe's figure
for the group is then split among those leases, and counted once, not as memory of no
lease beside them. ``size_vram`` from ``/api/ps`` is also each model's measure: once
loaded, the lease shrinks to it when smaller (I4: what it gives back is granted only
once the probe shows it free), and the model asks for that figure at its next load. A
model Ollama unloads by itself (its own scheduler making room, a crash, a request that
set its own ``keep_alive``) shows as its process exiting: its lease is released
(``dropped``, not a failure: no backoff) and the next request loads it again. The serve
runs on the GPUs of the lease that started it; the leases of its models are asked for
on those GPUs while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from ...client import ApiError, ControllerUnreachable
from ..base.clock import Clock, sleep_or
from ..base.metrics import GatewayMetrics
from .config import ModelConfig
from .engines import OFFLINE, EngineHttp, OllamaDriver, same_model
from .interfaces import AgentLink, Launcher, LeaseApi, Parts, ServerProcess
from .lease import Lease
from .model import ModelServer
from .replica import Replica
from .states import Ending, EndKind

__all__ = ["OllamaLauncher", "OllamaModelServer", "OllamaProcess", "OllamaServe", "model_servers"]

log = logging.getLogger("gpu_arbiter.gateway")
POLL_S = 0.5  # how often /api/ps is read, and the serve's /api/version while it starts
UP_TIMEOUT_S = 60.0  # for a started serve to answer /api/version
KILL_WAIT_S = 5.0  # after a SIGKILL, how long an unload may take before the serve is stopped
MAX_LOADED_MODELS = "256"  # Ollama evicts by count beyond this (by memory, it still may)
TAIL_LINES = 8
ACCOUNT_S = 5.0  # how often the serve's account is said again (the agent drops it after 30 s)
_LEASE_ENV = ("GPU_ARBITER_LEASE", "GPU_ARBITER_FENCING_TOKEN")  # one model's, not the serve's


class OllamaServe:
    """The one ``ollama serve`` of a config entry: started when a model of it loads,
    stopped when none is loaded. Its port is reserved once, for the gateway's life, so
    that every model of it forwards to the same one."""

    def __init__(
        self, entry: str, launcher: Launcher, http: EngineHttp, clock: Clock, models: int,
        agent: AgentLink,
    ) -> None:  # fmt: skip
        self.entry = entry
        self.launcher = launcher
        self.driver = OllamaDriver(http)
        self.clock = clock
        self.models = models
        self.agent = agent
        self.process: ServerProcess | None = None
        self.gpus: list[str] = []  # of the lease that started it, while it runs
        self.worker = ""  # the same
        self.exited = asyncio.Event()  # of the run now (a new one per start)
        self.code: int | None = None
        self.holders: dict[str, tuple[str, int]] = {}  # loaded or loading: model -> lease, MiB
        self._port: int | None = None
        self._lock = asyncio.Lock()
        self._recount = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None  # its tasks' owner, while it runs
        self._ended = 0  # how many of its models' lives have ended
        self._closed = asyncio.Event()  # all of them: the serve's life ends
        self._grace_s = 0.0  # of the model that started it last

    async def run(self) -> None:
        """The serve's life, for the gateway's: it owns the serve's tasks (its reaper,
        its account, each model's watcher) and ends once every model of it has ended
        (:meth:`model_ended`), the serve stopped if it still runs. Cancelled, it kills
        the serve's group: nothing outlives its supervisor."""
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                await self._closed.wait()
                async with self._lock:
                    if self.running:
                        await self._stop(self._grace_s)
        finally:
            self._group = None
            if self.running:
                self.kill()

    def model_ended(self) -> None:
        """A model of the serve ended its life; the last one ends the serve's."""
        self._ended += 1
        if self._ended >= self.models:
            self._closed.set()

    def task(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """``work`` as a task of the serve's life (a bare task while it does not run); a
        bug in it is logged and ends it alone, not the serve's life with its models'."""
        guarded = self._guarded(work)
        if self._group is None:
            return asyncio.ensure_future(guarded)
        return self._group.create_task(guarded)

    async def _guarded(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception:
            log.exception("ollama serve of %s: a task of it failed", self.entry)

    @property
    def port(self) -> int:
        if self._port is None:
            self._port = self.launcher.port()
        return self._port

    @property
    def running(self) -> bool:
        return self.process is not None and not self.exited.is_set()

    async def hold(
        self, model: str, command: Sequence[str], env: Mapping[str, str],
        lease: Lease, grace_s: float,
    ) -> None:  # fmt: skip
        """``model`` is loading on the serve under ``lease``: started first if it does not
        run (on the lease's GPUs). ``OSError`` when it cannot be, or runs on other GPUs."""
        gpus = list(lease.gpus)
        async with self._lock:
            if self.running and sorted(self.gpus) != sorted(gpus):
                raise OSError(
                    f"the lease is on {', '.join(gpus)}, but ollama serve runs on "
                    f"{', '.join(self.gpus)}: the next one is asked for there"
                )
            if not self.running:
                self.worker = lease.worker or ""
                await self._start(command, env, grace_s)
                self.gpus = gpus
            self.holders[model] = (lease.id, lease.vram_mb)
            self.recount()

    def recount(self) -> None:
        """The serve's account is said again now (a model loaded, unloaded or measured)."""
        self._recount.set()

    async def let_go(self, model: str, grace_s: float) -> None:
        """``model`` is unloaded: the serve stops if it was the last."""
        async with self._lock:
            self.holders.pop(model, None)
            self.recount()
            if not self.holders and self.running:
                log.info("ollama serve of %s: no model loaded: stopping it", self.entry)
                await self._stop(grace_s)

    def kill(self) -> None:
        """SIGKILL to the serve's group (a model that does not unload)."""
        if self.process is not None:
            self.process.signal(signal.SIGKILL)

    def tail(self, lines: int) -> list[str]:
        return self.process.tail(lines) if self.process is not None else []

    def serve_env(self, env: Mapping[str, str]) -> dict[str, str]:
        found = {name: value for name, value in env.items() if name not in _LEASE_ENV}
        found["OLLAMA_HOST"] = f"127.0.0.1:{self.port}"
        found["OLLAMA_KEEP_ALIVE"] = "-1"  # never unloaded on Ollama's clock: on ours
        found["OLLAMA_MAX_LOADED_MODELS"] = str(max(self.models, int(MAX_LOADED_MODELS)))
        return found

    async def _start(self, command: Sequence[str], env: Mapping[str, str], grace_s: float) -> None:
        self.exited = asyncio.Event()
        self.code = None
        process = await self.launcher.start(
            self.entry, command, self.serve_env(env), lease_id="", grace_s=grace_s
        )
        self.process = process
        self._grace_s = grace_s
        self.task(self._reap(process, self.exited))
        if process.pid is not None:
            self.task(self._account(process.pid, self.exited))
        log.info(
            "ollama serve of %s: started pid %s on port %d", self.entry, process.pid, self.port
        )
        deadline = self.clock.now() + UP_TIMEOUT_S
        while not self.exited.is_set():
            answer = await self.driver.http.call("GET", self.port, "/api/version")
            if answer is not None and answer.ok:
                return
            if self.clock.now() > deadline:
                await self._stop(grace_s)
                raise OSError(f"ollama serve did not answer /api/version in {UP_TIMEOUT_S:g}s")
            await sleep_or(self.clock.sleep(POLL_S), self.exited)
        raise OSError(
            f"ollama serve exited with code {self.code}{_last_lines(self.tail(TAIL_LINES))}"
        )

    async def _reap(self, process: ServerProcess, exited: asyncio.Event) -> None:
        self.code = await process.wait()
        exited.set()
        self.recount()
        log.info("ollama serve of %s: exited with code %s", self.entry, self.code)

    async def _account(self, pgid: int, exited: asyncio.Event) -> None:
        """While the serve runs, says to the agent that its group's memory is the memory
        of its models' leases (so that a per-process probe's figure is counted once, I2):
        every ``ACCOUNT_S``, at once on a change, and ``{}`` once none is loaded or the
        serve is gone."""
        said: dict[str, int] = {}
        worker = self.worker
        while not exited.is_set():
            self._recount.clear()
            shares = await self._shares()
            if (shares or said) and not exited.is_set():
                await self._say(worker, pgid, shares, said)
                said = shares
            await sleep_or(self.clock.sleep(ACCOUNT_S), self._recount)
        if said:
            await self._say(worker, pgid, {}, said)

    async def _shares(self) -> dict[str, int]:
        """Each loaded model's lease -> its ``size_vram`` (the lease's MiB until
        ``/api/ps`` lists it)."""
        listed = await self.driver.loaded(self.port) or {}
        shares: dict[str, int] = {}
        for model, (lease_id, lease_mb) in self.holders.items():
            figures = [mb for name, mb in listed.items() if same_model(name, model)]
            shares[lease_id] = figures[0] if figures else lease_mb
        return shares

    async def _say(
        self, worker: str, pgid: int, shares: dict[str, int], said: dict[str, int]
    ) -> None:
        taken = await self.agent.account(worker, pgid, shares)
        if not taken and shares and shares.keys() != said.keys():
            log.warning(
                "ollama serve of %s: the agent of %s did not take its account: its memory"
                " counts as no lease's", self.entry, worker or "this host",
            )  # fmt: skip

    async def _stop(self, grace_s: float) -> None:
        """SIGTERM, SIGKILL after ``grace_s``; returns once its group is gone."""
        if self.process is None:
            return
        self.process.signal(signal.SIGTERM)
        if not await sleep_or(self.clock.sleep(grace_s), self.exited):
            log.warning("ollama serve of %s outlived its grace: SIGKILL", self.entry)
            self.process.signal(signal.SIGKILL)
            await self.exited.wait()


class OllamaProcess:
    """One Ollama model loaded on the serve (see :class:`~.interfaces.ServerProcess`):
    no process group of its own (``pid`` None). One watcher (started by the first
    :meth:`wait` or signal) polls ``/api/ps``, sends the unloads the signals ask for, and
    ends when the model is gone."""

    pid: int | None = None

    def __init__(self, serve: OllamaServe, model: str, grace_s: float) -> None:
        self.serve = serve
        self.model = model
        self.grace_s = grace_s
        self.dropped = False  # Ollama unloaded it without being asked
        self._exited = serve.exited  # the run it was loaded on
        self._asked: set[int] = set()  # the signals received
        self._sent: set[int] = set()  # the signals acted upon
        self._poke = asyncio.Event()
        self._ended: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._watcher: asyncio.Task[None] | None = None

    async def wait(self) -> int:
        self._watch()
        code: int = await asyncio.shield(self._ended)
        return code

    def signal(self, signum: int) -> None:
        if self._ended.done():
            return
        self._asked.add(signum)
        self._poke.set()
        self._watch()

    def tail(self, lines: int) -> list[str]:
        return self.serve.tail(lines)

    def _watch(self) -> None:
        if self._watcher is None:
            self._watcher = self.serve.task(self._run())

    async def _run(self) -> None:
        try:
            code = await self._until_gone()
            await self.serve.let_go(self.model, self.grace_s)
        except asyncio.CancelledError:  # the serve's life was cancelled: it is killed
            if not self._ended.done():
                self._ended.set_result(-9)
            raise
        except Exception:  # a bug: its waiters still learn that it ended
            log.exception("ollama model %s: its watcher failed", self.model)
            self.serve.holders.pop(self.model, None)
            code = -1
        if not self._ended.done():
            self._ended.set_result(code)

    async def _until_gone(self) -> int:
        """0 once ``/api/ps`` no longer lists the model; the serve's code if it exits."""
        clock, driver, port = self.serve.clock, self.serve.driver, self.serve.port
        killed_at: float | None = None
        while not self._exited.is_set():
            self._poke.clear()
            if signal.SIGKILL in self._asked and signal.SIGKILL not in self._sent:
                self._sent.add(signal.SIGKILL)
                killed_at = clock.now()
                if not await driver.unload(port, self.model):
                    self.serve.kill()
            elif self._asked and not self._sent:
                self._sent.add(signal.SIGTERM)
                await driver.unload(port, self.model)  # it answers once unloaded
            if killed_at is not None and clock.now() - killed_at > KILL_WAIT_S:
                self.serve.kill()
            loaded = await driver.loaded(port)
            if loaded is not None and not any(same_model(n, self.model) for n in loaded):
                self.dropped = not self._asked
                return 0
            await sleep_or(clock.sleep(POLL_S), self._poke)
        return self.serve.code if self.serve.code is not None else -1


class OllamaLauncher:
    """The :class:`~.interfaces.Launcher` of one Ollama model: the serve's port, and a
    start that loads the model on the serve, measures it (``size_vram``) and shrinks its
    lease to that when smaller."""

    def __init__(
        self, serve: OllamaServe, model: str, leases: LeaseApi,
        remember: Callable[[int], None], load_timeout_s: float,
    ) -> None:  # fmt: skip
        self.serve = serve
        self.model = model
        self.leases = leases
        self.remember = remember
        self.load_timeout_s = load_timeout_s

    def port(self) -> int:
        return self.serve.port

    def unreserve(self, port: int) -> None:
        """Nothing: the serve keeps its port for every model of it."""

    async def start(
        self, model: str, command: Sequence[str], env: Mapping[str, str], *, lease_id: str,
        grace_s: float,
    ) -> OllamaProcess:  # fmt: skip
        lease = await self._lease(lease_id)
        await self.serve.hold(self.model, command, env, lease, grace_s)
        process = OllamaProcess(self.serve, self.model, grace_s)
        driver, port = self.serve.driver, self.serve.port
        answer = await driver.load(port, self.model, self.load_timeout_s)
        if answer is None or not answer.ok:
            process.signal(signal.SIGTERM)  # whatever it loaded is unloaded, the serve let go
            await process.wait()
            why = _error_of(answer.body) if answer is not None else "no answer"
            raise OSError(f"ollama did not load {self.model}: {why}")
        log.info("ollama model %s: loaded", self.model)
        await self._measure(lease)
        self.serve.recount()  # its own figure now
        return process

    async def _lease(self, lease_id: str) -> Lease:
        try:
            return Lease.of(await self.leases.lease(lease_id))
        except (ApiError, ControllerUnreachable) as error:
            raise OSError(f"lease {lease_id} not readable: {error}") from None

    async def _measure(self, lease: Lease) -> None:
        """``size_vram`` is remembered for the next load; the lease shrinks to it when
        smaller (a model Ollama runs on the CPU, 0, says nothing of the GPU)."""
        used = await self.serve.driver.loaded(self.serve.port)
        mb = next((v for n, v in (used or {}).items() if same_model(n, self.model)), 0)
        if mb <= 0:
            return
        self.remember(mb)
        if mb < lease.vram_mb:
            with contextlib.suppress(ApiError, ControllerUnreachable):
                await self.leases.shrink(lease.id, mb)
                log.info("ollama model %s: lease %s shrunk to %d MiB", self.model, lease.id, mb)


class OllamaModelServer(ModelServer):
    """A model of the gateway that is one Ollama model of a shared serve: its driver
    speaks for it (``size_vram``), its lease is asked for on the serve's GPUs while the
    serve runs, it remembers what it measured, and a drop by Ollama is no failure."""

    def __init__(self, config: ModelConfig, *, serve: OllamaServe, **keys: Any) -> None:
        super().__init__(config, **keys)
        self.serve = serve
        self.driver = OllamaDriver(self.parts.engines or OFFLINE, model=config.name)
        launcher = OllamaLauncher(
            serve, config.name, self.parts.leases, self._remember, config.load_timeout_s
        )
        self.parts = Parts(
            self.parts.clock, launcher, self.parts.agent, self.parts.leases, self.parts.health,
            self.parts.engines,
        )  # fmt: skip

    async def run(self) -> None:
        """The model's life; the serve's ends once every model of it has ended."""
        try:
            await super().run()
        finally:
            self.serve.model_ended()

    def _remember(self, mb: int) -> None:
        if mb != self.vram_mb:
            log.info("model %s: measured %d MiB (size_vram), was %d", self.name, mb, self.vram_mb)
            self.vram_mb = mb

    def lease_request(self, number: int) -> dict[str, Any]:
        request = super().lease_request(number)
        if self.serve.running and len(self.serve.gpus) == self.config.gpus:
            request["constraints"] = {**request["constraints"], "gpu_ids": list(self.serve.gpus)}
        return request

    def ended(self, replica: Replica) -> None:
        process = replica.process
        failed = replica.ending is not None and replica.ending.kind is EndKind.FAILED
        if failed and isinstance(process, OllamaProcess) and process.dropped:
            replica.ending = Ending(EndKind.DROPPED, "Ollama unloaded it by itself")
        super().ended(replica)


def model_servers(
    models: Mapping[str, ModelConfig],
    *,
    parts: Parts,
    metrics: GatewayMetrics,
    worker: str | None,
    sizes: Mapping[str, int],
) -> dict[str, ModelServer]:
    """The gateway's models: an Ollama model an :class:`OllamaModelServer` on its entry's
    one :class:`OllamaServe`, any other a :class:`ModelServer`."""
    entries = [m.ollama_serve for m in models.values() if m.ollama_serve is not None]
    serves = {
        entry: OllamaServe(
            entry,
            parts.launcher,
            parts.engines or OFFLINE,
            parts.clock,
            entries.count(entry),
            parts.agent,
        )
        for entry in set(entries)
    }
    found: dict[str, ModelServer] = {}
    for name, model in models.items():
        keys: dict[str, Any] = {
            "parts": parts, "metrics": metrics, "worker": worker,
            "vram_mb": sizes[name],
        }  # fmt: skip
        if model.ollama_serve is None:
            found[name] = ModelServer(model, **keys)
        else:
            found[name] = OllamaModelServer(model, serve=serves[model.ollama_serve], **keys)
    return found


def _error_of(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])[:300]
    return "an error"


def _last_lines(lines: list[str]) -> str:
    shown = [line.strip() for line in lines if line.strip()][-TAIL_LINES:]
    return "; last output: " + " | ".join(shown) if shown else ""
