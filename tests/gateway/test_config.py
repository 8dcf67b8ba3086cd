"""models.toml: every error names the model, the key and the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.gateway.cluster.liveness import LivenessSettings
from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.profile import Affinity

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
        ({"pinned": "yes"}, "models.m.pinned", "not true or false"),
        ({"min_resident": "soon"}, "models.m.min_resident", "not a duration"),
        ({"min_resident": -3}, "models.m.min_resident", "not negative"),
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


def test_a_gateway_table_alone_is_a_gateway_of_no_model_yet() -> None:
    """Its models come from the cluster's catalogue (``live.py``)."""
    assert parse_config({"gateway": {"port": 9001}}).models == {}
    assert parse_config({"models": {}}).models == {}
    assert parse_config({}).port == 8080


def test_the_catalogue_is_followed_unless_turned_off() -> None:
    assert parse_config({}).catalogue is True
    assert parse_config({"gateway": {"catalogue": False}}).catalogue is False
    with pytest.raises(InvalidInput) as refused:
        parse_config({"gateway": {"catalogue": "no"}})
    assert refused.value.field == "gateway.catalogue"
    assert "true or false" in refused.value.reason


def test_the_ports_bounds_keys_and_host_names(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# the chat UI\nfile-key-0123456789\n\n  second-file-key-42  \n")
    gateway = {
        "api_keys": ["plain-key-0123456789"],
        "keys": [{"key": "named-key-0123456789", "name": "chat-ui"}],
        "api_key_file": "keys.txt",
        "allowed_hosts": ["gpu.example"],
        "max_connections": 50,
        "max_header_bytes": 8192,
        "max_headers": 20,
        "header_timeout": "2s",
        "max_body_bytes": "8M",
        "max_buffered_bytes": 1 << 30,
    }
    config = parse_config({"gateway": gateway, "models": MODELS}, base=tmp_path)
    assert [key.name for key in config.keys] == [
        "gateway.api_keys[0]", "chat-ui", f"{keys}:2", f"{keys}:4",
    ]  # fmt: skip
    assert config.keys[3].key == "second-file-key-42"
    assert "key-0123456789" not in repr(config)  # a key is never shown
    assert (config.max_connections, config.max_header_bytes, config.max_headers) == (50, 8192, 20)
    assert (config.header_timeout_s, config.max_body_bytes) == (2.0, 8 << 20)
    assert config.max_buffered_bytes == 1 << 30 and config.allowed_hosts == ("gpu.example",)
    defaults = parse_config({"models": MODELS})
    assert defaults.keys == () and defaults.max_connections == 1000
    assert (defaults.max_body_bytes, defaults.max_buffered_bytes) == (64 << 20, 256 << 20)


MODELS = {"m": {"command": COMMAND}}


@pytest.mark.parametrize(
    ("gateway", "field", "reason"),
    [
        ({"api_keys": "k" * 10}, "gateway.api_keys", "must be a list"),
        ({"api_keys": ["short"]}, "gateway.api_keys[0]", "8 to 4096 printable ASCII"),
        ({"api_keys": ["with space 123"]}, "gateway.api_keys[0]", "no space"),
        ({"api_keys": ["k" * 10, "k" * 10]}, "gateway.api_keys[1]", "the same key as"),
        ({"keys": [{"name": "ui"}]}, "gateway.keys[0].key", "missing"),
        ({"keys": [{"key": "k" * 10, "owner": "x"}]}, "gateway.keys[0].owner", "unknown key"),
        ({"keys": [{"key": "k" * 10, "role": "root"}]}, "gateway.keys[0].role", "admin or user"),
        (
            {"keys": [{"key": "k" * 10, "priority": "urgent"}]},
            "gateway.keys[0].priority",
            "not an integer 0..1000 nor one of batch",
        ),
        ({"keys": [{"key": "k" * 10, "priority": 1001}]}, "gateway.keys[0].priority", "0..1000"),
        ({"keys": [{"key": "k" * 10, "priority": True}]}, "gateway.keys[0].priority", "boolean"),
        ({"api_key_file": "nowhere.txt"}, "gateway.api_key_file", "cannot read"),
        ({"max_connections": 0}, "gateway.max_connections", "not an integer 1.."),
        ({"max_header_bytes": 10}, "gateway.max_header_bytes", "between 1024 and"),
        ({"max_headers": "many"}, "gateway.max_headers", "not an integer 8.."),
        ({"header_timeout": "0s"}, "gateway.header_timeout", "between 0.1 and 3600"),
        ({"max_body_bytes": "6X"}, "gateway.max_body_bytes", "not a size"),
        (
            {"max_body_bytes": "64M", "max_buffered_bytes": "32M"},
            "gateway.max_buffered_bytes",
            "at least max_body_bytes",
        ),
        ({"allowed_hosts": [""]}, "gateway.allowed_hosts", "list of host names"),
        ({"api_keyz": []}, "gateway.api_keyz", "unknown key"),
    ],
)
def test_port_errors_name_the_key_and_never_show_a_key(
    gateway: dict[str, Any], field: str, reason: str, tmp_path: Path
) -> None:
    with pytest.raises(InvalidInput, match=reason) as raised:
        parse_config({"gateway": gateway, "models": MODELS}, base=tmp_path)
    assert raised.value.field == field
    assert "k" * 10 not in str(raised.value)


def test_a_key_file_without_keys_is_refused(tmp_path: Path) -> None:
    (tmp_path / "keys.txt").write_text("# nothing yet\n\n")
    with pytest.raises(InvalidInput, match="holds no key") as raised:
        parse_config({"gateway": {"api_key_file": "keys.txt"}, "models": MODELS}, base=tmp_path)
    assert raised.value.field == "gateway.api_key_file"


def test_pinned_min_resident_and_key_roles() -> None:
    models = {"m": {"command": COMMAND, "pinned": True, "min_resident": "2m"}}
    keys = [
        {"key": "admin-key-0123456789", "name": "ops", "role": "admin"},
        {"key": "user-key-0123456789", "name": "ui"},
    ]
    config = parse_config(
        {"gateway": {"keys": keys, "api_keys": ["plain-key-0123"]}, "models": models}
    )
    assert config.models["m"].pinned is True and config.models["m"].min_resident_s == 120
    assert [(key.name, key.role) for key in config.keys] == [
        ("gateway.api_keys[0]", "user"), ("ops", "admin"), ("ui", "user"),
    ]  # fmt: skip
    defaults = parse_config({"models": MODELS}).models["m"]
    assert defaults.pinned is False and defaults.min_resident_s == 0


def test_a_key_carries_its_callers_priority_class() -> None:
    keys = [
        {"key": "chat-key-0123456789", "name": "chat-ui", "priority": "interactive"},
        {"key": "batch-key-0123456789", "name": "indexer", "priority": 150},
        {"key": "plain-key-0123456789", "name": "ops", "role": "admin"},
    ]
    config = parse_config(
        {"gateway": {"keys": keys, "api_keys": ["list-key-0123"]}, "models": MODELS}
    )
    assert [(key.name, key.priority) for key in config.keys] == [
        ("gateway.api_keys[0]", None),
        ("chat-ui", 800),
        ("indexer", 150),
        ("ops", None),
    ]  # None: the model's priority


def test_prefix_affinity_is_off_unless_asked_for() -> None:
    assert parse_config({"models": MODELS}).affinity is None
    on = parse_config({"gateway": {"prefix_affinity": True}, "models": MODELS})
    assert on.affinity == Affinity(1024)
    chars = {"prefix_affinity": True, "prefix_chars": 64}
    assert parse_config({"gateway": chars, "models": MODELS}).affinity == Affinity(64)
    off = parse_config({"gateway": {"prefix_affinity": False}, "models": MODELS})
    assert off.affinity is None


@pytest.mark.parametrize(
    ("gateway", "field", "reason"),
    [
        ({"prefix_affinity": "yes"}, "gateway.prefix_affinity", "true or false, not 'yes'"),
        ({"prefix_affinity": 1}, "gateway.prefix_affinity", "true or false"),
        ({"prefix_affinity": True, "prefix_chars": 8}, "gateway.prefix_chars", "16..1048576"),
        ({"prefix_affinity": True, "prefix_chars": "1k"}, "gateway.prefix_chars", "whole"),
        ({"prefix_affinity": True, "prefix_chars": True}, "gateway.prefix_chars", "whole"),
        ({"prefix_chars": 64}, "gateway.prefix_chars", "only with prefix_affinity = true"),
    ],
)
def test_prefix_affinity_errors_name_the_field(
    gateway: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(InvalidInput, match=reason) as raised:
        parse_config({"gateway": gateway, "models": MODELS})
    assert raised.value.field == field


def test_the_liveness_check_of_the_other_gateways_has_defaults_and_takes_durations() -> None:
    assert parse_config({"models": MODELS}).liveness == LivenessSettings(1.0, 3.0, 5.0)
    keys = {"peer_check": "0.5s", "peer_timeout": "2s", "peer_cut": 10}
    found = parse_config({"gateway": keys, "models": MODELS}).liveness
    assert found == LivenessSettings(0.5, 2.0, 10.0)


@pytest.mark.parametrize(
    ("gateway", "field", "reason"),
    [
        ({"peer_check": "0s"}, "gateway.peer_check", "between 0.1 and 3600 seconds"),
        ({"peer_timeout": "soon"}, "gateway.peer_timeout", "not a duration"),
        ({"peer_cut": -1}, "gateway.peer_cut", "not negative"),
        ({"peer_check": "5s"}, "gateway.peer_timeout", "at least peer_check"),
        ({"peer_check": "2s", "peer_timeout": "1s"}, "gateway.peer_timeout", "one ask at a time"),
    ],
)
def test_liveness_errors_name_the_field(gateway: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(InvalidInput, match=reason) as raised:
        parse_config({"gateway": gateway, "models": MODELS})
    assert raised.value.field == field


def test_the_url_other_gateways_reach_it_by() -> None:
    assert parse_config({"models": MODELS}).url is None
    found = parse_config({"gateway": {"url": "http://box-1.example:8080/"}, "models": MODELS})
    assert found.url == "http://box-1.example:8080"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("box-1:8080", "not http"),
        ("ftp://box-1", "not http"),
        ("http://box-1:99999", "no valid port"),
        ("http://box-1:8080/v1", "not http"),
        ("https://box-1:8080", "must be http without tls_cert"),
        (8080, "non-empty string"),
    ],
)
def test_a_bad_url_is_refused_naming_the_field(url: object, reason: str) -> None:
    with pytest.raises(InvalidInput, match=reason) as raised:
        parse_config({"gateway": {"url": url}, "models": MODELS})
    assert raised.value.field == "gateway.url"
