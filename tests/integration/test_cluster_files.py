"""Model files that travel: real controller, agents and gateways (127.0.0.2, 127.0.0.3)
and llama.cpp's real server on a tiny GGUF. gw-2 holds the file; gw-3 lacks it and
copies it from gw-2 (the peer its view says holds it) before it asks for its lease,
then serves the model. ``GET /files/NAME`` is refused without a peer's proof (403) and
for a range beyond the file (416). A peer of the test's own (gw-9: a name reported with
gw-3's gateway token, its own key, a small HTTP server) first serves corrupt bytes
(refused: nothing under the real name), then closes the stream half-way (the copy
stops, its ``.part`` kept), then serves the rest from where it stopped, slowly (resumed;
a streaming caller reads how far the copy is in its comment lines)."""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_arbiter.peer_identity import Identity, Relayed, decode_key

from .cluster import served_by
from .conftest import wait_for
from .gateways import chat
from .test_cluster import Cluster
from .test_cluster_trust import cluster

__all__ = ["cluster"]
pytestmark = pytest.mark.timeout(300)
NAME = "tiny.gguf"


def _entry(llama: Path, data: bytes, **file: Any) -> str:
    spec = {"name": NAME, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), **file}
    table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in spec.items())
    command = [str(llama), "-m", "{file}", "-c", "512", "--port", "{port}", "-t", "1"]
    return (
        f"[models.tiny]\ncommand = {json.dumps(command)}\nfile = {{ {table} }}\n"
        'vram = "auto"\nidle_after = "0.3s"\ngrace = "2s"\nqueue_timeout = "120s"\n'
    )


def _files(admin: httpx.Client, gateway: str) -> list[dict[str, Any]]:
    found = next((g for g in admin.get("/v1/gateways").json() if g["name"] == gateway), {})
    return list(found.get("files") or [])


def _ask(gateway_url: str, model: str) -> httpx.Response:
    return httpx.post(gateway_url + "/v1/chat/completions", json=chat(model, max_tokens=4),
                      timeout=120)  # fmt: skip


