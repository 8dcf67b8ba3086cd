"""Engines: what the gateway knows of the model server it runs, and how it talks to it.

A model's ``engine`` (the config key; default: read from the command by
:func:`~.estimate.engine_of`, else ``generic``) picks a :class:`Driver`, which says, with
the engine's own documented interfaces:

- **the flags a lease allows** (:meth:`Driver.prepare`): what keeps the server within
  its lease where it would otherwise size itself from the GPU's free memory;
- **where it says it has loaded** (:attr:`Driver.ready_paths`);
- **what busy means** (:meth:`Driver.busy`): the requests in flight (the gateway counts
  them), or ComfyUI's queue, whose work runs after its answer;
- **how it gives memory back without dying** (:attr:`Driver.sleeps`, :meth:`Driver.sleep`,
  :meth:`Driver.wake`, :meth:`Driver.is_sleeping`);
- **what measures its memory** (:meth:`Driver.used_mb`): the agent's probe of the process
  group, or the engine's own figure where one group serves several models (Ollama);
- **how long it may take to exit** once its requests were cut at the end of their grace
  (:attr:`Driver.stop_s`): SIGTERM, its connections closed, then this long before
  SIGKILL. The grace went to the requests; the server does not get a second one (a
  ``llama-server`` ignores SIGTERM while it generates or just after a cancelled
  request: it would hold the preemptor for the whole grace again).

============  ==============================  ==========================================
engine        the lease's flags               asleep: how, and what says so
============  ==============================  ==========================================
llama.cpp     ``--fit-target`` (free - lease  by itself after ``--sleep-idle-seconds N``
              on each GPU, where the free     (model and KV cache unloaded, process and
              memory is known)                port kept); ``GET /props`` ``is_sleeping``;
                                              the next request reloads it
vllm          ``--gpu-memory-utilization``    ``POST /sleep?level=1|2``, ``POST /wake_up``,
              lease / GPU total (it refuses   ``GET /is_sleeping`` (with
              to start unless that much is    ``--enable-sleep-mode`` and
              free)                           ``VLLM_SERVER_DEV_MODE=1``)
sglang        ``--mem-fraction-static``       ``POST /release_memory_occupation``, ``POST
              lease / GPU total               /resume_memory_occupation`` (with
                                              ``--enable-memory-saver``); it answers
                                              before the memory is free; nothing says
comfyui       (none)                          ``POST /free`` (unload_models, free_memory):
                                              freed after the answer, 1-2 GB stay; the
                                              next prompt loads again; nothing says
ollama        (none)                          never: each Ollama model is a model of the
                                              gateway with its own lease (``ollama.py``);
                                              unloaded (``keep_alive: 0``) = stopped
generic       (none)                          cannot sleep: idle means stopped
============  ==============================  ==========================================

Some memory always stays with a sleeping server (CUDA graphs, NCCL buffers: up to
~16 GB per GPU in some vLLM releases; 1-2 GB of ComfyUI's), and several engines free
memory after they answer: what is left is measured (:func:`settled_mb` over the probe's
figure), never assumed. A flag the command already sets is left as it is.

Drivers talk HTTP through :class:`EngineHttp`, one small interface over an
``httpx.AsyncClient`` (tests give it an ``httpx.MockTransport``).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import httpx

from ...core import InvalidInput
from ..base.clock import Clock
from .estimate import Engine, engine_of

__all__ = [
    "ENGINE_NAMES",
    "OFFLINE",
    "Answer",
    "ComfyUiDriver",
    "Driver",
    "EngineHttp",
    "LlamaCppDriver",
    "OllamaDriver",
    "SglangDriver",
    "SleepKind",
    "VllmDriver",
    "can_sleep",
    "detect_engine",
    "driver_for",
    "engine_named",
    "same_model",
    "settled_mb",
]

MIB = 1024 * 1024
HTTP_TIMEOUT_S = 30.0  # a sleep or a wake answers once it is done (vLLM's level 1: seconds)

# the config's names for the engines; llama-cpp-python (read by the estimate) is driven
# as a generic OpenAI-compatible server
ENGINE_NAMES: Mapping[str, Engine] = {
    "llama.cpp": Engine.LLAMA_CPP,
    "vllm": Engine.VLLM,
    "sglang": Engine.SGLANG,
    "comfyui": Engine.COMFYUI,
    "ollama": Engine.OLLAMA,
    "generic": Engine.GENERIC,
}


class SleepKind(StrEnum):
    """How an engine gives its memory back while its process stays."""

    NONE = "none"  # it cannot: idle long enough, it is stopped
    ITSELF = "itself"  # it sleeps by itself after a flag's idle time (llama.cpp)
    ASKED = "asked"  # it sleeps when asked, and wakes when asked or by the next request


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: Any  # the JSON body; None when it is not JSON

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def _ok(answer: Answer | None) -> bool:
    """The server answered, with a 2xx."""
    return answer is not None and answer.ok


class EngineHttp:
    """One request to a model server on loopback: its answer, or None when nothing
    answered (not started, gone, or slower than the timeout). No connection is kept, as
    for the health check (``links.py``): a server being stopped waits for its idle
    clients."""

    def __init__(self, client: httpx.AsyncClient | None = None) -> None:
        no_keep = httpx.Limits(max_keepalive_connections=0)
        self._client = client or httpx.AsyncClient(
            timeout=HTTP_TIMEOUT_S, trust_env=False, limits=no_keep
        )

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
        """``timeout_s``: this call's (None: the client's, ``HTTP_TIMEOUT_S``)."""
        url = f"http://127.0.0.1:{port}{path}"
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s)
        try:
            response = await self._client.request(
                method, url, json=json, params=params, timeout=timeout
            )
        except httpx.HTTPError:
            return None
        try:
            body = response.json()
        except ValueError:
            body = None
        return Answer(response.status_code, body)

    async def aclose(self) -> None:
        await self._client.aclose()


class _Offline(EngineHttp):
    """No server answers: for a gateway whose parts give no HTTP to the engines."""

    def __init__(self) -> None:
        pass

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
        return None

    async def aclose(self) -> None:
        pass


OFFLINE = _Offline()

# ---------------------------------------------------------------------- drivers


class Driver:
    """A generic HTTP server (and the base of the others): no flags of its own, ready at
    ``/health`` (else ``/v1/models``), busy while requests are in flight, never asleep.

    ``sleep_after_s``: the config's ``sleep_after`` (None: the model never sleeps);
    ``sleep_level``: vLLM's level."""

    engine = Engine.GENERIC
    sleeps = SleepKind.NONE
    ready_paths: tuple[str, ...] = ("/health", "/v1/models")
    polls_busy = False  # True: busy() says more than the requests in flight
    stop_s = 3.0
    """Seconds from SIGTERM to SIGKILL once the requests were cut (at most the grace)."""

    def __init__(
        self, http: EngineHttp, *, sleep_after_s: float | None = None, sleep_level: int = 1
    ) -> None:
        self.http = http
        self.sleep_after_s = sleep_after_s if self.sleeps is not SleepKind.NONE else None
        self.sleep_level = sleep_level

    @property
    def name(self) -> str:
        return next(name for name, kind in ENGINE_NAMES.items() if kind is self.engine)

    def prepare(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        lease_mb: int,
        gpu_total_mb: int,
        *,
        free_mb: Sequence[int] = (),
    ) -> tuple[tuple[str, ...], dict[str, str]]:
        """The command and environment that keep the server within ``lease_mb`` MiB per
        GPU: ``gpu_total_mb`` is the largest total of the lease's GPUs, ``free_mb`` each
        GPU's free memory as the probe saw it last (empty: not known)."""
        return tuple(command), dict(env)

    async def busy(self, port: int) -> bool | None:
        """Whether the server still works; None: the requests in flight say."""
        return None

    async def sleep(self, port: int) -> bool:
        """Asks the server to give its memory back (it keeps its process and port); True
        when it took the request. What it frees, and when, the probe says."""
        return False

    async def wake(self, port: int) -> bool:
        """Asks a sleeping server to load again; True once it says it did (or has nothing
        to do: the next request loads it)."""
        return True

    async def is_sleeping(self, port: int) -> bool | None:
        """What the server says; None: it cannot say, or did not answer."""
        return None

    async def used_mb(self, port: int) -> int | None:
        """The GPU memory the server itself reports for the model; None: the agent's
        probe is the measure (of the process group)."""
        return None


