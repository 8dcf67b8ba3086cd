"""The engines' drivers against real processes on loopback: fakes of vLLM, SGLang and
ComfyUI that follow their documented HTTP interfaces and take and free memory in the
fake probe (tests/integration/engine_servers.py), and llama.cpp's real server sleeping
by itself (``llama_server`` fixture: tests/llama.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpu_arbiter.agent.probes import FakeProbe
from gpu_arbiter.gateway import ModelConfig, parse_config
from gpu_arbiter.gateway.base.clock import LoopClock
from gpu_arbiter.gateway.servers.engines import (
    ComfyUiDriver,
    Driver,
    EngineHttp,
    driver_for,
    settled_mb,
)

from .agents import free_port
from .conftest import SRC, ManagedProcess

pytestmark = pytest.mark.timeout(180)

ENGINE_SERVERS = Path(__file__).with_name("engine_servers.py")
TOTAL_MB = 24576  # the fake probe's GPU: 1x24G
LEASE_MB = 6144


class EngineProcess(ManagedProcess):
    def __init__(self, command: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(list(command), stdout=out, stderr=out, env=env)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Engines:
    """Starts engine servers as the gateway would (the driver's flags and environment,
    the lease's GPU, the fake probe's usage directory), and reads the probe."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.usage = tmp_path / "usage"
        self.usage.mkdir()
        self.probe = FakeProbe.from_spec("1x24G", usage_dir=self.usage)
        self.started: list[EngineProcess] = []
        self.http = EngineHttp()

    def model(self, name: str, **keys: Any) -> ModelConfig:
        return parse_config({"models": {name: keys}}).models[name]

    def driver(self, model: ModelConfig) -> Driver:
        return driver_for(
            model.engine, self.http, sleep_after_s=model.sleep_after_s,
            sleep_level=model.sleep_level,
        )  # fmt: skip

    def start(self, model: ModelConfig, driver: Driver) -> tuple[int, EngineProcess]:
        port = free_port()
        command = [part.replace("{port}", str(port)) for part in model.command]
        env = {**os.environ, "PYTHONPATH": str(SRC), "CUDA_VISIBLE_DEVICES": "0"}
        env.update(self.probe.child_env())
        command, env = driver.prepare(command, env, LEASE_MB, TOTAL_MB)
        process = EngineProcess(command, env, self.tmp_path / f"{model.name}.log")
        self.started.append(process)
        return port, process

    async def used_mb(self) -> int | None:
        reading = (await self.probe.snapshot()).reading(0)
        return None if reading is None else reading.used_mb

    async def ready(self, driver: Driver, port: int, process: EngineProcess) -> None:
        async def answers() -> bool:
            if process.proc is not None and process.proc.poll() is not None:
                raise AssertionError(f"the server exited: {process.output()}")
            found = await self.http.call("GET", port, driver.ready_paths[0])
            return found is not None and found.ok

        await until(answers, 60, "the server to be ready")


