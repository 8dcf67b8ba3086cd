"""Starting ``serve``: one controller per state directory, the port before the store,
one-line refusals, private files."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from gpu_arbiter.server.serve import EXIT_CANNOT_LISTEN, EXIT_STATE_DIR_IN_USE
from gpu_arbiter.store.codec import DOCUMENT_FORMAT

from .conftest import SRC, Server


def _serve(
    state_dir: Path, *args: str, umask: int | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gpu_arbiter", "serve", "--state-dir", str(state_dir)]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("GPU_ARBITER_CONFIG", None)
    return subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=60)


def _rows(state_dir: Path) -> dict[str, list[tuple[object, ...]]]:
    """Every row of state.db, table by table (read-only)."""
    with sqlite3.connect(f"file:{state_dir / 'state.db'}?mode=ro", uri=True) as db:
        tables = [
            name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
        ]
        return {t: sorted(db.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in tables}


def _pause(server: Server) -> int:
    with server.client() as admin:
        return admin.post("/v1/pause").status_code


def test_a_second_serve_on_the_same_state_dir_writes_nothing_and_says_why(
    start_server: Callable[..., Server],
) -> None:
    first = start_server("--simulate", "1x8G")
    assert first.proc is not None
    before = _rows(first.state_dir)

    second = _serve(first.state_dir, "--port", "0", "--simulate", "1x8G")

    assert second.returncode == EXIT_STATE_DIR_IN_USE
    assert second.stderr.strip().splitlines() == [
        f"gpu-arbiter serve: a controller (pid {first.proc.pid}) already uses {first.state_dir}"
    ]
    assert _rows(first.state_dir) == before
    assert _pause(first) == 200  # the first one still commits changes


def test_a_port_in_use_is_one_line_and_its_exit_code(
    start_server: Callable[..., Server], tmp_path: Path
) -> None:
    first = start_server()
    port = first.url.rsplit(":", 1)[1]

    second = _serve(tmp_path / "other", "--port", port)

    assert second.returncode == EXIT_CANNOT_LISTEN
    assert second.stderr.strip().splitlines() == [
        f"gpu-arbiter serve: 127.0.0.1:{port} is already in use "
        "(another gpu-arbiter? `--port` chooses another)"
    ]
    assert not (tmp_path / "other" / "state.db").exists()  # the store was never opened


def test_token_create_beside_a_running_controller_leaves_it_working(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--simulate", "1x8G")
    token = server.token("client")  # writes a token row into the controller's state.db
    with server.client(token) as client:
        assert client.post("/v1/leases", json={"vram_mb": "1G"}).status_code == 201
    assert _pause(server) == 200


def test_state_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o755)
    old = os.umask(0o022)  # the server inherits it
    try:
        server = Server(state_dir, "--simulate", "1x8G").start()
    finally:
        os.umask(old)
    try:
        assert _pause(server) == 200  # a commit: the -wal and -shm files are there
        for name in ("state.db", "state.db-wal", "state.db-shm", "admin.token"):
            assert (state_dir / name).stat().st_mode & 0o777 == 0o600, name
    finally:
        server.stop()


def test_a_state_dir_written_by_a_newer_gpu_arbiter_is_refused_in_one_line_and_kept(
    start_server: Callable[..., Server],
) -> None:
    """A database of a newer document format (``PRAGMA user_version``): refused before
    the admin token is made, and left as it was, for the newer code to open again."""
    server = start_server("--simulate", "1x8G")
    with server.client() as admin:
        assert admin.post("/v1/leases", json={"vram_mb": "1G"}).status_code == 201
    server.stop()
    with sqlite3.connect(server.state_dir / "state.db") as db:
        db.execute(f"PRAGMA user_version={DOCUMENT_FORMAT + 1}")
    before = _rows(server.state_dir)

    refused = _serve(server.state_dir, "--port", "0", "--simulate", "1x8G")

    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        f"gpu-arbiter serve: cannot open {server.state_dir / 'state.db'}: written by a newer "
        f"gpu-arbiter (document format {DOCUMENT_FORMAT + 1}; this one reads up to "
        f"{DOCUMENT_FORMAT}): upgrade gpu-arbiter"
    ]
    assert _rows(server.state_dir) == before
