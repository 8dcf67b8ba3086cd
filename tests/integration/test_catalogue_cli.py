"""``gpu-arbiter catalogue`` against a real controller: apply, show, history, diff."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from .conftest import Server
from .test_catalogue import CATALOGUE
from .test_cli import cli, ok


def test_apply_show_history_and_diff(server: Server, admin: httpx.Client, tmp_path: Path) -> None:
    path = tmp_path / "catalogue.toml"
    path.write_text(CATALOGUE)
    assert cli(server, "catalogue", "show").returncode == 1  # none yet

    text = ok(server, "catalogue", "apply", str(path))
    assert text.startswith(f"catalogue revision 1 applied from {path}")
    assert ok(server, "catalogue", "apply", str(path)).startswith("unchanged: revision 1")
    assert admin.get("/v1/catalogue").json()["revision"] == 1

    shown = ok(server, "catalogue", "show")
    assert "catalogue revision 1" in shown
    assert "chat" in shown and "local; zone=a" in shown and "6.0 GiB" in shown
    assert "embed" in shown and "any host" in shown
    assert ok(server, "catalogue", "show", "--text") == CATALOGUE

    # the same file: no difference, exit 0
    same = cli(server, "catalogue", "diff", str(path))
    assert same.returncode == 0 and "is the current catalogue (revision 1)" in same.stdout

    changed = CATALOGUE.replace('vram = "2G"', 'vram = "3G"').replace('hosts = ["local"]\n', "")
    changed += '\n[models.tts]\ncommand = "tts-server --port {port}"\nvram = "1G"\n'
    path.write_text(changed.replace("[models.embed]", "[models.embedder]"))
    differs = cli(server, "catalogue", "diff", str(path))
    assert differs.returncode == 1, differs.stderr
    out = differs.stdout
    assert out.startswith(f"--- revision 1\n+++ {path}\n")
    assert '-hosts = ["local"]' in out and '+vram = "3G"' in out
    assert "models added: embedder, tts" in out
    assert "models removed: embed" in out
    assert "models changed: chat" in out
    assert admin.get("/v1/catalogue").json()["revision"] == 1  # a diff changes nothing

    assert ok(server, "catalogue", "apply", str(path)).startswith("catalogue revision 2")
    history = ok(server, "catalogue", "history")
    lines = history.strip().splitlines()
    assert lines[0].split()[:4] == ["REVISION", "APPLIED", "BY", "FILE"]
    assert [line.split()[0] for line in lines[1:]] == ["2", "1"]
    as_json = json.loads(ok(server, "catalogue", "history", "-o", "json"))
    assert [r["revision"] for r in as_json] == [2, 1]
    old = ok(server, "catalogue", "show", "--revision", "1")
    assert "catalogue revision 1" in old and "embed " in old and "embedder" not in old
    assert ok(server, "catalogue", "show", "--revision", "1", "--text") == CATALOGUE


def test_a_refused_catalogue_is_one_line_naming_file_line_and_field(
    server: Server, admin: httpx.Client, tmp_path: Path
) -> None:
    path = tmp_path / "catalogue.toml"
    path.write_text(CATALOGUE.replace('vram = "6G"', 'vram = "6X"'))
    done = cli(server, "catalogue", "apply", str(path))
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: {path}:3: models.chat.vram: '6X' is not a size")
    assert admin.get("/v1/catalogue").status_code == 404
    diffed = cli(server, "catalogue", "diff", str(path))
    assert diffed.returncode == 2 and f"{path}:3: models.chat.vram" in diffed.stderr
    with_client = cli(server, "catalogue", "apply", str(path), token=server.token("client"))
    assert with_client.returncode == 1
    missing = cli(server, "catalogue", "apply", str(tmp_path / "nowhere.toml"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