class LlamaCppDriver(Driver):
    """llama.cpp's ``llama-server``. With ``--fit`` (on by default) it shrinks what the
    command leaves unset (context, GPU layers) until ``--fit-target`` MiB stay free on
    each GPU, whatever its lease: the target is set to the GPU's free memory less the
    lease. It sleeps by itself after ``--sleep-idle-seconds`` (whole seconds, rounded
    up); a request wakes it."""

    engine = Engine.LLAMA_CPP
    sleeps = SleepKind.ITSELF
    ready_paths = ("/health",)
    stop_s = 1.0  # it frees its memory when killed; SIGTERM may go unheeded meanwhile

    def prepare(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        lease_mb: int,
        gpu_total_mb: int,
        *,
        free_mb: Sequence[int] = (),
    ) -> tuple[tuple[str, ...], dict[str, str]]:
        words = list(command)
        fit = _value(words, ("-fit", "--fit"))
        if free_mb and fit != "off" and not _has(words, ("-fitt", "--fit-target")):
            words += ["--fit-target", ",".join(str(max(0, free - lease_mb)) for free in free_mb)]
        if self.sleep_after_s is not None and not _has(words, ("--sleep-idle-seconds",)):
            words += ["--sleep-idle-seconds", str(max(1, math.ceil(self.sleep_after_s)))]
        return tuple(words), dict(env)

    async def sleep(self, port: int) -> bool:
        """Nothing to ask: it sleeps by itself. True when it is asleep now."""
        return await self.is_sleeping(port) is True

    async def wake(self, port: int) -> bool:
        """One token of an empty prompt: a request reloads it, and the one that follows
        no longer races its reload."""
        body = {"prompt": "", "n_predict": 1}
        answer = await self.http.call("POST", port, "/completion", json=body)
        return _ok(answer)

    async def is_sleeping(self, port: int) -> bool | None:
        answer = await self.http.call("GET", port, "/props")
        return _flag_in(answer, "is_sleeping")


