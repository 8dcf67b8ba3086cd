"""models.toml: every error names the model, the key and the reason."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.gateway.config import parse_config

COMMAND = "server --port {port}"


def test_a_full_entry() -> None:
    config = parse_config(
        {
            "gateway": {"port": 9000},
            "models": {
                "chat": {
                    "command": "llama-server -m /m.gguf -c 8192 --port {port}",
                    "vram": "6G",
                    "priority": "interactive",
                    "keep_alive": "5m",
                    "ready": "/health",
                    "max_parallel": 4,
                    "replicas": 2,
                    "aliases": ["gpt-4o-mini"],
                },
                "embed": {"command": ["embedder", "{port}"], "vram": "auto"},
            },
        }
    )
    chat = config.models["chat"]
    assert chat.vram == 6144 and chat.priority == 800 and chat.keep_alive_s == 300
    assert chat.command[-1] == "{port}" and config.port == 9000
    assert config.find("gpt-4o-mini") is chat
    assert config.models["embed"].vram is None


@pytest.mark.parametrize(
    ("entry", "field", "reason"),
    [
        ({"vram": "6X"}, "models.m.vram", "not a size"),
        ({"priority": "urgent"}, "models.m.priority", "not an integer 0..1000"),
        ({"keep_alive": "5 minutes"}, "models.m.keep_alive", "not a duration"),
        ({"max_parallel": 0}, "models.m.max_parallel", "not an integer 1..4096"),
        ({"ready": "health"}, "models.m.ready", "not a path"),
        ({"colour": "red"}, "models.m.colour", "unknown key"),
        ({"command": "server"}, "models.m.command", "must contain {port}"),
        ({"aliases": "x"}, "models.m.aliases", "must be a list"),
    ],
)
def test_errors_name_the_model_the_key_and_the_reason(
    entry: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(InvalidInput, match=reason) as raised:
        parse_config({"models": {"m": {"command": COMMAND, **entry}}})
    assert raised.value.field == field


def test_a_name_routes_to_one_model_only() -> None:
    models = {"a": {"command": COMMAND}, "b": {"command": COMMAND, "aliases": ["a"]}}
    with pytest.raises(InvalidInput, match="'a' already names a"):
        parse_config({"models": models})
    with pytest.raises(InvalidInput, match="no model"):
        parse_config({"models": {}})
