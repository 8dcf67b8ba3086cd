"""A model file copied between two gateways on loopback, against ``curl`` fetching the
same file from ``python -m http.server`` on the same machine.

The serving gateway is the gateway's own HTTP stack in a process of its own on
127.0.0.2: its ASGI app (``GatewayApp``: ``GET /files/{name}``, the peer header checked
by its cluster view) under the gateway's uvicorn settings (``serve.py``). The copying
gateway is this process: its file store (``files/store.py``) and its HTTP fetcher
(``files/fetch.py``), signing each request as a peer, writing ``NAME.part``, hashing
every byte (SHA-256), fsyncing and renaming, as a replica's copy does. ``curl`` fetches
the same file from ``python -m http.server`` on 127.0.0.3 to a file (no hash, no
fsync), and again followed by ``sync FILE`` (its fsync: the durability the copy pays
for before its rename). They are timed in turns, ``--runs`` each; medians, the ratios
of rates (goal: at least 0.8x curl's), and the resume after a cut: a copy stopped
half-way (its task cancelled), then started again: the time to its first new byte and
to the end (the ``.part``'s bytes are hashed again beside the new ones). Each copy's
CPU time (user and system, all threads, from ``/proc``) is read for both gateways'
processes and printed per MiB.

Both sides run on the gateway's event loop (uvloop's where installed). Run:
``python bench/bench_file_copy.py [--mib 256] [--runs 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx

from gpu_arbiter.cli.gateway import _loop_factory
from gpu_arbiter.gateway.base.clock import LoopClock
from gpu_arbiter.gateway.base.metrics import GatewayMetrics
from gpu_arbiter.gateway.files.fetch import HttpFetcher, Source
from gpu_arbiter.gateway.files.store import FileStore, Progress
from gpu_arbiter.gateway.servers.config import ModelFile
from gpu_arbiter.peer_identity import Identity, Relayed, decode_key

NAME = "model.gguf"
Queue = Any  # a multiprocessing queue
T = TypeVar("T")


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def serve_gateway(root: str, file: ModelFile, port: int, copier_key: str, ready: Queue) -> None:
    """The serving gateway: its app and uvicorn settings, its store holding ``file``, its
    view showing the copying gateway (gw-b) and its key; its own public key is put on
    ``ready`` once it holds the file."""
    from gpu_arbiter.gateway.cluster.cluster import Cluster
    from gpu_arbiter.gateway.config import GatewayConfig
    from gpu_arbiter.gateway.requests.app import GatewayApp
    from gpu_arbiter.gateway.serve import _listen, _Server, _uvicorn_config

    async def main() -> None:
        app = GatewayApp({}, {}, GatewayMetrics())
        clock = LoopClock()
        cluster = Cluster(None, name="gw-a", worker=None, models={}, routes={}, clock=clock)  # type: ignore[arg-type]
        cluster.apply({"signature": "s", "gateways": [
            {"name": "gw-b", "url": "http://127.0.0.1:1", "public_key": copier_key,
             "routable": True, "models": []}]})  # fmt: skip
        app.cluster = cluster
        store = FileStore(Path(root), None, clock)  # type: ignore[arg-type]
        assert await store.verified(file)
        app.files = store
        ready.put(cluster.identity.public_key)
        config = GatewayConfig(models={}, host="127.0.0.2", port=port)
        server = _Server(_uvicorn_config(app, config, None), None, 10.0)
        sock = _listen("127.0.0.2", port)
        await server.serve(sockets=[sock])

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(main())


async def copy_once(
    root: Path, file: ModelFile, url: str, signer: Identity, key: str, stop_at: int | None = None
) -> tuple[float, float | None]:
    """One copy into ``root``: seconds to the end (or to ``stop_at`` bytes, where it is
    cancelled), and seconds to its first byte."""
    peer_key = decode_key(key)
    fetcher = HttpFetcher(lambda to, m, t: signer.sign(to, peer_key, Relayed(m, t.encode())))
    store = FileStore(root, fetcher, LoopClock())
    began = time.perf_counter()
    first: list[float] = []
    done = asyncio.Event()

    def progress(now: Progress) -> None:
        if not first:
            first.append(time.perf_counter() - began)
        if stop_at is not None and now.done >= stop_at:
            done.set()

    copy = asyncio.ensure_future(store.ensure(file, [Source(url, peer="gw-a")], progress))
    if stop_at is not None:
        await done.wait()
        copy.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await copy
    else:
        await copy
    took = time.perf_counter() - began
    await fetcher.aclose()
    return took, (first[0] if first else None)


def on_loop(work: Coroutine[Any, Any, T]) -> T:
    """``work`` on the gateway's own event loop (uvloop's where installed)."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(work)


