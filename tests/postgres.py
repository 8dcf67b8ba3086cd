"""A throwaway PostgreSQL cluster for the tests, and a fresh database per test.

``postgres_server`` (session): the base DSN of a server. ``GPU_ARBITER_TEST_POSTGRES``
names one to use as it is; otherwise a cluster is created with ``initdb`` in a
temporary folder, started on a free loopback port and stopped at the end. As root,
the PostgreSQL programs run as the ``postgres`` user (they refuse root).

``postgres_dsn`` (function): the DSN of a new, empty database, dropped afterwards.
``Relay``: a TCP relay in front of a database, to partition a client from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

ENV = "GPU_ARBITER_TEST_POSTGRES"


def _bin_dir() -> Path | None:
    """Where ``initdb`` and ``pg_ctl`` are: on PATH, else Debian's newest version."""
    initdb = shutil.which("initdb")
    if initdb is not None and shutil.which("pg_ctl") is not None:
        return Path(initdb).parent
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Cluster:
    """A PostgreSQL cluster in a temporary folder; ``start()`` and ``stop()``."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.as_root = os.geteuid() == 0
        # Under /tmp, not pytest's 0700 folder: the postgres user must reach it.
        self.base = Path(tempfile.mkdtemp(prefix="gpu-arbiter-pg-", dir="/tmp"))
        self.base.chmod(0o755)
        if self.as_root:
            shutil.chown(self.base, "postgres", "postgres")
        self.data = self.base / "data"
        self.log = self.base / "server.log"
        self.port = _free_port()

    def _run(self, program: str, *args: str) -> None:
        command = [str(self.bin_dir / program), *args]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        # The server belongs to the session, not to the test that happened to ask for it
        # first: without the test's mark (tests/integration/conftest.py), the end of that
        # test does not kill it.
        env = {k: v for k, v in os.environ.items() if k != "GPU_ARBITER_TEST_MARK"}
        done = subprocess.run(
            command,
            cwd=self.base,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=env,
        )
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""
            raise RuntimeError(f"{program} failed ({done.returncode}): {done.stderr}\n{log}")

    def start(self) -> str:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        settings = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self.base} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off"
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", settings, "-w", "start"
        )
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """The base DSN (database ``postgres``) of a server the tests may create databases on."""
    given = os.environ.get(ENV)
    if given:
        yield given
        return
    bin_dir = _bin_dir()
    if bin_dir is None:
        pytest.fail(
            "PostgreSQL is not installed (no initdb on PATH or in /usr/lib/postgresql/*/bin): "
            f"install Debian's 'postgresql' package, or set {ENV} to a server's DSN"
        )
    cluster = Cluster(bin_dir)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


def admin_sql(dsn: str, sql: str, *args: object) -> list[asyncpg.Record]:
    """Runs one statement on its own connection (on a private event loop) and returns
    its rows."""

    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(dsn, timeout=30)
        try:
            rows: list[asyncpg.Record] = await conn.fetch(sql, *args)
            return rows
        finally:
            await conn.close()

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(run())
    finally:
        loop.close()


@pytest.fixture
def postgres_dsn(postgres_server: str) -> Iterator[str]:
    """The DSN of a new empty database, dropped after the test."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin_sql(postgres_server, f'CREATE DATABASE "{name}"')
    try:
        yield with_database(postgres_server, name)
    finally:
        admin_sql(postgres_server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Relay:
    """A TCP relay to the database of ``dsn``; connect through :attr:`dsn`.

    ``sever`` cuts every connection and refuses new ones. ``freeze`` holds every byte of
    the open connections, both ways, without closing them (a partition neither end
    notices) and refuses new ones, until ``thaw`` delivers what it held, late. (Refused,
    a client's cancel request cannot arrive with the statement it was meant to cancel.)
    """

    def __init__(self, dsn: str) -> None:
        parts = urlsplit(dsn)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self.listener = socket.create_server(("127.0.0.1", 0))
        port = self.listener.getsockname()[1]
        self.dsn = urlunsplit(parts._replace(netloc=f"{parts.username}@127.0.0.1:{port}"))
        self.cut = False
        self.flowing = threading.Event()
        self.flowing.set()
        self.held = 0  # chunks received and not yet passed on
        self.upstream: list[socket.socket] = []
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def upstream_ports(self) -> list[int]:
        """The client ports the database sees for the connections made so far."""
        with self.lock:
            return [end.getsockname()[1] for end in self.upstream]

    def freeze(self) -> None:
        self.flowing.clear()

    def thaw(self) -> None:
        self.flowing.set()

    def sever(self) -> None:
        self.cut = True
        self.flowing.set()
        with self.lock:
            for end in self.sockets:
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()
            self.sockets.clear()

    def close(self) -> None:
        self.sever()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut or not self.flowing.is_set():
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.sockets += [client, upstream]
                self.upstream.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                with self.lock:
                    self.held += 1
                self.flowing.wait()
                with self.lock:
                    self.held -= 1
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
