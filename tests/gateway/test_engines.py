"""The engines' drivers: the flags a lease allows, and each engine's routes for sleeping,
waking, saying so and being busy (httpx.MockTransport stands for the server); the
config's engine keys; the measure of what a server keeps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.servers.engines import (
    Answer,
    ComfyUiDriver,
    EngineHttp,
    LlamaCppDriver,
    OllamaDriver,
    SleepKind,
    can_sleep,
    detect_engine,
    driver_for,
    same_model,
    settled_mb,
)

Handler = Callable[[httpx.Request], httpx.Response]
PORT = 8123


class Recorded:
    """The requests a driver sent, answered by ``routes`` ("METHOD /path" -> answer)."""

    def __init__(self, routes: dict[str, httpx.Response]) -> None:
        self.routes = routes
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        found = self.routes.get(f"{request.method} {request.url.path}")
        return found if found is not None else httpx.Response(404)

    def http(self) -> EngineHttp:
        return EngineHttp(httpx.AsyncClient(transport=httpx.MockTransport(self)))

    def sent(self) -> list[str]:
        return [f"{r.method} {r.url.path}" for r in self.seen]


def ok(body: Any = None) -> httpx.Response:
    return httpx.Response(200, json=body) if body is not None else httpx.Response(200)


def offline(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


class SteppingClock:
    """Time that moves on by exactly what each sleep asks, at once."""

    def __init__(self) -> None:
        self.time = 0.0

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        self.time += seconds


def model(name: str, **keys: Any) -> Any:
    return parse_config({"models": {name: keys}}).models[name]


# ---------------------------------------------------------------------- prepare


def test_llama_cpp_fits_within_the_lease_and_sleeps_by_itself() -> None:
    driver = driver_for("llama.cpp", EngineHttp(), sleep_after_s=1.5)
    command, env = driver.prepare(
        ("llama-server", "-m", "m.gguf", "--port", "1"), {"A": "1"}, 6000, 24576,
        free_mb=(20000, 9000),
    )  # fmt: skip
    assert command[-4:] == ("--fit-target", "14000,3000", "--sleep-idle-seconds", "2")
    assert env == {"A": "1"}
    assert isinstance(driver, LlamaCppDriver) and driver.sleeps is SleepKind.ITSELF


def test_llama_cpp_keeps_what_the_command_says() -> None:
    driver = driver_for("llama.cpp", EngineHttp(), sleep_after_s=60)
    said = ("llama-server", "--fit-target=512", "--sleep-idle-seconds", "9")
    assert driver.prepare(said, {}, 6000, 24576, free_mb=(20000,))[0] == said
    fit_off = ("llama-server", "-fit", "off")
    assert driver_for("llama.cpp", EngineHttp()).prepare(fit_off, {}, 1, 2, free_mb=(9,))[0] == (
        fit_off
    )
    unknown_free = driver_for("llama.cpp", EngineHttp()).prepare(("llama-server",), {}, 1, 2)
    assert unknown_free[0] == ("llama-server",)


def test_vllm_takes_the_leases_share_and_its_sleep_routes_when_it_sleeps() -> None:
    asleep = driver_for("vllm", EngineHttp(), sleep_after_s=60, sleep_level=2)
    command, env = asleep.prepare(("vllm", "serve", "m"), {}, 6000, 24000)
    assert command[3:] == ("--gpu-memory-utilization", "0.250", "--enable-sleep-mode")
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}
    awake = driver_for("vllm", EngineHttp())
    command, env = awake.prepare(("vllm", "serve", "m"), {}, 24001, 24000)
    assert command[3:] == ("--gpu-memory-utilization", "1.000") and env == {}
    budget = ("vllm", "serve", "m", "--kv-cache-memory-bytes=4G")
    assert awake.prepare(budget, {}, 6000, 24000)[0] == budget
    assert awake.prepare(("vllm",), {}, 6000, 24000)[0][-1] == "0.250"  # rounded down
    assert awake.prepare(("vllm",), {}, 7, 24000)[0][-1] == "0.001"


def test_sglang_takes_the_leases_share_and_the_memory_saver_when_it_sleeps() -> None:
    driver = driver_for("sglang", EngineHttp(), sleep_after_s=30)
    command, _ = driver.prepare(("python", "-m", "sglang.launch_server"), {}, 12000, 80000)
    assert command[3:] == ("--mem-fraction-static", "0.150", "--enable-memory-saver")


def test_engines_without_lease_flags_start_as_written() -> None:
    for name in ("generic", "comfyui", "ollama"):
        driver = driver_for(name, EngineHttp())
        assert driver.prepare(("serve", "{port}"), {"X": "y"}, 1000, 2000) == (
            ("serve", "{port}"), {"X": "y"},
        )  # fmt: skip


def test_a_gpu_without_memory_is_a_bug_not_a_share() -> None:
    with pytest.raises(ValueError, match="more than 0"):
        driver_for("vllm", EngineHttp()).prepare(("vllm",), {}, 1000, 0)


# ---------------------------------------------------------------------- routes


async def test_vllm_sleeps_wakes_and_says_so_on_its_routes() -> None:
    server = Recorded(
        {"POST /sleep": ok(), "POST /wake_up": ok(), "GET /is_sleeping": ok({"is_sleeping": True})}
    )
    driver = driver_for("vllm", server.http(), sleep_after_s=60, sleep_level=2)
    assert await driver.sleep(PORT) and await driver.wake(PORT)
    assert await driver.is_sleeping(PORT) is True
    assert server.sent() == ["POST /sleep", "POST /wake_up", "GET /is_sleeping"]
    assert server.seen[0].url.params["level"] == "2"
    assert server.seen[0].url.port == PORT and server.seen[0].url.host == "127.0.0.1"


async def test_vllm_without_dev_mode_cannot_say() -> None:
    driver = driver_for("vllm", Recorded({}).http())  # its sleep routes are not mounted
    assert await driver.is_sleeping(PORT) is None
    assert not await driver.sleep(PORT)


async def test_sglang_releases_and_resumes_its_memory() -> None:
    server = Recorded(
        {"POST /release_memory_occupation": ok(), "POST /resume_memory_occupation": ok()}
    )
    driver = driver_for("sglang", server.http(), sleep_after_s=60)
    assert await driver.sleep(PORT) and await driver.wake(PORT)
    assert server.sent() == ["POST /release_memory_occupation", "POST /resume_memory_occupation"]
    assert [r.content for r in server.seen] == [b"{}", b"{}"]
    assert await driver.is_sleeping(PORT) is None  # nothing reports it


async def test_llama_cpp_says_on_props_and_a_request_wakes_it() -> None:
    props = {"GET /props": ok({"is_sleeping": True}), "POST /completion": ok({"content": ""})}
    server = Recorded(props)
    driver = driver_for("llama.cpp", server.http(), sleep_after_s=1)
    assert await driver.is_sleeping(PORT) is True and await driver.sleep(PORT)
    assert await driver.wake(PORT)
    assert server.sent() == ["GET /props", "GET /props", "POST /completion"]
    older = driver_for("llama.cpp", Recorded({"GET /props": ok({"total_slots": 4})}).http())
    assert await older.is_sleeping(PORT) is None  # a build without sleep: cannot say


async def test_comfyui_is_busy_while_its_queue_holds_work_and_frees_on_request() -> None:
    queue = {"queue_running": [[0, "p1", {}, {}, []]], "queue_pending": []}
    stats = {"devices": [{"index": 0, "vram_free": 3 * 1024**3, "vram_total": 8 * 1024**3}]}
    server = Recorded({"GET /queue": ok(queue), "POST /free": ok(), "GET /system_stats": ok(stats)})
    driver = driver_for("comfyui", server.http(), sleep_after_s=60)
    assert isinstance(driver, ComfyUiDriver) and driver.polls_busy
    assert await driver.busy(PORT) is True
    queue["queue_running"] = []
    server.routes["GET /queue"] = ok(queue)
    assert await driver.busy(PORT) is False
    assert await driver.sleep(PORT)
    assert server.seen[-1].read() == b'{"unload_models":true,"free_memory":true}'
    assert await driver.free_mb(PORT) == {0: 3072}
    assert driver.ready_paths == ("/system_stats",)


async def test_ollama_sizes_each_loaded_model_loads_and_unloads_one_and_never_sleeps() -> None:
    ps = {"models": [{"name": "qwen3:8b", "size_vram": 5 * 1024**3 + 1}, {"model": "tiny:latest"}]}
    server = Recorded({"GET /api/ps": ok(ps), "POST /api/generate": ok({"done_reason": "unload"})})
    driver = OllamaDriver(server.http(), sleep_after_s=60, model="tiny")
    assert driver.sleeps is SleepKind.NONE and driver.sleep_after_s is None
    assert not can_sleep("ollama")
    assert await driver.loaded(PORT) == {"qwen3:8b": 5121, "tiny:latest": 0}
    assert await driver.used_mb(PORT) == 0  # "tiny" is "tiny:latest"
    assert (await driver.load(PORT, "qwen3:8b", 300)) == Answer(200, {"done_reason": "unload"})
    assert await driver.unload(PORT, "qwen3:8b")
    bodies = [r.read() for r in server.seen if r.method == "POST"]
    assert bodies == [
        b'{"model":"qwen3:8b","keep_alive":-1,"stream":false}',
        b'{"model":"qwen3:8b","keep_alive":0}',
    ]
    assert await OllamaDriver(server.http(), model="qwen3:8b").used_mb(PORT) == 5121
    assert not same_model("tiny:1b", "tiny") and same_model("tiny:1b", "tiny:1b")


async def test_a_server_that_does_not_answer_is_unknown_not_asleep() -> None:
    http = EngineHttp(httpx.AsyncClient(transport=httpx.MockTransport(offline)))
    for name in ("llama.cpp", "vllm", "comfyui", "ollama"):
        driver = driver_for(name, http, sleep_after_s=60)
        assert await driver.is_sleeping(PORT) is None
        assert await driver.busy(PORT) is None
        assert not await driver.sleep(PORT)


async def test_a_generic_server_never_sleeps() -> None:
    driver = driver_for("generic", Recorded({}).http(), sleep_after_s=60)
    assert driver.sleeps is SleepKind.NONE and driver.sleep_after_s is None
    assert not await driver.sleep(PORT) and await driver.wake(PORT)
    assert driver.ready_paths == ("/health", "/v1/models")


# ---------------------------------------------------------------------- the registry


def test_the_engine_is_read_from_the_command() -> None:
    assert detect_engine(("llama-server", "-m", "x.gguf")) == "llama.cpp"
    assert detect_engine(("vllm", "serve", "m")) == "vllm"
    assert detect_engine(("python3", "-m", "sglang.launch_server")) == "sglang"
    assert detect_engine(("env", "OLLAMA_HOST=127.0.0.1:{port}", "ollama", "serve")) == "ollama"
    assert detect_engine(("python", "-m", "llama_cpp.server")) == "generic"
    assert detect_engine(("python", "main.py", "--port", "{port}")) == "generic"


def test_the_config_names_the_engine_or_reads_it_from_the_command() -> None:
    assert model("a", command="vllm serve m --port {port}").engine == "vllm"
    comfy = model("c", command="python main.py --port {port}", engine="comfyui", sleep_after="1m")
    assert (comfy.engine, comfy.sleep_after_s, comfy.sleep_level) == ("comfyui", 60.0, 1)
    served = model("v", command="vllm serve m --port {port}", sleep_after="2m", sleep_level=2)
    assert (served.sleep_after_s, served.sleep_level) == (120.0, 2)
    assert model("g", command="server {port}").sleep_after_s is None


@pytest.mark.parametrize(
    ("keys", "field", "reason"),
    [
        ({"engine": "tgi"}, "models.m.engine", "'tgi' is not an engine; known: llama.cpp"),
        ({"engine": 3}, "models.m.engine", "3 is not an engine"),
        ({"sleep_after": "1m"}, "models.m.sleep_after", "engine generic cannot sleep"),
        ({"engine": "vllm", "sleep_after": "0s"}, "models.m.sleep_after", "more than 0"),
        (
            {"engine": "vllm", "sleep_after": "10m", "keep_alive": "5m"},
            "models.m.sleep_after",
            "shorter than keep_alive (300s)",
        ),
        (
            {"engine": "sglang", "sleep_after": "1m", "sleep_level": 2},
            "models.m.sleep_level",
            "only vllm has sleep levels, not sglang",
        ),
        ({"engine": "vllm", "sleep_level": 1}, "models.m.sleep_level", "without sleep_after"),
        (
            {"engine": "vllm", "sleep_after": "1m", "sleep_level": 3},
            "models.m.sleep_level",
            "3 is not an integer 1..2",
        ),
    ],
)
def test_bad_engine_keys_name_the_key_and_the_reason(
    keys: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        model("m", command="server --port {port}", **keys)
    assert caught.value.field == field
    assert reason in caught.value.reason


# ---------------------------------------------------------------------- measuring


async def test_what_a_server_keeps_is_measured_once_it_stops_falling() -> None:
    clock = SteppingClock()
    figures = iter([9000, 9000, 6000, 2000, 1500, 1500, 1500, 1500, 1500, 1500, 1500])

    async def read() -> int | None:
        return next(figures)

    assert await settled_mb(read, clock, poll_s=0.5, steady_s=2.0) == 1500
    assert clock.now() == pytest.approx(4.0)  # 1500 first seen at 2.0, then steady for 2.0


async def test_a_release_that_frees_later_is_waited_for() -> None:
    clock = SteppingClock()
    figures = iter([9000] * 8 + [1200] * 10)  # SGLang: it answered; 4 s later, freed

    async def read() -> int | None:
        return next(figures)

    assert await settled_mb(read, clock, falls_from=9000, poll_s=0.5, steady_s=2.0) == 1200
    assert clock.now() == pytest.approx(6.0)


async def test_a_figure_that_never_settles_is_read_until_the_timeout() -> None:
    clock = SteppingClock()
    figure = 100_000

    async def read() -> int | None:
        nonlocal figure
        figure -= 100
        return figure

    found = await settled_mb(read, clock, poll_s=1.0, steady_s=5.0, timeout_s=10.0)
    assert found == 100_000 - 1100 and clock.now() == pytest.approx(10.0)
