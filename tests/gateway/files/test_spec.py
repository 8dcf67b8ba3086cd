"""A model entry's ``file`` and the gateway's ``models_dir`` and ``disk_budget``: every
error names the key and the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.files.spec import ModelFile, placed_command

SHA = "ab" * 32
FILE = {"name": "qwen-0.5b.gguf", "size": 4_100_000_000, "sha256": SHA}
COMMAND = "llama-server -m {file} --port {port}"


def config(file: Any = FILE, gateway: dict[str, Any] | None = None, **more: Any) -> Any:
    entry = {"command": COMMAND, "file": file, **more}
    return parse_config({"gateway": gateway or {}, "models": {"chat": entry}}, base=Path("/c"))


def test_a_file_entry() -> None:
    found = config({**FILE, "url": "https://example.com/q.gguf", "sha256": SHA.upper()})
    assert found.models["chat"].file == ModelFile(
        "qwen-0.5b.gguf", 4_100_000_000, SHA, "https://example.com/q.gguf"
    )
    assert found.models_dir is None and found.disk_budget is None


def test_models_dir_and_budget() -> None:
    found = config(gateway={"models_dir": "models", "disk_budget": "200G"})
    assert found.models_dir == Path("/c/models")
    assert found.disk_budget == 200 << 30
    assert config(gateway={"disk_budget": 1000}).disk_budget == 1000


@pytest.mark.parametrize(
    ("file", "field", "reason"),
    [
        ("q.gguf", "models.chat.file", "must be a table"),
        ({**FILE, "name": "a/b.gguf"}, "models.chat.file.name", "no slashes"),
        ({**FILE, "name": "../b.gguf"}, "models.chat.file.name", "no slashes"),
        ({**FILE, "name": ".hidden"}, "models.chat.file.name", "plain file name"),
        ({**FILE, "name": "x.part"}, "models.chat.file.name", "plain file name"),
        ({**FILE, "name": 3}, "models.chat.file.name", "must be a string"),
        ({**FILE, "size": 0}, "models.chat.file.size", "more than 0"),
        ({**FILE, "size": -1}, "models.chat.file.size", "more than 0"),
        ({**FILE, "size": "4G"}, "models.chat.file.size", "whole number of bytes"),
        ({**FILE, "size": True}, "models.chat.file.size", "whole number of bytes"),
        ({**FILE, "sha256": "ab"}, "models.chat.file.sha256", "64 hex"),
        ({**FILE, "sha256": "zz" * 32}, "models.chat.file.sha256", "64 hex"),
        ({**FILE, "url": "ftp://x/y"}, "models.chat.file.url", "http:// or https://"),
        ({**FILE, "url": "https://"}, "models.chat.file.url", "http:// or https://"),
        ({"size": 1, "sha256": SHA}, "models.chat.file.name", "missing"),
        ({**FILE, "mirror": "x"}, "models.chat.file.mirror", "unknown key"),
    ],
)
def test_bad_file(file: Any, field: str, reason: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        config(file)
    assert raised.value.field == field
    assert reason in raised.value.reason


@pytest.mark.parametrize(
    ("gateway", "field", "reason"),
    [
        ({"disk_budget": "lots"}, "gateway.disk_budget", "not a size"),
        ({"disk_budget": 0}, "gateway.disk_budget", "more than 0"),
        ({"disk_budget": True}, "gateway.disk_budget", "boolean"),
        ({"models_dir": ""}, "gateway.models_dir", "non-empty"),
    ],
)
def test_bad_gateway_keys(gateway: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        config(gateway=gateway)
    assert (raised.value.field, reason in raised.value.reason) == (field, True)


def test_file_placeholder_needs_a_file() -> None:
    with pytest.raises(InvalidInput) as raised:
        parse_config({"models": {"chat": {"command": COMMAND}}})
    assert raised.value.field == "models.chat.command"
    assert "no file" in raised.value.reason


def test_file_and_model_file_are_one_too_many() -> None:
    with pytest.raises(InvalidInput) as raised:
        config(model_file="/m.gguf")
    assert raised.value.field == "models.chat.model_file"


def test_two_models_disagreeing_on_one_file() -> None:
    other = {"command": COMMAND, "file": {**FILE, "size": 5}}
    with pytest.raises(InvalidInput) as raised:
        parse_config({"models": {"chat": {"command": COMMAND, "file": FILE}, "b": other}})
    assert raised.value.field == "models.b.file.name"
    shared = {"command": COMMAND, "file": FILE}
    assert parse_config({"models": {"a": shared, "b": shared}}).models["b"].file is not None


def test_model_file_still_works_without_file() -> None:
    entry = {"command": "llama-server -m /m.gguf --port {port}", "model_file": "/m.gguf"}
    model = parse_config({"models": {"chat": entry}}).models["chat"]
    assert (model.model_file, model.file) == ("/m.gguf", None)


def test_placed_command(tmp_path: Path) -> None:
    path = tmp_path / "q.gguf"
    assert placed_command(("s", "-m", "{file}", "--port", "{port}"), path) == (
        "s", "-m", str(path), "--port", "{port}",
    )  # fmt: skip
