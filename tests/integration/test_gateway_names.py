"""A gateway name stays its token's across a controller killed (``kill -9``) and started
again on the same SQLite file: another gateway token is refused it (403 naming the name
and the token that holds it) until an admin forgets it."""

from __future__ import annotations

from collections.abc import Callable

from .conftest import Server, events


def _report(worker: str) -> dict[str, object]:
    return {"url": f"http://{worker}.internal:8080", "host": worker, "worker": worker}


def test_a_gateway_name_survives_a_kill_and_restart_until_an_admin_forgets_it(
    start_server: Callable[..., Server],
) -> None:
    server = start_server()
    token_a = server.token("gateway", "box-1")
    token_b = server.token("gateway", "box-2")
    with server.client(token_a) as a:
        assert a.put("/v1/gateways/gw-x", json=_report("box-1")).status_code == 200
    server.kill9()  # at once after the answer: what was answered is stored

    server.start()
    with server.client() as admin:
        (taken,) = events(admin, "gateway.name_taken")
    owner_a = taken["data"]["owner"]
    assert taken["data"]["name"] == "gw-x" and owner_a.startswith("gateway-")
    with server.client(token_b) as b:
        refused = b.put("/v1/gateways/gw-x", json=_report("box-2"))
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert "gateway gw-x belongs to another token" in error["message"]
        assert owner_a in error["message"]
        assert error["details"]["owner"] == owner_a
        assert "gpu-arbiter gateways forget gw-x" in error["message"]
    with server.client() as admin:
        assert admin.get("/v1/gateways").json() == []  # B's refused report changed nothing
        assert admin.delete("/v1/gateways/gw-x").status_code == 200
    with server.client(token_b) as b:
        taken_b = b.put("/v1/gateways/gw-x", json=_report("box-2"))
        assert taken_b.status_code == 200, taken_b.text
    server.kill9()

    server.start()  # B holds it now, across the restart too
    with server.client(token_a) as a:
        refused = a.put("/v1/gateways/gw-x", json=_report("box-1"))
        assert refused.status_code == 403
        assert refused.json()["error"]["details"]["owner"] != owner_a
    with server.client() as admin:
        forgotten = events(admin, "gateway.name_forgotten")
        assert [e["data"]["owner"] for e in forgotten] == [owner_a]
