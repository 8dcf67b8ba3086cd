"""``GET /files/{name}``: for a verified peer only, with ranges, from the store."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from gpu_arbiter.gateway.cluster.cluster import Cluster
from gpu_arbiter.gateway.files.spec import ModelFile
from gpu_arbiter.gateway.files.store import FileStore
from gpu_arbiter.gateway.requests.access import Access, ApiKey
from gpu_arbiter.gateway.requests.app import GatewayApp
from gpu_arbiter.gateway.requests.files import byte_range
from gpu_arbiter.peer_identity import Identity, Relayed, decode_key
from gpu_arbiter.web.zerocopy import ZEROCOPY

from .fakes import FakeClock
from .files.test_store import FakeFetcher
from .test_app_routes import GW_2, _call, _front_door

pytestmark = pytest.mark.timeout(20)
DATA = bytes(range(256)) * 8192  # 2 MiB: more than one chunk
FILE = ModelFile("m.gguf", len(DATA), hashlib.sha256(DATA).hexdigest())
KEY = "ui-key-0123456789"


@pytest.mark.parametrize(
    ("header", "found"),
    [
        (None, None),
        ("bytes=0-9", (0, 9)),
        ("bytes=10-", (10, 99)),
        ("bytes=-10", (90, 99)),
        ("bytes=-1000", (0, 99)),
        ("bytes=90-1000", (90, 99)),
        ("bytes=100-", "beyond"),
        ("bytes=5-4", "beyond"),
        ("bytes=0-1,5-6", "not one range"),
        ("items=0-1", "not one range"),
        ("bytes=-", "names no byte"),
        ("bytes=-0", "empty suffix"),
    ],
)
def test_byte_range(header: str | None, found: object) -> None:
    got = byte_range(header, 100)
    if isinstance(found, str):
        assert isinstance(got, str) and found in got
    else:
        assert got == found


async def _app(tmp_path: Path) -> tuple[GatewayApp, Cluster]:
    app, cluster = _front_door()
    app.access = Access((ApiKey("ui", KEY, "admin"),), "127.0.0.1", ())
    (tmp_path / "m.gguf").write_bytes(DATA)
    store = FileStore(tmp_path, FakeFetcher({}, FakeClock()), FakeClock())  # type: ignore[arg-type]
    assert await store.verified(FILE)
    app.files = store
    return app, cluster


def _signed(cluster: Cluster, path: str, by: Identity = GW_2) -> tuple[tuple[bytes, bytes], ...]:
    gw1 = decode_key(cluster.identity.public_key)
    header = by.sign("gw-1", gw1, Relayed("GET", path.encode()))
    return ((b"x-arbiter-peer", header.encode()),)


async def test_a_peer_gets_the_file_whole_and_by_range(tmp_path: Path) -> None:
    app, cluster = await _app(tmp_path)
    status, body = await _call(app, "GET", "/files/m.gguf", b"", _signed(cluster, "/files/m.gguf"))
    assert (status, body) == (200, DATA)
    ranged = (*_signed(cluster, "/files/m.gguf"), (b"range", b"bytes=1048570-"))
    status, body = await _call(app, "GET", "/files/m.gguf", b"", ranged)
    assert (status, body) == (206, DATA[1048570:])


async def test_a_bad_range_is_416(tmp_path: Path) -> None:
    app, cluster = await _app(tmp_path)
    ranged = (*_signed(cluster, "/files/m.gguf"), (b"range", f"bytes={len(DATA)}-".encode()))
    status, answer = await _call(app, "GET", "/files/m.gguf", b"", ranged)
    assert status == 416 and answer["error"]["code"] == "range_not_satisfiable"


async def test_a_key_without_peer_proof_is_403(tmp_path: Path) -> None:
    app, cluster = await _app(tmp_path)
    bearer = ((b"authorization", f"Bearer {KEY}".encode()),)
    status, answer = await _call(app, "GET", "/files/m.gguf", b"", bearer)
    assert status == 403 and "peer gateways only" in answer["error"]["message"]
    forged = _signed(cluster, "/files/m.gguf", Identity("gw-2"))  # not gw-2's key
    status, answer = await _call(app, "GET", "/files/m.gguf", b"", forged)
    assert status == 403 and answer["error"]["code"] == "invalid_peer"
    other = _signed(cluster, "/files/other.gguf")  # signed for another path
    status, answer = await _call(app, "GET", "/files/m.gguf", b"", other)
    assert status == 403 and answer["error"]["code"] == "invalid_peer"


async def test_only_held_files(tmp_path: Path) -> None:
    app, cluster = await _app(tmp_path)
    (tmp_path / "x.part").write_bytes(b"x")
    for path in ("/files/x.part", "/files/../m.gguf", "/files/nothing"):
        status, _ = await _call(app, "GET", path, b"", _signed(cluster, path))
        assert status == 404, path


async def test_where_the_server_offers_zero_copy_the_range_is_handed_to_it(tmp_path: Path) -> None:
    """The answer's bytes as the server would send them: the file the message names,
    read from its offset for its count (``web/zerocopy.py`` sends them with sendfile)."""
    app, cluster = await _app(tmp_path)
    sent: list[bytes] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == ZEROCOPY:
            assert message["more_body"] is False
            sent.append(os.pread(message["file"].fileno(), message["count"], message["offset"]))
        elif message["type"] == "http.response.start":
            sent.append(b"%d" % message["status"])

    for ranged, status, body in (
        (None, b"200", DATA),
        (b"bytes=5-1048580", b"206", DATA[5:1048581]),
    ):
        headers = [*_signed(cluster, "/files/m.gguf"), *([(b"range", ranged)] if ranged else [])]
        scope = {"type": "http", "method": "GET", "path": "/files/m.gguf", "headers": headers,
                 "extensions": {ZEROCOPY: {}}}  # fmt: skip
        sent.clear()
        await app(scope, receive, send)
        assert sent == [status, body]