class VllmDriver(Driver):
    """vLLM refuses to start unless ``--gpu-memory-utilization`` x total is free, and then
    takes that much: the fraction is the lease's share of the GPU (rounded down). Its
    sleep routes exist only with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``,
    both added when the model sleeps. Level 1 moves the weights to host memory (a wake
    takes well under a second instead of a reload); level 2 drops them."""

    engine = Engine.VLLM
    sleeps = SleepKind.ASKED
    ready_paths = ("/health",)
    stop_s = 5.0  # its engine core and workers are processes of their own to wind down
    _BUDGET = (
        "--gpu-memory-utilization",
        "--gpu_memory_utilization",
        "--kv-cache-memory-bytes",
        "--kv_cache_memory_bytes",
    )

    def prepare(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        lease_mb: int,
        gpu_total_mb: int,
        *,
        free_mb: Sequence[int] = (),
    ) -> tuple[tuple[str, ...], dict[str, str]]:
        words, environment = list(command), dict(env)
        if not _has(words, self._BUDGET):
            words += ["--gpu-memory-utilization", _share(lease_mb, gpu_total_mb)]
        if self.sleep_after_s is not None:
            if not _has(words, ("--enable-sleep-mode",)):
                words.append("--enable-sleep-mode")
            environment["VLLM_SERVER_DEV_MODE"] = "1"
        return tuple(words), environment

    async def sleep(self, port: int) -> bool:
        params = {"level": str(self.sleep_level)}
        answer = await self.http.call("POST", port, "/sleep", params=params)
        return _ok(answer)

    async def wake(self, port: int) -> bool:
        answer = await self.http.call("POST", port, "/wake_up")
        return _ok(answer)

    async def is_sleeping(self, port: int) -> bool | None:
        return _flag_in(await self.http.call("GET", port, "/is_sleeping"), "is_sleeping")


class SglangDriver(Driver):
    """SGLang takes ``--mem-fraction-static`` of each GPU for its weights and KV cache
    pool: the lease's share. With ``--enable-memory-saver`` (added when the model
    sleeps) it releases and resumes that memory on request; the release answers before
    the memory is free, and nothing reports the state."""

    engine = Engine.SGLANG
    sleeps = SleepKind.ASKED
    ready_paths = ("/health",)
    stop_s = 5.0  # its scheduler and detokenizer are processes of their own

    def prepare(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        lease_mb: int,
        gpu_total_mb: int,
        *,
        free_mb: Sequence[int] = (),
    ) -> tuple[tuple[str, ...], dict[str, str]]:
        words = list(command)
        if not _has(words, ("--mem-fraction-static",)):
            words += ["--mem-fraction-static", _share(lease_mb, gpu_total_mb)]
        if self.sleep_after_s is not None and not _has(words, ("--enable-memory-saver",)):
            words.append("--enable-memory-saver")
        return tuple(words), dict(env)

    async def sleep(self, port: int) -> bool:
        answer = await self.http.call("POST", port, "/release_memory_occupation", json={})
        return _ok(answer)

    async def wake(self, port: int) -> bool:
        answer = await self.http.call("POST", port, "/resume_memory_occupation", json={})
        return _ok(answer)


