"""``gpu-arbiter status``'s view: the totals offer no room on GPUs that take no new work."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from gpu_arbiter.cli.ops import status_view


def _gpu(gpu_id: str, free_mb: int, *, stale: bool = False) -> dict[str, Any]:
    return {
        "id": gpu_id,
        "total_mb": 24576,
        "committed_mb": 24576 - free_mb,
        "used_mb": None,
        "free_mb": free_mb,
        "loading": 0,
        "stale": stale,
    }


def _worker(name: str, state: str, *gpus: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "state": state, "last_heartbeat_at": None, "gpus": list(gpus)}


def test_free_memory_is_totalled_only_on_gpus_that_take_new_work() -> None:
    workers = [
        _worker("box-1", "online", _gpu("box-1:0", 4096), _gpu("box-1:1", 8192, stale=True)),
        _worker("old", "offline", _gpu("old:0", 24576)),
        _worker("leaving", "draining", _gpu("leaving:0", 24576)),
    ]
    console = Console(width=200, record=True)
    console.print(status_view(workers, {"leases_by_state": {}, "pending": 0}))
    text = console.export_text()
    assert "free 4.0 GiB of 96.0 GiB (free: on GPUs that take new work)" in text
    assert "old:0" in text and "free 24.0 GiB / 24.0 GiB" in text  # each GPU as it is
