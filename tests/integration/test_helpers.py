"""The helpers that start processes for the tests leave none behind: a controller whose
start fails (it did not listen in time, on a loaded machine) is killed and reaped at once,
not left to warn as an unreaped process when the collector finds it in a later test."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import Server


def test_a_start_that_times_out_kills_and_reaps_the_controller(tmp_path: Path) -> None:
    server = Server(tmp_path / "state", "--simulate", "1x24G")
    with pytest.raises(AssertionError, match="timed out waiting for the server to listen"):
        server.start(timeout_s=0.001)  # no controller listens within a millisecond
    assert server.proc is not None
    assert server.proc.returncode is not None  # reaped, not only signalled