class ComfyUiDriver(Driver):
    """ComfyUI queues work (``POST /prompt``) and runs it after its answer: it is busy
    while its queue (``GET /queue``: running or pending) is not empty. ``POST /free``
    unloads its models after the answer (1-2 GB stay); the next prompt loads them."""

    engine = Engine.COMFYUI
    sleeps = SleepKind.ASKED
    ready_paths = ("/system_stats",)
    polls_busy = True

    async def busy(self, port: int) -> bool | None:
        answer = await self.http.call("GET", port, "/queue")
        if answer is None or not answer.ok or not isinstance(answer.body, dict):
            return None
        return bool(answer.body.get("queue_running") or answer.body.get("queue_pending"))

    async def sleep(self, port: int) -> bool:
        body = {"unload_models": True, "free_memory": True}
        answer = await self.http.call("POST", port, "/free", json=body)
        return _ok(answer)

    async def free_mb(self, port: int) -> dict[int, int] | None:
        """Free memory per device index, as ``GET /system_stats`` reports it."""
        answer = await self.http.call("GET", port, "/system_stats")
        if answer is None or not answer.ok or not isinstance(answer.body, dict):
            return None
        found: dict[int, int] = {}
        for device in answer.body.get("devices") or []:
            index, free = device.get("index"), device.get("vram_free")
            if isinstance(index, int) and isinstance(free, int | float):
                found[index] = int(free) // MIB
        return found


