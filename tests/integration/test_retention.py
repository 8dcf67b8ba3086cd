"""Ended leases are forgotten after the retention period, live ones never."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from .conftest import Server, wait_for


def _lease_rows(server: Server) -> dict[str, int]:
    """How many live and final lease rows state.db holds (read-only)."""
    path = server.state_dir / "state.db"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT final, COUNT(*) FROM leases GROUP BY final").fetchall()
    counts = {"live": 0, "final": 0}
    for final, count in rows:
        counts["final" if final else "live"] = count
    return counts


def test_ended_leases_are_pruned_after_the_retention_period(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--simulate", "1x8G", "--retention", "1s")
    with server.client() as admin:
        held = admin.post("/v1/leases", json={"vram_mb": "1G", "ttl_s": 600}).json()
        for _ in range(3):
            lease = admin.post("/v1/leases", json={"vram_mb": "1G"}).json()
            assert admin.delete(f"/v1/leases/{lease['id']}").status_code == 200
        assert _lease_rows(server)["final"] >= 1

        wait_for(
            lambda: _lease_rows(server) == {"live": 1, "final": 0},
            timeout_s=15,
            what="the ended leases to be pruned",
        )
        assert admin.get(f"/v1/leases/{held['id']}").json()["state"] in ("loading", "held")
