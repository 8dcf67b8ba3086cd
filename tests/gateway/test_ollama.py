"""Ollama's models on one shared serve (``gateway/ollama.py``), on the virtual clock: the
serve's start and stop, each model's load, unload and wait, its lease and its measure."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Mapping
from typing import Any

import pytest

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.gateway.base.metrics import GatewayMetrics
from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.servers.engines import Answer, EngineHttp
from gpu_arbiter.gateway.servers.interfaces import Parts
from gpu_arbiter.gateway.servers.model import ModelServer
from gpu_arbiter.gateway.servers.ollama import OllamaModelServer, OllamaProcess, model_servers

from .fakes import FakeAgent, FakeClock, FakeHealth, FakeLauncher, FakeLeases, settle

MIB = 1024 * 1024
SIZES = {"a": 2000, "b:7b": 3000}  # what Ollama loads each into (size_vram, MiB)


class FakeOllama(EngineHttp):
    """Ollama's routes while its serve (the launcher's last process) runs: ``stuck``
    models answer an unload but stay loaded; ``refuses`` cannot be loaded; the load of
    a model in ``slow`` answers once its event is set."""

    def __init__(self, launcher: FakeLauncher) -> None:
        self.launcher = launcher
        self.loaded: dict[str, int] = {}
        self.stuck: set[str] = set()
        self.refuses: set[str] = set()
        self.slow: dict[str, asyncio.Event] = {}
        self.sent: list[tuple[str, Any]] = []

    @property
    def up(self) -> bool:
        return bool(self.launcher.processes) and self.launcher.processes[-1].code is None

    async def call(
        self, method: str, port: int, path: str, *, json: Any = None,
        params: Mapping[str, str] | None = None, timeout_s: float | None = None,
    ) -> Answer | None:  # fmt: skip
        if not self.up:
            self.loaded.clear()
            return None
        if path == "/api/version":
            return Answer(200, {"version": "0.6.0"})
        if path == "/api/ps":
            models = [{"name": n, "size_vram": mb * MIB} for n, mb in self.loaded.items()]
            return Answer(200, {"models": models})
        assert path == "/api/generate" and "prompt" not in json
        self.sent.append((json["model"], json["keep_alive"]))
        if json["keep_alive"] == 0:
            if json["model"] not in self.stuck:
                self.loaded.pop(json["model"], None)
            return Answer(200, {"done_reason": "unload"})
        if json["model"] in self.slow:
            await self.slow[json["model"]].wait()
        if json["model"] in self.refuses:
            return Answer(500, {"error": "model requires more system memory"})
        self.loaded[json["model"]] = SIZES[json["model"]]
        return Answer(200, {"done_reason": "load"})


class Serve:
    """Two Ollama models of one ``[models.local]`` entry over the fakes."""

    def __init__(self, **keys: Any) -> None:
        self.clock = FakeClock()
        self.leases = FakeLeases()
        self.launcher = FakeLauncher()
        self.agent = FakeAgent(self.launcher)
        self.ollama = FakeOllama(self.launcher)
        parts = Parts(
            self.clock, self.launcher, self.agent, self.leases, FakeHealth(self.launcher),
            self.ollama,
        )  # fmt: skip
        spec = {
            "command": ["ollama", "serve", "{port}"], "engine": "ollama", "keep_alive": "60s",
            "idle_after": "1s", "grace": "2s", "ollama_models": {"a": "3G", "b:7b": "4G"},
            **keys,
        }  # fmt: skip
        config = parse_config({"models": {"local": spec}})
        self.tasks: set[asyncio.Task[None]] = set()
        self.models = model_servers(
            config.models, parts=parts, metrics=GatewayMetrics(), worker="box",
            sizes={"a": 3072, "b:7b": 4096},
        )  # fmt: skip
        serves = {m.serve for m in self.models.values() if isinstance(m, OllamaModelServer)}
        for life in [*(s.run() for s in serves), *(m.run() for m in self.models.values())]:
            task = asyncio.ensure_future(life)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def request(self, name: str) -> None:
        replica, _ = await self.models[name].acquire()
        replica.leave()

    def process(self, name: str) -> OllamaProcess:
        [replica] = self.models[name].replicas
        assert isinstance(replica.process, OllamaProcess)
        return replica.process

    async def close(self) -> None:
        for model in self.models.values():
            model.shutdown()
        for _ in range(100):
            if not self.tasks:
                return
            await self.clock.advance(1)
        raise AssertionError(f"still running: {self.tasks}")


@pytest.fixture
async def serve() -> Any:
    made = Serve()
    yield made
    await made.close()


def test_each_ollama_model_is_a_model_of_the_gateway_sized_as_listed() -> None:
    models = parse_config(
        {"models": {"local": {"command": "ollama serve {port}", "priority": "interactive",
                              "ollama_models": {"llama3.2:3b": "3G", "qwen3": 6144}}}}
    ).models  # fmt: skip
    assert sorted(models) == ["llama3.2:3b", "qwen3"]
    assert models["llama3.2:3b"].vram == 3072 and models["qwen3"].vram == 6144
    assert {m.ollama_serve for m in models.values()} == {"local"}
    assert {m.priority for m in models.values()} == {800}  # the entry's keys, for each


@pytest.mark.parametrize(
    ("spec", "field", "reason"),
    [
        ({"ollama_models": {"m": "3X"}}, 'models.local.ollama_models."m"', "not a size"),
        ({"ollama_models": {"m": "auto"}}, 'models.local.ollama_models."m"', "a size such"),
        ({"ollama_models": {"hf.co/x": "3G"}}, 'models.local.ollama_models."hf.co/x"', "named"),
        ({}, "models.local.ollama_models", "missing"),
        ({"ollama_models": {}}, "models.local.ollama_models", "missing"),
        ({"ollama_models": {"m": "3G"}, "vram": "3G"}, "models.local.vram", "ollama_models"),
        ({"ollama_models": {"m": "3G"}, "replicas": 2}, "models.local.replicas", "one copy"),
        ({"ollama_models": {"m": "3G"}, "sleep_after": "1m"}, "models.local.sleep_after",
         "cannot sleep"),
        ({"ollama_models": {"m": "3G"}, "engine": "vllm"}, "models.local.ollama_models",
         "not vllm"),
        ({"ollama_models": {"other": "3G"}}, 'models.local.ollama_models."other"', "already"),
    ],
)  # fmt: skip
def test_a_bad_ollama_entry_is_named_and_refused(spec: Any, field: str, reason: str) -> None:
    models = {
        "other": {"command": "srv {port}", "vram": "1G"},
        "local": {"command": "ollama serve {port}", **spec},
    }
    with pytest.raises(InvalidInput) as refused:
        parse_config({"models": models})
    assert refused.value.field == field
    assert reason in refused.value.reason


async def test_two_models_load_on_one_serve_each_under_its_own_shrunk_lease(serve: Serve) -> None:
    assert all(isinstance(m, OllamaModelServer) for m in serve.models.values())
    await serve.request("a")
    await serve.request("b:7b")
    [process] = serve.launcher.processes  # one serve for both
    env: dict[str, str] = process.env  # type: ignore[attr-defined]
    assert env["OLLAMA_KEEP_ALIVE"] == "-1" and int(env["OLLAMA_MAX_LOADED_MODELS"]) >= 2
    assert env["OLLAMA_HOST"] == f"127.0.0.1:{serve.process('a').serve.port}"
    assert "GPU_ARBITER_LEASE" not in env and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert serve.ollama.sent == [("a", -1), ("b:7b", -1)]
    assert serve.process("a").pid is None
    leases = {r["metadata"]["model"]: lid for lid, r in serve.leases.requests.items()}
    assert serve.leases.leases[leases["a"]]["vram_mb"] == 2000  # shrunk to size_vram
    assert serve.leases.leases[leases["b:7b"]]["vram_mb"] == 3000
    assert serve.models["a"].vram_mb == 2000  # asked for at the next load
    assert await serve.models["a"].replicas[0].used_mb() == 2000  # Ollama's figure
    # the second lease was asked for on the GPUs the serve runs on
    assert serve.leases.requests[leases["b:7b"]]["constraints"]["gpu_ids"] == ["box:0"]


async def test_keep_alive_unloads_one_and_the_serve_stops_with_the_last(serve: Serve) -> None:
    await serve.request("a")
    await serve.clock.advance(30)
    await serve.request("b:7b")
    [process] = serve.launcher.processes
    await serve.clock.advance(31)  # a's keep_alive
    assert not serve.models["a"].replicas and ("a", 0) in serve.ollama.sent
    assert list(serve.ollama.loaded) == ["b:7b"] and process.code is None  # b still on it
    assert serve.models["a"].state() == "cold"
    await serve.clock.advance(30)  # b's
    assert not serve.models["b:7b"].replicas and process.signals == [signal.SIGTERM]
    assert [v for v, _ in serve.leases.calls].count("release") == 2


async def test_a_model_that_does_not_unload_is_killed_with_its_serve(serve: Serve) -> None:
    await serve.request("a")
    await serve.request("b:7b")
    serve.ollama.stuck.add("a")
    loaded = serve.process("a")
    serve.models["a"].replicas[0].unload()
    await serve.clock.advance(1)
    assert ("a", 0) in serve.ollama.sent and serve.models["a"].replicas  # grace: 2s
    await serve.clock.advance(10)  # SIGKILL after the grace: the serve stopped
    [process] = serve.launcher.processes
    assert signal.SIGKILL in process.signals and await loaded.wait() == -9
    assert not serve.models["a"].replicas and not serve.models["b:7b"].replicas
    assert serve.models["b:7b"].failure is not None  # its server exited


async def test_a_model_ollama_drops_ends_without_a_failure(serve: Serve) -> None:
    await serve.request("a")
    await serve.request("b:7b")
    del serve.ollama.loaded["a"]  # Ollama's own scheduler unloaded it
    await serve.clock.advance(1)
    model = serve.models["a"]
    assert not model.replicas and model.failures == 0 and model.state() == "cold"
    stops = model.metrics.stops.labels("a", "dropped")._value.get()
    assert stops == 1
    await serve.request("a")  # loaded again at once, on the same serve
    assert len(serve.launcher.processes) == 1 and "a" in serve.ollama.loaded


async def test_a_load_ollama_refuses_fails_and_lets_the_serve_go(serve: Serve) -> None:
    serve.ollama.refuses.add("a")
    task = asyncio.ensure_future(serve.request("a"))
    await serve.clock.advance(5)
    assert task.done()
    with pytest.raises(Exception, match="model requires more system memory"):
        task.result()
    [process] = serve.launcher.processes
    assert process.code is not None  # nothing else loaded: the serve stopped
    await settle()


async def test_a_plain_model_beside_them_is_a_plain_model_server() -> None:
    config = parse_config({"models": {"chat": {"command": "srv {port}", "vram": "1G"}}})
    clock, launcher = FakeClock(), FakeLauncher()
    parts = Parts(clock, launcher, FakeAgent(launcher), FakeLeases(), FakeHealth(launcher))
    found = model_servers(
        config.models, parts=parts, metrics=GatewayMetrics(), worker=None,
        sizes={"chat": 1024},
    )  # fmt: skip
    assert type(found["chat"]) is ModelServer


async def test_the_serve_accounts_for_its_group_with_each_models_figure(serve: Serve) -> None:
    """The serve's group is no lease's in the agent: the serve says whose its memory is
    (each loaded model's lease, by its size_vram), every 5 s and at once on a load or an
    unload, and ``{}`` once it stops."""
    await serve.request("a")
    await serve.request("b:7b")
    await settle()
    [process] = serve.launcher.processes
    leases = {r["metadata"]["model"]: lid for lid, r in serve.leases.requests.items()}
    both = {leases["a"]: SIZES["a"], leases["b:7b"]: SIZES["b:7b"]}
    assert serve.agent.accounts[-1] == ("box", process.pid, both)
    said = len(serve.agent.accounts)
    await serve.clock.advance(5)
    assert len(serve.agent.accounts) > said and serve.agent.accounts[-1][2] == both  # again
    serve.models["a"].replicas[0].unload()
    await serve.clock.advance(1)  # its unload seen (the watcher polls /api/ps)
    assert not serve.models["a"].replicas
    assert serve.agent.accounts[-1] == ("box", process.pid, {leases["b:7b"]: SIZES["b:7b"]})
    serve.models["b:7b"].replicas[0].unload()
    await serve.clock.advance(1)
    assert process.code is not None  # the last one unloaded: the serve stopped
    assert serve.agent.accounts[-1] == ("box", process.pid, {})
    said = len(serve.agent.accounts)
    await serve.clock.advance(30)
    assert len(serve.agent.accounts) == said  # nothing more once it is gone


async def test_a_loading_model_counts_at_its_leases_size_until_ollama_lists_it(
    serve: Serve,
) -> None:
    await serve.request("a")
    loaded = serve.ollama.slow["b:7b"] = asyncio.Event()
    task = asyncio.ensure_future(serve.request("b:7b"))
    await serve.clock.advance(1)
    leases = {r["metadata"]["model"]: lid for lid, r in serve.leases.requests.items()}
    loading = {leases["a"]: SIZES["a"], leases["b:7b"]: 4096}  # its lease's MiB
    assert serve.agent.accounts[-1][2] == loading
    loaded.set()
    await task
    await settle()
    assert serve.agent.accounts[-1][2] == {leases["a"]: SIZES["a"], leases["b:7b"]: SIZES["b:7b"]}


async def test_the_serves_life_ends_with_its_last_model_and_owns_its_tasks(serve: Serve) -> None:
    await serve.request("a")
    await serve.request("b:7b")
    [process] = serve.launcher.processes
    lives = set(serve.tasks)
    assert len(lives) == 3  # the serve's and each model's
    serve.models["a"].shutdown()
    await serve.clock.advance(5)
    assert process.code is None and len(serve.tasks) == 2  # b still loaded on it
    serve.models["b:7b"].shutdown()
    await serve.clock.advance(5)
    assert not serve.tasks and process.code is not None  # stopped, its life over
    assert [v for v, _ in serve.leases.calls].count("release") == 2


async def test_a_cancelled_serves_life_kills_its_group() -> None:
    made = Serve()
    await made.request("a")
    [process] = made.launcher.processes
    for task in made.tasks:
        task.cancel()
    for _ in range(20):
        await made.clock.advance(1)
    assert not made.tasks and process.code is not None  # nothing outlives its supervisor
