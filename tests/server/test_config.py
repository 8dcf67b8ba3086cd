"""Settings of ``serve``: precedence, the simulate spec, loopback, tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.server.auth import Authenticator, Unauthorized, create_token
from gpu_arbiter.server.config import ServeConfig, is_loopback, parse_simulate
from gpu_arbiter.store import MemoryStore


def test_command_line_beats_file_beats_default(tmp_path: Path) -> None:
    config = tmp_path / "arbiter.toml"
    config.write_text('[serve]\nport = 9000\nhost = "127.0.0.2"\nsimulate = "1x8G"\n')
    settings = ServeConfig.resolve({"port": 9100, "host": None}, config)
    assert settings.port == 9100
    assert settings.host == "127.0.0.2"
    assert settings.simulate == "1x8G"
    assert settings.store == "sqlite"


def test_unknown_file_settings_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "arbiter.toml"
    config.write_text("prot = 9000\n")
    with pytest.raises(InvalidInput, match="prot"):
        ServeConfig.resolve({}, config)


def test_simulate_spec() -> None:
    gpus = parse_simulate("2x24G:sm_86,1x80G:sm_90")
    assert [(g.index, g.total_mb, g.arch, g.worker) for g in gpus] == [
        (0, 24576, "sm_86", "local"),
        (1, 24576, "sm_86", "local"),
        (2, 81920, "sm_90", "local"),
    ]
    assert len(parse_simulate("24G")) == 1
    for bad in ("", "2x", "x24G", "2x24Q", "99x1G", "2x24G:sm 86"):
        with pytest.raises(InvalidInput):
            parse_simulate(bad)


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1")
    assert is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    assert not is_loopback("10.0.0.1")
    assert not is_loopback("example.com")


def test_tokens_authenticate_by_digest_only() -> None:
    store = MemoryStore()
    token, record = create_token(store, "worker", "box-1")
    assert token not in repr(record)
    auth = Authenticator(store)
    principal = auth.authenticate(f"Bearer {token}")
    assert (principal.role, principal.worker) == ("worker", "box-1")
    with pytest.raises(Unauthorized):
        auth.authenticate(f"Bearer {token}x")
    with pytest.raises(ValueError, match="worker"):
        create_token(store, "worker")
    with pytest.raises(ValueError, match="role"):
        create_token(store, "root")


def test_store_is_sqlite_memory_or_a_postgresql_url() -> None:
    for store in ("sqlite", "memory", "postgresql://db/x", "postgres://u@db:5433/x"):
        assert ServeConfig.resolve({"store": store}, None).store == store
    for bad in ("mysql", "postgresq://user:secret@db/x", ""):
        with pytest.raises(InvalidInput, match="store: must be sqlite, memory or a post") as error:
            ServeConfig.resolve({"store": bad}, None)
        assert "secret" not in str(error.value)


def test_standby_settings_are_checked() -> None:
    settings = ServeConfig.resolve(
        {"advertise_url": "http://ctl-a:7070", "leader_ttl_s": 1.5}, None
    )
    assert (settings.advertise_url, settings.leader_ttl_s) == ("http://ctl-a:7070", 1.5)
    for field, bad in (
        ("advertise_url", "ctl-a:7070"),
        ("advertise_url", "http://ctl-a:7070/v1"),
        ("leader_ttl_s", 0.1),
        ("leader_ttl_s", 1e9),
    ):
        with pytest.raises(InvalidInput, match=field):
            ServeConfig.resolve({field: bad}, None)


def test_the_history_sample_interval_comes_from_the_file_and_is_checked(tmp_path: Path) -> None:
    config = tmp_path / "arbiter.toml"
    config.write_text("[serve]\nhistory_sample_s = 2\n")
    assert ServeConfig.resolve({}, config).history_sample_s == 2
    assert ServeConfig.resolve({}, None).history_sample_s == 10.0
    for bad in ("0.05", "1e9", '"fast"', "true", "nan"):
        config.write_text(f"history_sample_s = {bad}\n")
        with pytest.raises(InvalidInput, match="history_sample_s"):
            ServeConfig.resolve({}, config)
