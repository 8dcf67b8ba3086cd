"""The gateway's model files at its start: ``{file}`` placed, the files here verified,
``vram = "auto"`` estimated from a file here and the file's size until it is."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from gpu_arbiter.gateway.base.clock import LoopClock
from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.files.store import FileStore
from gpu_arbiter.gateway.files.wiring import estimated, placed


def _models(gguf: Path) -> dict[str, object]:
    data = gguf.read_bytes()
    here = {"name": "here.gguf", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    away = {"name": "away.gguf", "size": 3 << 30, "sha256": "ab" * 32}
    command = "llama-server -m {file} -c 512 --port {port}"
    return {
        "here": {"command": command, "file": here},
        "away": {"command": command, "file": away},
        "fixed": {"command": command, "file": {**away, "name": "fixed.gguf"}, "vram": "2G"},
    }


async def test_placed_and_estimated(tmp_path: Path, tiny_models: Path) -> None:
    gguf = tiny_models / "tiny-chat.gguf"
    config = parse_config({"models": _models(gguf)})
    models = placed(config.models, tmp_path)
    assert models["here"].command[2] == str((tmp_path / "here.gguf").resolve())
    assert models["here"].model_file == str((tmp_path / "here.gguf").resolve())
    shutil.copyfile(gguf, tmp_path / "here.gguf")
    store = FileStore(tmp_path, None, LoopClock())  # type: ignore[arg-type]
    for model in models.values():
        assert model.file is not None
        await store.verified(model.file)
    sizes, made = estimated(models, store)
    assert made == {"here"} and sizes["here"] > 0
    assert sizes["away"] == 3 * 1024  # its file's size in MiB, until it is here
    assert "fixed" not in sizes  # a given size is the user's