async def until(check: Callable[[], Awaitable[Any]], timeout_s: float, what: str) -> Any:
    """Polls ``check`` until it returns something truthy; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def engines(tmp_path: Path) -> AsyncIterator[Engines]:
    made = Engines(tmp_path)
    yield made
    await made.http.aclose()
    for process in made.started:
        process.stop()


def fake(engine: str, *args: str) -> list[str]:
    command = [sys.executable, str(ENGINE_SERVERS), engine, "--port", "{port}"]
    return [*command, "--gpu-total-mb", str(TOTAL_MB), *args]


async def measured(engines: Engines, falls_from: int) -> int | None:
    return await settled_mb(
        engines.used_mb, LoopClock(), falls_from=falls_from, poll_s=0.05, steady_s=0.5,
        timeout_s=60,
    )  # fmt: skip


async def test_vllm_takes_its_lease_sleeps_to_what_stays_and_wakes(engines: Engines) -> None:
    model = engines.model(
        "v", command=fake("vllm", "--resident-mb", "900"), engine="vllm", sleep_after="1m",
    )  # fmt: skip
    driver = engines.driver(model)
    port, process = engines.start(model, driver)
    await engines.ready(driver, port, process)
    assert await until(lambda: _equals(engines.used_mb(), LEASE_MB), 30, "the lease's memory")
    assert await driver.is_sleeping(port) is False
    assert await driver.sleep(port)
    assert await driver.is_sleeping(port) is True
    assert await measured(engines, LEASE_MB) == 900  # what stays, measured
    assert await driver.wake(port)
    assert await driver.is_sleeping(port) is False
    assert await until(lambda: _equals(engines.used_mb(), LEASE_MB), 30, "the memory back")


async def test_vllm_that_does_not_sleep_keeps_its_sleep_routes_closed(engines: Engines) -> None:
    model = engines.model("v", command=fake("vllm"), engine="vllm")
    driver = engines.driver(model)
    port, process = engines.start(model, driver)
    await engines.ready(driver, port, process)
    assert await driver.is_sleeping(port) is None  # no VLLM_SERVER_DEV_MODE: no route
    assert not await driver.sleep(port)


async def test_sglang_frees_after_its_answer_and_the_wait_sees_it(engines: Engines) -> None:
    command = fake("sglang", "--resident-mb", "700", "--free-s", "1.5")
    model = engines.model("s", command=command, engine="sglang", sleep_after="1m")
    driver = engines.driver(model)
    port, process = engines.start(model, driver)
    await engines.ready(driver, port, process)
    assert await until(lambda: _equals(engines.used_mb(), LEASE_MB), 30, "the lease's memory")
    assert await driver.sleep(port)
    assert await measured(engines, LEASE_MB) == 700
    assert await driver.wake(port)
    assert await until(lambda: _equals(engines.used_mb(), LEASE_MB), 30, "the memory back")


async def test_comfyui_is_busy_while_its_queue_runs_and_frees_on_request(
    engines: Engines, tmp_path: Path
) -> None:
    command = fake("comfyui", "--vram-mb", "5000", "--resident-mb", "1500", "--free-s", "0.5")
    model = engines.model("c", command=command, engine="comfyui", sleep_after="1m")
    driver = engines.driver(model)
    port, process = engines.start(model, driver)
    await engines.ready(driver, port, process)
    assert await driver.busy(port) is False
    hold = tmp_path / "hold"
    graph = {"1": {"class_type": "KSampler", "inputs": {}}}
    body = {"prompt": graph, "extra_data": {"hold": str(hold)}}
    queued = await engines.http.call("POST", port, "/prompt", json=body)
    assert queued is not None and queued.ok  # answered: the work runs after it
    assert await driver.busy(port) is True
    assert await until(lambda: _equals(engines.used_mb(), 5000), 30, "its models loaded")
    hold.touch()
    assert await until(lambda: _not(driver.busy(port)), 30, "the queue to empty")
    assert await driver.sleep(port)
    assert await measured(engines, 5000) == 1500
    assert isinstance(driver, ComfyUiDriver)
    assert await driver.free_mb(port) == {0: TOTAL_MB - 1500}


async def test_the_real_llama_server_sleeps_by_itself_and_a_request_wakes_it(
    engines: Engines, llama_server: Path, tiny_models: Path
) -> None:
    command = [str(llama_server), "-m", str(tiny_models / "tiny-chat.gguf"), "-c", "512"]
    command += ["--port", "{port}", "-t", "1"]
    model = engines.model("chat", command=command, sleep_after="1s")
    assert model.engine == "llama.cpp"  # read from the command
    driver = engines.driver(model)
    port, process = engines.start(model, driver)
    assert process.proc is not None and "--sleep-idle-seconds" in process.proc.args
    await engines.ready(driver, port, process)
    assert await until(lambda: driver.is_sleeping(port), 60, "it to sleep")
    assert await driver.wake(port)
    assert "exiting sleeping state" in process.output()
    answer = await engines.http.call(
        "POST", port, "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )  # fmt: skip
    assert answer is not None and answer.ok and answer.body["choices"]
    assert await until(lambda: driver.is_sleeping(port), 60, "it to sleep again")


async def _equals(figure: Awaitable[int | None], expected: int) -> bool:
    return await figure == expected


async def _not(found: Awaitable[bool | None]) -> bool:
    return await found is False
