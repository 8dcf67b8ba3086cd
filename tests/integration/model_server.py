"""A small OpenAI-compatible model server for the gateway's tests and bench.

``python model_server.py --port P --name N [--mb MB] [--load-s S] [--record DIR]
[--no-drain] [--ignore-term] [--fail-while PATH] [--ready-when PATH]``

On start it takes ``--mb`` MiB on each GPU of ``CUDA_VISIBLE_DEVICES`` in the fake
probe (half at once, all after ``--load-s``, as a real server grows while it loads),
and answers ``/health`` with 503 until then; with ``--ready-when PATH``, until that file
exists too (a load that lasts as long as a test wants). Chat and completion requests stream
tokens (``"stream": true``) or answer once; a request's body steers it:

- ``tokens`` (default 3), ``token_s`` (pause before each token, default 0)
- ``hold``: a file path; after the first token it waits until that file exists
- ``crash``: the process exits with code 3 at once

``POST /v1/audio/transcriptions`` and ``POST|PUT /upload`` take any body (a multipart
upload) and answer its size, SHA-256, content type and framing.

``GET /stats`` says how many requests it served and how many its clients cancelled.
With ``--record DIR`` it writes ``DIR/<name>-<pid>.json`` with its start, ready,
SIGTERM and exit times and how many SIGTERMs it got (each process of a model its own
file). On SIGTERM it drains (the requests in flight finish, then it exits), or with
``--no-drain`` exits half a second later whatever is in flight, as many servers do; with
``--ignore-term`` it records the SIGTERM and carries on (only SIGKILL ends it). With
``--fail-while PATH`` its start fails (a line on stderr, exit code 4) while PATH exists.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

STATE: dict[str, Any] = {"ready": False, "requests": 0, "cancelled": 0, "in_flight": 0}


def record(key: str, count: str | None = None) -> None:
    directory = STATE.get("record")
    if not directory:
        return
    path = Path(directory) / f"{STATE['name']}-{os.getpid()}.json"
    found = json.loads(path.read_text()) if path.exists() else {"pid": os.getpid()}
    found[key] = time.time()
    if count is not None:
        found[count] = found.get(count, 0) + 1
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(found))
    os.replace(partial, path)


async def health(request: Request) -> Response:
    return JSONResponse({"ok": STATE["ready"]}, status_code=200 if STATE["ready"] else 503)


async def stats(request: Request) -> Response:
    return JSONResponse({k: v for k, v in STATE.items() if k != "record"} | {"pid": os.getpid()})


async def completions(request: Request) -> Response:
    body = await request.json()
    if body.get("crash"):
        os._exit(3)
    STATE["requests"] += 1
    tokens, token_s = int(body.get("tokens", 3)), float(body.get("token_s", 0))
    hold = body.get("hold")
    if not body.get("stream"):
        STATE["in_flight"] += 1
        try:
            for _ in range(tokens):
                if token_s:
                    await asyncio.sleep(token_s)
        finally:
            STATE["in_flight"] -= 1
        text = " ".join(f"t{i}" for i in range(tokens))
        return JSONResponse({"model": STATE["name"], "choices": [{"text": text}]})
    return StreamingResponse(_tokens(tokens, token_s, hold), media_type="text/event-stream")


async def _tokens(tokens: int, token_s: float, hold: str | None) -> Any:
    STATE["in_flight"] += 1
    try:
        for i in range(tokens):
            if token_s:
                await asyncio.sleep(token_s)
            if i == 1 and hold:
                while not Path(hold).exists():
                    await asyncio.sleep(0.02)
            chunk = {"model": STATE["name"], "choices": [{"delta": {"content": f"t{i}"}}]}
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:
        STATE["cancelled"] += 1
        raise
    finally:
        STATE["in_flight"] -= 1


async def embeddings(request: Request) -> Response:
    await request.body()
    STATE["requests"] += 1
    return JSONResponse({"model": STATE["name"], "data": [{"embedding": [0.1, 0.2]}]})


async def upload(request: Request) -> Response:
    digest, size = hashlib.sha256(), 0
    async for chunk in request.stream():
        digest.update(chunk)
        size += len(chunk)
    STATE["requests"] += 1
    framing = "chunked" if "transfer-encoding" in request.headers else "length"
    found = {"bytes": size, "sha256": digest.hexdigest(), "framing": framing}
    found["content_type"] = request.headers.get("content-type", "")
    return JSONResponse({"model": STATE["name"], **found})


async def echo(request: Request) -> Response:
    body = await request.body()
    return JSONResponse(
        {"path": request.url.path, "query": request.url.query, "body": body.decode()}
    )


app = Starlette(
    routes=[
        Route("/health", health),
        Route("/stats", stats),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/audio/transcriptions", upload, methods=["POST"]),
        Route("/upload", upload, methods=["POST", "PUT"]),
        Route("/{path:path}", echo, methods=["GET", "POST", "PUT"]),
    ]
)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


async def _load(mb: int, load_s: float, ready_when: str) -> None:
    usage = os.environ.get("GPU_ARBITER_FAKE_USAGE_DIR")
    indexes = [int(i) for i in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if i]
    if mb and usage:
        from gpu_arbiter.agent.probes import report_usage

        report_usage({i: mb // 2 for i in indexes})
        await asyncio.sleep(load_s)
        report_usage({i: mb for i in indexes})
    else:
        await asyncio.sleep(load_s)
    while ready_when and not Path(ready_when).exists():
        await asyncio.sleep(0.02)
    STATE["ready"] = True
    record("ready_at")


def _on_term(server: uvicorn.Server, drain: bool, ignore: bool) -> None:
    """Drains (no new connections, the requests in flight finish, then it exits), exits
    half a second later without waiting for them, or ignores it."""
    record("term_at", count="terms")
    if ignore:
        return
    if drain:
        server.should_exit = True
    else:
        asyncio.get_running_loop().call_later(0.5, _exit_now)


def _exit_now() -> None:
    record("exit_at")
    os._exit(0)


async def main(args: argparse.Namespace) -> None:
    config = uvicorn.Config(
        app, port=args.port, http="httptools", log_level="warning", lifespan="off"
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, _on_term, server, args.drain, args.ignore_term)
    loading = asyncio.ensure_future(_load(args.mb, args.load_s, args.ready_when))
    await server.serve()
    loading.cancel()
    record("exit_at")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="stub")
    parser.add_argument("--mb", type=int, default=0)
    parser.add_argument("--load-s", type=float, default=0.2)
    parser.add_argument("--record", default="")
    parser.add_argument("--no-drain", dest="drain", action="store_false")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--fail-while", default="")
    parser.add_argument("--ready-when", default="")
    arguments = parser.parse_args()
    STATE["name"], STATE["record"] = arguments.name, arguments.record
    record("started_at")
    if arguments.fail_while and Path(arguments.fail_while).exists():
        print(f"cannot start: {arguments.fail_while} exists", file=sys.stderr, flush=True)
        sys.exit(4)
    asyncio.run(main(arguments))
