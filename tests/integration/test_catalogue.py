"""The cluster's catalogue through the real server: applied as numbered revisions by an
admin, refused whole naming line and field, read by every role (a gateway's token
too), followed by a long-poll, and kept across a restart on the same state."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

import httpx

from .conftest import Server, events

CATALOGUE = """\
[models.chat]
command = "llama-server -m /models/qwen.gguf -c 8192 --port {port}"
vram = "6G"
hosts = ["local"]
labels = { zone = "a" }

[models.embed]
command = ["python", "-m", "embedder", "--port", "{port}"]
vram = "2G"
"""


def apply(client: httpx.Client, text: str, file: str = "catalogue.toml") -> httpx.Response:
    return client.put("/v1/catalogue", json={"text": text, "file": file})


def test_apply_read_history_and_revisions(server: Server, admin: httpx.Client) -> None:
    assert admin.get("/v1/catalogue").status_code == 404
    assert admin.get("/v1/catalogue/history").json() == []

    first = apply(admin, CATALOGUE)
    assert first.status_code == 201, first.text
    body = first.json()
    assert (body["outcome"], body["revision"], body["file"]) == ("applied", 1, "catalogue.toml")
    assert body["sha256"] == hashlib.sha256(CATALOGUE.encode()).hexdigest()
    assert body["applied_by"].startswith("admin") and "text" not in body

    again = apply(admin, CATALOGUE, "other.toml")
    assert again.status_code == 200
    assert (again.json()["outcome"], again.json()["revision"]) == ("unchanged", 1)

    second = apply(admin, CATALOGUE + "# one more line\n")
    assert (second.status_code, second.json()["revision"]) == (201, 2)

    current = admin.get("/v1/catalogue").json()
    assert current["revision"] == 2 and current["text"] == CATALOGUE + "# one more line\n"
    assert sorted(current["models"]) == ["chat", "embed"]
    assert current["models"]["chat"]["hosts"] == ["local"]
    assert current["models"]["chat"]["labels"] == {"zone": "a"}
    assert current["models"]["embed"]["vram_mb"] == 2048

    history = admin.get("/v1/catalogue/history").json()
    assert [r["revision"] for r in history] == [2, 1]
    assert all("text" not in r for r in history)
    one = admin.get("/v1/catalogue/revisions/1").json()
    assert one["text"] == CATALOGUE and one["revision"] == 1
    assert admin.get("/v1/catalogue/revisions/3").status_code == 404

    applied = events(admin, "catalogue.applied")
    assert [e["data"]["revision"] for e in applied] == [1, 2]
    assert applied[0]["data"]["sha256"] == body["sha256"]


def test_a_bad_catalogue_is_refused_naming_line_and_field_and_nothing_is_stored(
    admin: httpx.Client,
) -> None:
    bad = CATALOGUE.replace('vram = "2G"', 'vram = "2X"')
    answer = apply(admin, bad, "site/catalogue.toml")
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["code"] == "invalid_input"
    assert error["message"].startswith("site/catalogue.toml:9: models.embed.vram: '2X'")
    assert error["details"]["line"] == 9
    assert error["details"]["field"] == "models.embed.vram"
    assert error["details"]["file"] == "site/catalogue.toml"
    gateway_table = apply(admin, "[gateway]\nport = 8080\n" + CATALOGUE)
    assert gateway_table.status_code == 422
    assert gateway_table.json()["error"]["details"]["field"] == "gateway"
    assert admin.get("/v1/catalogue").status_code == 404
    assert admin.get("/v1/catalogue/history").json() == []
    assert events(admin, "catalogue.applied") == []


def test_only_an_admin_applies_and_only_admins_and_gateways_read_its_text(
    server: Server, admin: httpx.Client
) -> None:
    with server.client(server.token("client")) as client:
        refused = apply(client, CATALOGUE)
        assert refused.status_code == 403
        assert "may not apply the cluster's catalogue" in refused.json()["error"]["message"]
    assert apply(admin, CATALOGUE).status_code == 201
    for role, worker in (("client", None), ("worker", "local")):
        with server.client(server.token(role, worker=worker)) as other:
            for path in ("/v1/catalogue", "/v1/catalogue/revisions/1"):
                read = other.get(path)
                assert read.status_code == 403, (role, path, read.text)
                assert "may not read the cluster's catalogue" in read.json()["error"]["message"]
            assert other.get("/v1/catalogue/history").status_code == 200  # no text there
    with server.client(server.token("gateway", worker="local")) as gateway:
        assert apply(gateway, CATALOGUE + "# x\n").status_code == 403
        read = gateway.get("/v1/catalogue")
        assert read.status_code == 200 and read.json()["revision"] == 1
        assert gateway.get("/v1/catalogue/revisions/1").status_code == 200
    with server.client(None) as anonymous:
        assert anonymous.get("/v1/catalogue").status_code == 401


def test_a_catalogue_larger_than_other_bodies_is_taken_up_to_its_own_bound(
    admin: httpx.Client,
) -> None:
    big = CATALOGUE + "".join(f"# line {i} of a long comment\n" for i in range(10_000))
    assert len(big) > 64 * 1024  # beyond what other routes take
    assert apply(admin, big).status_code == 201
    for text in ("#" * ((1 << 20) + 1), "# " + "é" * 600_000):  # too many chars, bytes
        too_big = apply(admin, text)
        assert too_big.status_code == 422
        message = too_big.json()["error"]["message"]
        assert message.startswith("text: ") and "1048576" in message
    assert admin.get("/v1/catalogue").json()["revision"] == 1


async def test_a_long_poll_answers_when_a_newer_revision_is_applied(
    server: Server, admin: httpx.Client
) -> None:
    assert apply(admin, CATALOGUE).status_code == 201
    async with server.async_client(server.token("gateway", worker="local")) as reader:
        at_once = await reader.get("/v1/catalogue", params={"after": 0, "wait": 30})
        assert at_once.json()["revision"] == 1
        waiting = asyncio.ensure_future(
            reader.get("/v1/catalogue", params={"after": 1, "wait": 30})
        )
        await asyncio.sleep(0.5)
        assert not waiting.done()
        async with server.async_client() as writer:
            put = await writer.put(
                "/v1/catalogue", json={"text": CATALOGUE + "# 2\n", "file": "c.toml"}
            )
            assert put.status_code == 201
        answer = await asyncio.wait_for(waiting, 10)
        assert answer.status_code == 200 and answer.json()["revision"] == 2
        quiet = await reader.get("/v1/catalogue", params={"after": 2, "wait": 0.2})
        assert quiet.json()["revision"] == 2  # the wait's end: the current one


def test_a_restarted_controller_keeps_the_catalogue(
    start_server: Callable[..., Server], server: Server, admin: httpx.Client
) -> None:
    assert apply(admin, CATALOGUE).status_code == 201
    assert apply(admin, CATALOGUE + "# 2\n").status_code == 201
    server.stop()
    again = start_server("--simulate", "2x24G:sm_86", state_dir=server.state_dir)
    with again.client() as client:
        current = client.get("/v1/catalogue").json()
        assert current["revision"] == 2 and current["text"] == CATALOGUE + "# 2\n"
        assert [r["revision"] for r in client.get("/v1/catalogue/history").json()] == [2, 1]
        assert apply(client, CATALOGUE + "# 3\n").json()["revision"] == 3
