"""Fakes of the engines that need a GPU (vLLM, SGLang) and of ComfyUI, each following the
engine's documented HTTP interface, for the engine drivers' tests.

``python engine_servers.py ENGINE --port P --gpu-total-mb T [--resident-mb R]
[--free-s S] [--job-s J] [flags of the engine]``

Each takes memory in the fake probe (``report_usage``: ``GPU_ARBITER_FAKE_USAGE_DIR``, on
each GPU of ``CUDA_VISIBLE_DEVICES``) as the engine sizes itself, and gives memory back as
it does, down to ``--resident-mb`` (what stays: CUDA graphs, NCCL, the runtime):

- ``vllm``: takes ``--gpu-memory-utilization`` (default 0.9) x the GPU's total.
  ``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping`` exist only with
  ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1`` (404 otherwise); the sleep frees
  before it answers. ``GET /health``, ``POST /v1/chat/completions`` (503 while asleep).
- ``sglang``: takes ``--mem-fraction-static`` (default 0.88) x total.
  ``/release_memory_occupation`` and ``/resume_memory_occupation`` (POST, a JSON body)
  need ``--enable-memory-saver`` (400 otherwise); the release answers at once and frees
  ``--free-s`` later.
- ``comfyui``: takes ``--vram-mb`` once a prompt loads its models. ``POST /prompt``
  queues a job that runs ``--job-s`` after the answer (or until the file named by
  ``extra_data.hold`` exists); ``GET /queue`` lists running and pending jobs; ``POST
  /free`` (``unload_models``, ``free_memory``) frees ``--free-s`` after its answer;
  ``GET /system_stats`` reports each device's total and free bytes.
- ``ollama``: ``ollama serve``, on the port of ``OLLAMA_HOST`` (``--port`` is unused), with
  the models of ``--ollama-model NAME=MB`` (each loaded model takes its MiB, and
  ``/api/ps`` says so in ``size_vram``; an unload gives it back ``--free-s`` later).
  ``POST /api/generate`` and ``POST /api/chat`` without a prompt (or messages) load the
  model, with ``keep_alive: 0`` unload it; with one they load it and answer (NDJSON
  unless ``"stream": false``); ``POST /v1/chat/completions`` loads and answers as
  OpenAI does. A loaded model is unloaded by itself once its ``keep_alive`` passes (the
  request's, else ``OLLAMA_KEEP_ALIVE``, else 5m; negative: never), and the oldest is
  evicted beyond ``OLLAMA_MAX_LOADED_MODELS`` (default 3). ``GET /api/ps``, ``GET
  /api/tags``, ``GET /api/version``; an unknown model is a 404 ``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

MIB = 1024 * 1024
STATE: dict[str, Any] = {"used_mb": 0, "asleep": False, "jobs": [], "tasks": set()}


def take(mb: int) -> None:
    """This process now holds ``mb`` MiB on each of its GPUs (in the fake probe)."""
    STATE["used_mb"] = mb
    if not os.environ.get("GPU_ARBITER_FAKE_USAGE_DIR"):
        return
    from gpu_arbiter.agent.probes import report_usage

    indexes = [int(i) for i in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if i]
    report_usage({i: mb for i in indexes})


def later(seconds: float, mb: int) -> None:
    async def run() -> None:
        await asyncio.sleep(seconds)
        take(mb)

    task = asyncio.ensure_future(run())
    STATE["tasks"].add(task)
    task.add_done_callback(STATE["tasks"].discard)


def share(args: argparse.Namespace, fraction: float) -> int:
    return int(fraction * args.gpu_total_mb)


async def health(request: Request) -> Response:
    return JSONResponse({})


async def chat(request: Request) -> Response:
    await request.body()
    if STATE["asleep"]:
        return JSONResponse({"error": "the engine is sleeping"}, status_code=503)
    return JSONResponse({"choices": [{"message": {"role": "assistant", "content": "hi"}}]})


# ---------------------------------------------------------------------- vLLM


def vllm_routes(args: argparse.Namespace, extra: list[str]) -> list[Route]:
    full = share(args, _float_flag(extra, "--gpu-memory-utilization", 0.9))

    async def sleep(request: Request) -> Response:
        level = int(request.query_params.get("level", "1"))
        if level not in (1, 2):
            return JSONResponse({"error": f"level {level}"}, status_code=400)
        STATE["asleep"] = True
        take(args.resident_mb)  # level 1: weights to host memory; 2: dropped
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        STATE["asleep"] = False
        take(full)
        return Response(status_code=200)

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": STATE["asleep"]})

    take(full)
    routes = [Route("/health", health), Route("/v1/chat/completions", chat, methods=["POST"])]
    if "--enable-sleep-mode" in extra and os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
        routes += [
            Route("/sleep", sleep, methods=["POST"]),
            Route("/wake_up", wake_up, methods=["POST"]),
            Route("/is_sleeping", is_sleeping),
        ]
    return routes


# ---------------------------------------------------------------------- SGLang


def sglang_routes(args: argparse.Namespace, extra: list[str]) -> list[Route]:
    full = share(args, _float_flag(extra, "--mem-fraction-static", 0.88))
    saver = "--enable-memory-saver" in extra

    async def release(request: Request) -> Response:
        await request.json()
        if not saver:
            return JSONResponse({"error": "needs --enable-memory-saver"}, status_code=400)
        STATE["asleep"] = True
        later(args.free_s, args.resident_mb)  # it answers before the memory is free
        return Response(status_code=200)

    async def resume(request: Request) -> Response:
        await request.json()
        if not saver:
            return JSONResponse({"error": "needs --enable-memory-saver"}, status_code=400)
        STATE["asleep"] = False
        take(full)
        return Response(status_code=200)

    take(full)
    return [
        Route("/health", health),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/release_memory_occupation", release, methods=["GET", "POST"]),
        Route("/resume_memory_occupation", resume, methods=["GET", "POST"]),
    ]


# ---------------------------------------------------------------------- ComfyUI


def comfyui_routes(args: argparse.Namespace, extra: list[str]) -> list[Route]:
    async def run_jobs() -> None:
        while STATE["jobs"]:
            job = STATE["jobs"][0]
            job["running"] = True
            take(args.vram_mb)  # the prompt's models load
            hold = job["extra"].get("hold")
            if hold:
                while not Path(hold).exists():
                    await asyncio.sleep(0.02)
            else:
                await asyncio.sleep(args.job_s)
            STATE["jobs"].pop(0)

    async def prompt(request: Request) -> Response:
        body = await request.json()
        if not isinstance(body.get("prompt"), dict):
            return JSONResponse({"error": "no prompt"}, status_code=400)
        job = {"id": str(uuid.uuid4()), "extra": body.get("extra_data") or {}, "running": False}
        number = len(STATE["jobs"])
        STATE["jobs"].append(job)
        if number == 0:
            task = asyncio.ensure_future(run_jobs())
            STATE["tasks"].add(task)
            task.add_done_callback(STATE["tasks"].discard)
        return JSONResponse({"prompt_id": job["id"], "number": number, "node_errors": {}})

    async def queue(request: Request) -> Response:
        # each entry as ComfyUI lists it: [number, prompt_id, prompt, extra_data, outputs]
        jobs = [
            (j["running"], [i, j["id"], {}, j["extra"], []]) for i, j in enumerate(STATE["jobs"])
        ]
        running = [entry for on, entry in jobs if on]
        pending = [entry for on, entry in jobs if not on]
        return JSONResponse({"queue_running": running, "queue_pending": pending})

    async def free(request: Request) -> Response:
        body = await request.json()
        if body.get("unload_models") or body.get("free_memory"):
            later(args.free_s, args.resident_mb)  # the worker thread frees it, later
        return Response(status_code=200)

    async def system_stats(request: Request) -> Response:
        indexes = [int(i) for i in os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",") if i]
        total, free = args.gpu_total_mb * MIB, (args.gpu_total_mb - STATE["used_mb"]) * MIB
        devices = [
            {"name": f"cuda:{i} fake", "type": "cuda", "index": i, "vram_total": total,
             "vram_free": free, "torch_vram_total": total, "torch_vram_free": free}
            for i in indexes
        ]  # fmt: skip
        return JSONResponse({"system": {"os": "posix"}, "devices": devices})

    take(args.resident_mb)
    return [
        Route("/prompt", prompt, methods=["POST"]),
        Route("/queue", queue),
        Route("/free", free, methods=["POST"]),
        Route("/system_stats", system_stats),
    ]


# ---------------------------------------------------------------------- Ollama


def _duration_s(value: Any) -> float:
    """Ollama's keep_alive: seconds (a number), or a Go duration (``"5m"``, ``"10s"``,
    ``"-1"``); negative: forever."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * units[unit]
    return float(text)


