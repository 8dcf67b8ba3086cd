"""A controller whose state is in PostgreSQL (``serve --store postgresql://...``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from .conftest import SRC, Server


def _create(client: httpx.Client, holder: str) -> dict[str, object]:
    answer = client.post("/v1/leases", json={"holder": holder, "vram_mb": "8G"})
    assert answer.status_code == 201, answer.text
    lease: dict[str, object] = answer.json()
    return lease


def _token(dsn: str, state_dir: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gpu_arbiter", "token", "create", "--role", "client"]
    command += ["--state-dir", str(state_dir), "--store", dsn]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_state_survives_a_kill_of_the_only_controller(
    start_server: Callable[..., Server], postgres_dsn: str
) -> None:
    server = start_server("--simulate", "2x24G:sm_86", "--store", postgres_dsn)
    with server.client() as admin:
        first = _create(admin, "one")

    server.kill9()
    server.start()  # a standby until the dead leader's term lapses, then the leader
    with server.client() as admin:
        lease = admin.get(f"/v1/leases/{first['id']}").json()
        assert (lease["state"], lease["token"]) == ("loading", first["token"])
        second = _create(admin, "two")
    assert int(str(second["token"])) > int(str(first["token"]))  # never reused


def test_tokens_are_created_in_the_database(
    start_server: Callable[..., Server], postgres_dsn: str, tmp_path: Path
) -> None:
    server = start_server("--simulate", "1x24G", "--store", postgres_dsn)
    made = _token(postgres_dsn, tmp_path / "elsewhere")  # no state directory needed
    assert made.returncode == 0, made.stderr
    with server.client(made.stdout.strip()) as client:
        assert client.get("/v1/leases").status_code == 200


def test_an_unreachable_database_is_named_without_its_password(tmp_path: Path) -> None:
    dsn = "postgresql://postgres:pw-hidden@127.0.0.1:1/none"
    made = _token(dsn, tmp_path)
    assert made.returncode != 0
    assert "cannot open postgresql://127.0.0.1:1/none" in made.stderr
    assert "pw-hidden" not in made.stderr
    server = Server(tmp_path / "state", "--store", dsn)
    named = r"cannot open postgresql://127\.0\.0\.1:1/none"
    with pytest.raises(AssertionError, match=named) as failed:
        server.start()
    assert "pw-hidden" not in str(failed.value)


def test_a_store_that_is_no_url_is_refused(tmp_path: Path) -> None:
    made = _token("postgresq://user:pw-hidden@db/x", tmp_path)
    assert made.returncode != 0
    assert "store: must be sqlite, memory or a postgresql:// URL" in made.stderr
    assert "pw-hidden" not in made.stderr
