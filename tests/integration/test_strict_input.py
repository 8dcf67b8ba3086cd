"""Input that Python reads but the standard does not, through the real server: refused
naming the field, nothing changed, every reader still answered, nothing lost at a
restart."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from .conftest import Server, gpu_figures

DEEP = 200  # parsed, then refused by the metadata bounds (8 levels)
DEEPER = 1_000  # near Python's recursion limit: refused at the parse

BODIES: dict[str, tuple[bytes, str]] = {
    "NaN in metadata": (b'{"vram_mb": "8G", "metadata": {"x": NaN}}', "metadata.x"),
    "Infinity in metadata": (
        b'{"vram_mb": "8G", "metadata": {"x": [1, Infinity]}}',
        "metadata.x[1]",
    ),
    "-Infinity in metadata": (
        b'{"vram_mb": "8G", "metadata": {"y": {"z": -Infinity}}}',
        "metadata.y.z",
    ),
    "a number beyond a float": (b'{"vram_mb": "8G", "metadata": {"x": 1e400}}', "metadata.x"),
    "NaN for a number": (b'{"vram_mb": "8G", "ttl_s": NaN}', "ttl_s"),
    "a lone surrogate": (b'{"vram_mb": "8G", "holder": "a\\ud800"}', "holder"),
    "a lone surrogate in a metadata key": (
        b'{"vram_mb": 100, "metadata": {"\\ud800": 1}}',
        "metadata",
    ),
    "a lone surrogate in a nested key beside NaN": (
        b'{"vram_mb": "8G", "metadata": {"x": {"a\\ud800": NaN}}}',
        "metadata.x",
    ),
    "a lone surrogate in a key of the body": (b'{"vram_mb": "8G", "\\udfff": 1}', "body"),
    "deep metadata": (
        b'{"vram_mb": "8G", "metadata": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}",
        "metadata.a.a.a.a.a.a.a.a",
    ),
    "deeper metadata": (
        b'{"vram_mb": "8G", "metadata": ' + b'{"a": ' * DEEPER + b"1" + b"}" * DEEPER + b"}",
        "",
    ),
    "NUL in an idempotency key": (
        b'{"vram_mb": "8G", "idempotency_key": "k\\u0000"}',
        "idempotency_key",
    ),
    "a newline in a holder": (b'{"vram_mb": "8G", "holder": "a\\nb"}', "holder"),
    "a control character in a label": (
        b'{"vram_mb": "8G", "constraints": {"labels": {"zone": "a\\u001b[31m"}}}',
        "constraints.labels.zone",
    ),
    "Arabic-Indic digits": ('{"vram_mb": "١٢G"}'.encode(), "vram_mb"),
    "full-width digits": ('{"vram_mb": "１２G"}'.encode(), "vram_mb"),
    "a superscript priority": ('{"vram_mb": "1G", "priority": "²"}'.encode(), "priority"),
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = Server(tmp_path_factory.mktemp("strict") / "state", "--simulate", "2x24G").start()
    yield started
    started.stop()


def _post(client: httpx.Client, body: bytes) -> httpx.Response:
    return client.post("/v1/leases", content=body, headers={"content-type": "application/json"})


def _everything(client: httpx.Client) -> tuple[object, ...]:
    answers = [client.get(path) for path in ("/v1/leases", "/v1/queue", "/v1/workers")]
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    status = client.get("/v1/status").json()
    return (*(a.json() for a in answers), status["last_event"], status["next_token"])


@pytest.mark.parametrize("case", sorted(BODIES))
def test_input_that_is_not_strict_is_refused_naming_the_field_and_changes_nothing(
    shared: Server, case: str
) -> None:
    body, field = BODIES[case]
    admin = shared.client()
    held = admin.post("/v1/leases", json={"vram_mb": "1G", "holder": "before"})
    assert held.status_code == 201
    before = _everything(admin)
    answer = _post(admin, body)
    assert answer.status_code in (400, 422), answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_input"
    if field:
        assert error["message"].startswith(f"{field}: "), error["message"]
        assert error["details"]["field" if "field" in error["details"] else "errors"]
    assert _everything(admin) == before
    assert admin.get("/readyz").status_code == 200
    assert admin.delete(f"/v1/leases/{held.json()['id']}").status_code == 200
    admin.close()


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_a_release_after_a_refused_request_survives_a_restart(
    start_server: Callable[..., Server], request: pytest.FixtureRequest, store: str
) -> None:
    where = () if store == "sqlite" else ("--store", request.getfixturevalue("postgres_dsn"))
    server = start_server("--simulate", "2x24G", *where)
    with server.client() as admin:
        lease = admin.post("/v1/leases", json={"vram_mb": "8G", "holder": "keep"}).json()
        for body, _field in BODIES.values():
            assert _post(admin, body).status_code in (400, 422)
        assert admin.get("/v1/leases").status_code == 200
        assert admin.get("/v1/queue").status_code == 200
        released = admin.delete(f"/v1/leases/{lease['id']}")
        assert released.status_code == 200
        assert released.json()["state"] == "released"
    server.stop()
    server.start()
    with server.client() as admin:
        again = admin.get(f"/v1/leases/{lease['id']}").json()
        assert again["state"] == "released"
        assert sum(g["committed_mb"] for g in gpu_figures(admin).values()) == 0
        assert admin.get("/v1/leases").json() == []