def cpu_of(pid: int) -> float:
    """CPU seconds (user and system, all threads) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def curl_once(url: str, to: Path, durable: bool = False) -> float:
    """``curl -o``; ``durable``: then ``sync FILE`` (its fsync), as the copy's rename waits
    for its own."""
    began = time.perf_counter()
    subprocess.run(["curl", "-sSf", "-o", str(to), url], check=True)
    if durable:
        subprocess.run(["sync", str(to)], check=True)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    size = args.mib << 20
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = root / "a"
        source.mkdir()
        data = os.urandom(size)
        (source / NAME).write_bytes(data)
        file = ModelFile(NAME, size, hashlib.sha256(data).hexdigest())
        del data
        copier = Identity("gw-b")
        port = free_port("127.0.0.2")
        ready: Queue = multiprocessing.Queue()
        gateway = multiprocessing.Process(
            target=serve_gateway, args=(str(source), file, port, copier.public_key, ready)
        )
        gateway.start()
        key = str(ready.get(timeout=60))
        http_port = free_port("127.0.0.3")
        plain = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(http_port), "--bind", "127.0.0.3",
             "--directory", str(source)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            run(root, file, (port, http_port), copier, key, args.runs, gateway.pid or 0)
        finally:
            plain.terminate()
            gateway.terminate()
            plain.wait(10)
            gateway.join(10)


def _wait_up(url: str) -> None:
    for _ in range(200):
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise SystemExit(f"{url} never answered")


def run(
    root: Path,
    file: ModelFile,
    ports: tuple[int, int],
    copier: Identity,
    key: str,
    runs: int,
    server_pid: int,
) -> None:
    """The copies in turns, then the resumes, each figure printed."""
    port, http_port = ports
    url = f"http://127.0.0.2:{port}/files/{NAME}"
    plain = f"http://127.0.0.3:{http_port}/{NAME}"
    _wait_up(f"http://127.0.0.2:{port}/healthz")
    _wait_up(f"http://127.0.0.3:{http_port}/")
    ours, curls, synced, served_cpu, copied_cpu = [], [], [], [], []
    for number in range(runs):
        into = root / f"b{number}"
        into.mkdir()
        served, copied = cpu_of(server_pid), cpu_of(os.getpid())
        took, _ = on_loop(copy_once(into, file, url, copier, key))
        served_cpu.append(cpu_of(server_pid) - served)
        copied_cpu.append(cpu_of(os.getpid()) - copied)
        assert (into / NAME).stat().st_size == file.size
        ours.append(took)
        curls.append(curl_once(plain, root / f"c{number}"))
        (root / f"c{number}").unlink()
        synced.append(curl_once(plain, root / f"c{number}", durable=True))
        for path in (into / NAME, root / f"c{number}"):
            path.unlink()
    mib = file.size / (1 << 20)
    rate, curl_rate = mib / statistics.median(ours), mib / statistics.median(curls)
    print(f"a {mib:.0f} MiB model file over loopback, {runs} runs each (medians):")
    print(f"  gateway to gateway  {statistics.median(ours):6.2f} s  {rate:7.0f} MiB/s"
          f"  (min {min(ours):.2f} s, max {max(ours):.2f} s; sha256, fsync included)")  # fmt: skip
    print(f"  curl, http.server   {statistics.median(curls):6.2f} s  {curl_rate:7.0f} MiB/s"
          f"  (min {min(curls):.2f} s, max {max(curls):.2f} s)")  # fmt: skip
    synced_rate = mib / statistics.median(synced)
    print(f"  curl, then sync     {statistics.median(synced):6.2f} s  {synced_rate:7.0f} MiB/s"
          f"  (its file's fsync too, as ours waits for its own before the rename)")  # fmt: skip
    print(f"  ratio (ours / curl's rate): {rate / curl_rate:.2f}x (goal: at least 0.80x); "
          f"against curl then sync: {rate / synced_rate:.2f}x")  # fmt: skip
    per_mib = [1e3 * statistics.median(cpu) / mib for cpu in (served_cpu, copied_cpu)]
    print(f"  CPU per copy (medians): serving gateway {statistics.median(served_cpu):.2f} s"
          f" ({per_mib[0]:.2f} ms/MiB), copying gateway {statistics.median(copied_cpu):.2f} s"
          f" ({per_mib[1]:.2f} ms/MiB), on {os.cpu_count()} cores")  # fmt: skip
    firsts, ends = [], []
    for number in range(runs):
        into = root / f"r{number}"
        into.mkdir()
        on_loop(copy_once(into, file, url, copier, key, stop_at=file.size // 2))
        took, first = on_loop(copy_once(into, file, url, copier, key))
        assert first is not None
        firsts.append(first)
        ends.append(took)
        (into / NAME).unlink()
    print(f"resume after a cut half-way ({runs} runs, medians): first new byte after "
          f"{statistics.median(firsts) * 1e3:.0f} ms, the rest in "
          f"{statistics.median(ends):.2f} s (the .part's {mib / 2:.0f} MiB hashed again "
          f"beside it)")  # fmt: skip


if __name__ == "__main__":
    main()
