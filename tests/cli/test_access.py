"""Which token the command-line tools send without being given one."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_arbiter.cli.access import credentials


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("GPU_ARBITER_TOKEN", raising=False)
    monkeypatch.delenv("GPU_ARBITER_URL", raising=False)
    monkeypatch.setenv("GPU_ARBITER_STATE_DIR", str(tmp_path))
    (tmp_path / "admin.token").write_text("gat_local\n")
    return tmp_path


def test_a_controller_on_this_machine_gets_the_local_admin_token(state: Path) -> None:
    for url in (None, "http://127.0.0.1:7070", "http://localhost:9", "http://[::1]:7070"):
        found = credentials(url, None)
        assert found.token == "gat_local" and found.found_in == state / "admin.token"


def test_the_local_admin_token_goes_to_no_other_host(state: Path) -> None:
    assert credentials("http://10.1.2.3:7070", None).token is None
    assert credentials("http://127.0.0.1:7070,http://gpu-box:7070", None).token is None


def test_a_given_token_wins(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert credentials(None, "gat_given") == credentials(None, "gat_given")
    assert credentials(None, "gat_given").found_in is None
    monkeypatch.setenv("GPU_ARBITER_TOKEN", "gat_env")
    assert credentials(None, None).token == "gat_env"


def test_no_file_no_token(state: Path) -> None:
    (state / "admin.token").unlink()
    assert credentials(None, None).token is None