class OllamaDriver(Driver):
    """One ``ollama serve`` holds many models: ``GET /api/ps`` lists those loaded with
    their memory on the GPUs (``size_vram``); ``POST /api/generate`` without a prompt
    loads one, with ``keep_alive: 0`` unloads it. It does not sleep: a model unloaded is
    a model stopped, and its load is quick (``ollama.py`` runs each Ollama model as a
    model of the gateway, all sharing one serve). ``model``: the Ollama model this driver
    speaks for (its :meth:`used_mb`)."""

    engine = Engine.OLLAMA
    ready_paths = ("/api/version",)

    def __init__(
        self,
        http: EngineHttp,
        *,
        sleep_after_s: float | None = None,
        sleep_level: int = 1,
        model: str | None = None,
    ) -> None:
        super().__init__(http, sleep_after_s=sleep_after_s, sleep_level=sleep_level)
        self.model = model

    async def loaded(self, port: int) -> dict[str, int] | None:
        """Each loaded model's GPU memory in MiB (rounded up); None: no answer."""
        answer = await self.http.call("GET", port, "/api/ps")
        if answer is None or not answer.ok or not isinstance(answer.body, dict):
            return None
        found: dict[str, int] = {}
        for model in answer.body.get("models") or []:
            name, size = model.get("name") or model.get("model"), model.get("size_vram", 0)
            if isinstance(name, str) and isinstance(size, int):
                found[name] = -(-size // MIB)
        return found

    async def load(self, port: int, model: str, timeout_s: float) -> Answer | None:
        """Loads ``model`` and keeps it loaded until it is unloaded (``keep_alive: -1``):
        Ollama answers once it has loaded (an error body when it cannot)."""
        body = {"model": model, "keep_alive": -1, "stream": False}
        return await self.http.call("POST", port, "/api/generate", json=body, timeout_s=timeout_s)

    async def unload(self, port: int, model: str) -> bool:
        body = {"model": model, "keep_alive": 0}
        answer = await self.http.call("POST", port, "/api/generate", json=body)
        return _ok(answer)

    async def used_mb(self, port: int) -> int | None:
        """The GPU memory of :attr:`model` as ``/api/ps`` says (0: not loaded)."""
        models = await self.loaded(port)
        if models is None or self.model is None:
            return None
        return next((mb for name, mb in models.items() if same_model(name, self.model)), 0)


def same_model(listed: str, model: str) -> bool:
    """Whether Ollama's ``listed`` name is ``model``: a name without a tag is ``:latest``."""
    return listed == model or (":" not in model and listed == f"{model}:latest")


_DRIVERS: Mapping[Engine, type[Driver]] = {
    Engine.LLAMA_CPP: LlamaCppDriver,
    Engine.LLAMA_CPP_PYTHON: Driver,
    Engine.VLLM: VllmDriver,
    Engine.SGLANG: SglangDriver,
    Engine.COMFYUI: ComfyUiDriver,
    Engine.OLLAMA: OllamaDriver,
    Engine.GENERIC: Driver,
}


# ---------------------------------------------------------------------- the registry


def engine_named(name: Any, where: str = "engine") -> Engine:
    """The engine the config calls ``name``; :class:`InvalidInput` naming ``where``."""
    if not isinstance(name, str) or name not in ENGINE_NAMES:
        known = ", ".join(ENGINE_NAMES)
        raise InvalidInput(where, f"{name!r} is not an engine; known: {known}")
    return ENGINE_NAMES[name]


def detect_engine(command: Sequence[str]) -> str:
    """The config name of the engine ``command`` starts (``generic`` when unknown)."""
    engine = _DRIVERS[engine_of(tuple(command))].engine
    return next(name for name, kind in ENGINE_NAMES.items() if kind is engine)


def can_sleep(name: str) -> bool:
    return _DRIVERS[engine_named(name)].sleeps is not SleepKind.NONE


def driver_for(
    name: str, http: EngineHttp, *, sleep_after_s: float | None = None, sleep_level: int = 1
) -> Driver:
    """The driver of engine ``name`` (a config name) talking through ``http``."""
    driver = _DRIVERS[engine_named(name)]
    return driver(http, sleep_after_s=sleep_after_s, sleep_level=sleep_level)


# ---------------------------------------------------------------------- measuring


async def settled_mb(
    read: Callable[[], Awaitable[int | None]],
    clock: Clock,
    *,
    falls_from: int | None = None,
    poll_s: float = 0.5,
    steady_s: float = 2.0,
    timeout_s: float = 60.0,
    tolerance_mb: int = 16,
) -> int | None:
    """The memory a server keeps once it stopped giving memory back: ``read`` (the
    probe's figure for its process group) polled until it has not fallen by more than
    ``tolerance_mb`` for ``steady_s`` (and, given ``falls_from``, the figure before the
    server was asked, only once it fell below that), or ``timeout_s`` passed; the lowest
    figure read (None: none was). Engines free memory after they answer, and what stays
    (CUDA graphs, NCCL, a runtime's own) differs by release: it is measured, not assumed."""
    deadline = clock.now() + timeout_s
    low = await read()
    since = clock.now()

    def waiting() -> bool:
        if falls_from is not None and (low is None or low >= falls_from - tolerance_mb):
            return True
        return clock.now() - since < steady_s

    while waiting() and clock.now() < deadline:
        await clock.sleep(poll_s)
        figure = await read()
        if figure is None:
            continue
        if low is None or figure < low - tolerance_mb:
            since = clock.now()
        low = figure if low is None else min(low, figure)
    return low


# ---------------------------------------------------------------------- flags


def _has(words: Sequence[str], flags: Sequence[str]) -> bool:
    return any(w == f or w.startswith(f + "=") for w in words for f in flags)


def _value(words: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value of the last of ``flags`` (``-f V`` or ``--flag=V``)."""
    found = None
    for i, word in enumerate(words):
        for flag in flags:
            if word == flag and i + 1 < len(words):
                found = words[i + 1]
            elif word.startswith(flag + "="):
                found = word.split("=", 1)[1]
    return found


def _share(lease_mb: int, gpu_total_mb: int) -> str:
    """The lease's share of a GPU, rounded down to a thousandth (at least one)."""
    if gpu_total_mb <= 0:
        raise ValueError(f"a GPU's total memory must be more than 0, not {gpu_total_mb}")
    thousandths = max(1, min(1000, lease_mb * 1000 // gpu_total_mb))
    return f"{thousandths / 1000:.3f}"


def _flag_in(answer: Answer | None, key: str) -> bool | None:
    if answer is None or not answer.ok or not isinstance(answer.body, dict):
        return None
    value = answer.body.get(key)
    return value if isinstance(value, bool) else None
