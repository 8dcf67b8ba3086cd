"""``gpu-arbiter token list`` and ``token revoke`` beside a running controller."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

from gpu_arbiter.server.auth import TOKEN_RECHECK_S

from .conftest import SRC, Server, wait_for


def _token(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gpu_arbiter", "token", *args]
    command += ["--state-dir", str(server.state_dir)]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_a_revoked_token_is_refused_by_the_running_controller(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--simulate", "1x8G")
    token = server.token("client")
    with server.client(token) as client:
        assert client.get("/v1/leases").status_code == 200  # known, and cached

        listed = _token(server, "list")
        assert listed.returncode == 0, listed.stderr
        assert token not in listed.stdout
        ids = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
        client_id = next(i for i in ids if i.startswith("client-"))

        revoked = _token(server, "revoke", client_id)
        assert revoked.returncode == 0, revoked.stderr
        started = time.monotonic()
        wait_for(
            lambda: client.get("/v1/leases").status_code == 401,
            timeout_s=TOKEN_RECHECK_S + 2.0,  # the recheck period, and room for a busy host
            what="the revoked token to be refused",
        )
        assert time.monotonic() - started < TOKEN_RECHECK_S + 2.0
    assert client_id not in _token(server, "list").stdout
    with server.client() as admin:  # the others still work
        assert admin.get("/v1/leases").status_code == 200


def test_revoking_an_unknown_token_is_one_line_and_exit_1(
    start_server: Callable[..., Server],
) -> None:
    server = start_server()
    done = _token(server, "revoke", "client-nope")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: no token client-nope (see gpu-arbiter token list)"
    ]
