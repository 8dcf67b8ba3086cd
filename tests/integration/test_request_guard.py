"""What a web page could make a browser send is refused: cross-site forms (CSRF) and
requests under a rebound DNS name, with or without auth."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest

from .conftest import SRC, Server

FORM = {"Content-Type": "application/x-www-form-urlencoded"}


@pytest.fixture
def open_server(start_server: Callable[..., Server]) -> Server:
    return start_server("--no-auth", "--simulate", "1x8G", "--allowed-hosts", "gpu.example")


def _paused(server: Server) -> bool:
    paused: bool = httpx.get(server.url + "/v1/status").json()["paused"]
    return paused


def _port(server: Server) -> str:
    return server.url.rsplit(":", 1)[1]


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        (FORM, b"paused=1"),  # a cross-site <form method=post>
        ({"Content-Type": "text/plain"}, b"{}"),  # <form enctype=text/plain>, or fetch
        ({"Content-Type": "multipart/form-data; boundary=x"}, b"--x--\r\n"),
        ({}, b""),  # fetch(url, {method: "POST", mode: "no-cors"})
    ],
)
def test_a_change_a_browser_could_send_cross_site_is_refused(
    open_server: Server, headers: dict[str, str], body: bytes
) -> None:
    answer = httpx.post(open_server.url + "/v1/pause", headers=headers, content=body)

    assert answer.status_code == 415
    assert answer.json()["error"]["code"] == "unsupported_media_type"
    assert not _paused(open_server)


def test_a_rebound_host_name_is_refused_even_for_reads(open_server: Server) -> None:
    evil = {"Host": f"attacker.example:{_port(open_server)}"}
    pause = httpx.post(open_server.url + "/v1/pause", json={}, headers=evil)
    read = httpx.get(open_server.url + "/v1/leases", headers=evil)

    assert (pause.status_code, read.status_code) == (421, 421)
    assert pause.json()["error"]["code"] == "misdirected_request"
    assert not _paused(open_server)


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "gpu.example", "GPU.example."])
def test_the_controllers_own_names_are_answered(open_server: Server, host: str) -> None:
    answer = httpx.get(open_server.url + "/v1/status", headers={"Host": f"{host}:7070"})
    assert answer.status_code == 200


def test_the_cli_and_a_json_change_still_work_without_auth(open_server: Server) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "GPU_ARBITER_URL": open_server.url}
    env.pop("GPU_ARBITER_TOKEN", None)
    command = [sys.executable, "-m", "gpu_arbiter", "pause"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert _paused(open_server)
    assert httpx.post(open_server.url + "/v1/resume", json={}).status_code == 200
    assert not _paused(open_server)


def test_with_auth_the_token_is_what_a_browser_cannot_send(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--simulate", "1x8G")
    assert httpx.post(server.url + "/v1/pause", headers=FORM, content=b"x=1").status_code == 401
    with server.client() as admin:
        assert admin.post("/v1/pause").status_code == 200  # no body: the bearer token says
        assert admin.post("/v1/resume", headers=FORM, content=b"x=1").status_code == 415
        assert admin.get("/v1/status", headers={"Host": "attacker.example"}).status_code == 421