def test_a_model_file_is_copied_from_the_peer_that_holds_it(
    cluster: Cluster, llama_server: Path, tiny_models: Path
) -> None:
    data = (tiny_models / "tiny-chat.gguf").read_bytes()
    entry = _entry(llama_server, data)
    models = cluster.root / "host-2" / "state" / "models"
    models.mkdir(parents=True)
    shutil.copyfile(tiny_models / "tiny-chat.gguf", models / NAME)  # put there by hand
    holder = cluster.host(2, "1x24G:sm_86", entry)
    lacking = cluster.host(3, "1x24G:sm_86", entry)
    cluster.settled("tiny")  # each front door has its view of the other
    expected = {"name": NAME, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    wait_for(lambda: _files(cluster.admin, "gw-2") == [expected], 20, "gw-2 reports its file")
    assert _files(cluster.admin, "gw-3") == []

    # GET /files/NAME: no peer proof, 403 (no key is needed on loopback, none opens it)
    url = holder.gateway.url + f"/files/{NAME}"
    refused = httpx.get(url, timeout=30)
    assert refused.status_code == 403, refused.text
    assert "peer gateways only" in refused.json()["error"]["message"]
    # a peer's proof (gw-9: reported with gw-3's own token, with its own key)
    own = Identity("gw-9")
    stolen = lacking.gateway.token_file.read_text().strip()
    with cluster.server.client(stolen) as reporter:
        body = {"url": "http://127.0.0.66:9", "worker": "box-3", "public_key": own.public_key}
        assert reporter.put("/v1/gateways/gw-9", json=body).status_code == 200

    def as_peer(range_: str) -> httpx.Response:
        view = cluster.admin.get("/v1/gateways/gw-2/cluster").json()
        key = decode_key(next(g for g in view["gateways"] if g["name"] == "gw-2")["public_key"])
        signed = own.sign("gw-2", key, Relayed("GET", f"/files/{NAME}".encode()))
        return httpx.get(url, headers={"x-arbiter-peer": signed, "range": range_}, timeout=30)

    wait_for(lambda: as_peer("bytes=0-9").status_code == 206, 20, "gw-9 known to gw-2")
    ranged = as_peer("bytes=10-19")
    assert ranged.content == data[10:20]
    assert ranged.headers["content-range"] == f"bytes 10-19/{len(data)}"
    beyond = as_peer(f"bytes={len(data)}-")
    assert beyond.status_code == 416, beyond.text
    assert beyond.headers["content-range"] == f"bytes */{len(data)}"

    # a request for gw-3's own copy: the file comes from gw-2 first, then the lease
    answer = _ask(lacking.gateway.url, "tiny@gw-3")
    assert answer.status_code == 200, answer.text
    assert served_by(answer) == "gw-3/tiny"
    copied = cluster.root / "host-3" / "state" / "models" / NAME
    assert copied.read_bytes() == data
    assert not copied.with_name(NAME + ".part").exists()
    log = lacking.gateway.started_log()
    assert f"model file {copied}: in place" in log, log[-3000:]
    wait_for(lambda: _files(cluster.admin, "gw-3") == [expected], 20, "gw-3 reports it")


class FakePeer(http.server.ThreadingHTTPServer):
    """gw-9's files: ``mode`` corrupt (the bytes reversed), cut (the first answer closes
    after ``cut_at`` bytes), or good; ``ranges``: the Range headers it was sent."""

    def __init__(self, address: str, data: bytes) -> None:
        super().__init__((address, 0), _Handler)
        self.data = data
        self.mode = "good"
        self.cut_at = len(data) // 2
        self.ranges: list[str] = []


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakePeer

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        peer, data = self.server, self.server.data
        if self.path != f"/files/{NAME}":  # the liveness check (/healthz)
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
            return
        asked = self.headers.get("range") or ""
        peer.ranges.append(asked)
        start = int(asked[len("bytes=") :].rstrip("-")) if asked else 0
        body = data[::-1] if peer.mode == "corrupt" else data
        self.send_response(206 if start else 200)
        self.send_header("content-length", str(len(data) - start))
        if start:
            self.send_header("content-range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if peer.mode == "cut":
            peer.mode = "slow"
            self.wfile.write(body[start : peer.cut_at])
            self.wfile.flush()
            self.close_connection = True
            return
        if peer.mode == "slow":  # eight pieces 0.3 s apart: a copy a caller waits on
            step = -(-(len(data) - start) // 8)
            for at in range(start, len(data), step):
                self.wfile.write(body[at : at + step])
                self.wfile.flush()
                time.sleep(0.3)
            return
        self.wfile.write(body[start:])


def test_a_corrupt_copy_is_refused_and_a_cut_one_resumed(
    cluster: Cluster, llama_server: Path, tiny_models: Path
) -> None:
    data = (tiny_models / "tiny-chat.gguf").read_bytes()
    lacking = cluster.host(3, "1x24G:sm_86", _entry(llama_server, data))
    cluster.settled("tiny")
    peer = FakePeer("127.0.0.9", data)
    serving = threading.Thread(target=peer.serve_forever, daemon=True)
    serving.start()
    own = Identity("gw-9")
    stolen = lacking.gateway.token_file.read_text().strip()
    described = {"name": NAME, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    models = cluster.root / "host-3" / "state" / "models"
    try:
        with cluster.server.client(stolen) as reporter:
            body = {"url": f"http://127.0.0.9:{peer.server_address[1]}", "worker": "box-3",
                    "public_key": own.public_key, "files": [described]}  # fmt: skip
            assert reporter.put("/v1/gateways/gw-9", json=body).status_code == 200
        view = cluster.admin.get("/v1/gateways/gw-3/cluster").json()
        assert any(g.get("files") == [described] for g in view["gateways"])
        time.sleep(2.0)  # gw-3's long-poll brings it the view within a second

        peer.mode = "corrupt"
        answer = _ask(lacking.gateway.url, "tiny@gw-3")
        assert answer.status_code == 502, answer.text
        message = answer.json()["error"]["message"]
        assert "not the model's sha256" in message and "gw-9" in message, message
        assert not (models / NAME).exists() and not (models / f"{NAME}.part").exists()

        time.sleep(1.2)  # the model's back-off after a failed start
        peer.mode = "cut"
        answer = _ask(lacking.gateway.url, "tiny@gw-3")
        assert answer.status_code == 502, answer.text
        assert "kept to resume" in answer.json()["error"]["message"], answer.text
        assert (models / f"{NAME}.part").stat().st_size == peer.cut_at
        assert not (models / NAME).exists()

        time.sleep(2.2)
        # a streaming caller is told how far the copy is
        body = chat("tiny@gw-3", max_tokens=4, stream=True)
        with httpx.stream("POST", lacking.gateway.url + "/v1/chat/completions", json=body,
                          timeout=120) as streamed:  # fmt: skip
            assert streamed.status_code == 200
            said = [line for line in streamed.iter_lines() if line.startswith(":")]
        copying = [line for line in said if line.startswith(": copying tiny's file to box-3: ")]
        assert copying, said
        assert "of 0.5 MiB" in copying[-1] and "MB/s (from gw-9)" in copying[-1], copying
        assert peer.ranges == ["", "", f"bytes={peer.cut_at}-"]  # resumed where it stopped
        assert (models / NAME).read_bytes() == data
    finally:
        peer.shutdown()
        peer.server_close()