class FakeOllama:
    """The state of one ``ollama serve``: its models, those loaded, their timers."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.known = dict(_model_size(spec) for spec in args.ollama_model)
        self.loaded: dict[str, dict[str, Any]] = {}  # name -> mb, expires_at, timer
        self.freeing_mb = 0
        self.default_keep_s = _duration_s(os.environ.get("OLLAMA_KEEP_ALIVE", "5m"))
        self.most = int(os.environ.get("OLLAMA_MAX_LOADED_MODELS", "3"))

    def account(self) -> None:
        take(sum(m["mb"] for m in self.loaded.values()) + self.freeing_mb)

    def unload(self, name: str) -> None:
        model = self.loaded.pop(name, None)
        if model is None:
            return
        if model["timer"] is not None:
            model["timer"].cancel()
        print(f"unloaded {name}", flush=True)
        self.freeing_mb += model["mb"]

        async def give_back() -> None:
            await asyncio.sleep(self.args.free_s)
            self.freeing_mb -= model["mb"]
            self.account()

        _spawn(give_back())

    def keep(self, name: str, keep_alive: Any) -> None:
        seconds = self.default_keep_s if keep_alive is None else _duration_s(keep_alive)
        model = self.loaded[name]
        if model["timer"] is not None:
            model["timer"].cancel()
            model["timer"] = None
        model["expires_at"] = None if seconds < 0 else time.time() + seconds
        if seconds >= 0:
            model["timer"] = asyncio.get_running_loop().call_later(seconds, self.unload, name)

    async def load(self, name: str, keep_alive: Any) -> None:
        if name not in self.loaded:
            await asyncio.sleep(self.args.load_s)
            while len(self.loaded) >= self.most:  # the scheduler evicts the oldest
                self.unload(next(iter(self.loaded)))
            self.loaded[name] = {"mb": self.known[name], "expires_at": None, "timer": None}
            print(f"loaded {name}", flush=True)
            self.account()
        self.keep(name, keep_alive)

    def named(self, body: Any) -> str | None:
        name = body.get("model") if isinstance(body, dict) else None
        if not isinstance(name, str):
            return None
        tagged = f"{name}:latest"
        return name if name in self.known else tagged if tagged in self.known else None

    def ps(self) -> list[dict[str, Any]]:
        return [
            {"name": name, "model": name, "size": m["mb"] * MIB, "digest": "0" * 64,
             "details": {"format": "gguf"}, "size_vram": m["mb"] * MIB,
             "expires_at": _expires(m["expires_at"])}
            for name, m in self.loaded.items()
        ]  # fmt: skip

    def tags(self) -> list[dict[str, Any]]:
        return [
            {"name": name, "model": name, "modified_at": "2026-01-01T00:00:00Z",
             "size": mb * MIB, "digest": "0" * 64, "details": {"format": "gguf"}}
            for name, mb in self.known.items()
        ]  # fmt: skip

    async def native(self, body: Any, said: str) -> Response:
        """``/api/generate`` (``said`` = ``prompt``) or ``/api/chat`` (``messages``)."""
        name = self.named(body)
        if name is None:
            return _missing(body)
        chat = said == "messages"
        if body.get("keep_alive") == 0 and not body.get(said):
            self.unload(name)
            return _native(name, body, chat, "", "unload")
        await self.load(name, body.get("keep_alive"))
        if not body.get(said):
            return _native(name, body, chat, "", "load")
        return _native(name, body, chat, "hi", "stop")


def _expires(at: float | None) -> str:
    if at is None:
        return "2318-08-01T00:00:00Z"  # keep_alive -1: as Ollama shows it
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def _missing(body: Any) -> Response:
    name = body.get("model") if isinstance(body, dict) else None
    return JSONResponse({"error": f"model '{name}' not found"}, status_code=404)


def _native(name: str, body: dict[str, Any], chat: bool, text: str, reason: str) -> Response:
    said = {"message": {"role": "assistant", "content": text}} if chat else {"response": text}
    line = {"model": name, "created_at": "2026-01-01T00:00:00Z", **said, "done": True}
    line["done_reason"] = reason
    if body.get("stream", True) is False:
        return JSONResponse(line)
    return Response(json.dumps(line) + "\n", media_type="application/x-ndjson")


def ollama_routes(args: argparse.Namespace, extra: list[str]) -> list[Route]:
    ollama = FakeOllama(args)

    async def generate(request: Request) -> Response:
        return await ollama.native(await request.json(), "prompt")

    async def chat_api(request: Request) -> Response:
        return await ollama.native(await request.json(), "messages")

    async def openai_chat(request: Request) -> Response:
        body = await request.json()
        name = ollama.named(body)
        if name is None:
            error = {"message": f"model {body.get('model')!r} not found", "type": "api_error"}
            return JSONResponse({"error": error}, status_code=404)
        await ollama.load(name, None)
        return JSONResponse({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })  # fmt: skip

    async def ps(request: Request) -> Response:
        return JSONResponse({"models": ollama.ps()})

    async def tags(request: Request) -> Response:
        return JSONResponse({"models": ollama.tags()})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": "0.6.0"})

    return [
        Route("/api/version", version),
        Route("/api/ps", ps),
        Route("/api/tags", tags),
        Route("/api/generate", generate, methods=["POST"]),
        Route("/api/chat", chat_api, methods=["POST"]),
        Route("/v1/chat/completions", openai_chat, methods=["POST"]),
    ]


def _model_size(spec: str) -> tuple[str, int]:
    name, _, mb = spec.rpartition("=")
    return name, int(mb)


def _spawn(work: Any) -> None:
    task = asyncio.ensure_future(work)
    STATE["tasks"].add(task)
    task.add_done_callback(STATE["tasks"].discard)


def _ollama_port() -> int:
    host = os.environ.get("OLLAMA_HOST", "127.0.0.1:11434")
    return int(host.rpartition(":")[2])


def _float_flag(extra: list[str], flag: str, default: float) -> float:
    for i, word in enumerate(extra):
        if word == flag and i + 1 < len(extra):
            return float(extra[i + 1])
        if word.startswith(flag + "="):
            return float(word.split("=", 1)[1])
    return default


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


ENGINES = {
    "vllm": vllm_routes,
    "sglang": sglang_routes,
    "comfyui": comfyui_routes,
    "ollama": ollama_routes,
}


async def main(args: argparse.Namespace, extra: list[str]) -> None:
    app = Starlette(routes=ENGINES[args.engine](args, extra))
    port = _ollama_port() if args.engine == "ollama" else args.port
    config = uvicorn.Config(app, port=port, log_level="warning", lifespan="off")
    await _Server(config).serve()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("engine", choices=sorted(ENGINES))
    parser.add_argument("--port", type=int)
    parser.add_argument("--gpu-total-mb", type=int, default=24576)
    parser.add_argument("--resident-mb", type=int, default=1024)
    parser.add_argument("--vram-mb", type=int, default=6000)
    parser.add_argument("--free-s", type=float, default=0.5)
    parser.add_argument("--job-s", type=float, default=0.2)
    parser.add_argument("--load-s", type=float, default=0.1)
    parser.add_argument("--ollama-model", action="append", default=[])
    arguments, rest = parser.parse_known_args()
    asyncio.run(main(arguments, rest))
