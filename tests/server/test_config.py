"""Settings of ``serve``: precedence, the simulate spec, loopback, tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_arbiter.core import InvalidInput, Policy
from gpu_arbiter.server.auth import TOKEN_RECHECK_S, Authenticator, Unauthorized, create_token
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


def test_limits_and_retention_come_from_the_file_or_the_command_line(tmp_path: Path) -> None:
    config = tmp_path / "arbiter.toml"
    config.write_text(
        'retention = "12h"\nallowed_hosts = ["gpu.example", "proxy"]\nmax_connections = 500\n'
    )
    settings = ServeConfig.resolve({"header_timeout_s": 2.5}, config)
    assert settings.retention_s == 12 * 3600
    assert settings.allowed_hosts == ("gpu.example", "proxy")
    assert (settings.max_connections, settings.header_timeout_s) == (500, 2.5)
    flags = ServeConfig.resolve({"allowed_hosts": "a.example, b.example", "retention": "0"}, None)
    assert flags.allowed_hosts == ("a.example", "b.example")
    assert flags.retention_s == 0
    assert ServeConfig.resolve({}, None).retention_s == 7 * 86400


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"retention": "a week"}, "retention"),
        ({"retention": "١٢h"}, "retention"),  # digits are ASCII digits
        ({"max_header_bytes": 10}, "max_header_bytes"),
        ({"header_timeout_s": 0}, "header_timeout_s"),
        ({"max_connections": 0}, "max_connections"),
        ({"allowed_hosts": "a,,b"}, "allowed_hosts"),
    ],
)
def test_bad_limits_are_refused_by_name(given: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        ServeConfig.resolve(given, None)


def test_a_token_revoked_in_the_store_is_refused_after_the_recheck_period() -> None:
    store = MemoryStore()
    now = [0.0]
    token, record = create_token(store, "client")
    auth = Authenticator(store, clock=lambda: now[0])
    assert auth.authenticate(f"Bearer {token}").id == record.id
    store.revoke_token(record.id)
    assert auth.authenticate(f"Bearer {token}").id == record.id  # cached, for a moment
    now[0] += TOKEN_RECHECK_S
    with pytest.raises(Unauthorized):
        auth.authenticate(f"Bearer {token}")


def test_the_history_sample_interval_comes_from_the_file_and_is_checked(tmp_path: Path) -> None:
    config = tmp_path / "arbiter.toml"
    config.write_text("[serve]\nhistory_sample_s = 2\n")
    assert ServeConfig.resolve({}, config).history_sample_s == 2
    assert ServeConfig.resolve({}, None).history_sample_s == 10.0
    for bad in ("0.05", "1e9", '"fast"', "true", "nan"):
        config.write_text(f"history_sample_s = {bad}\n")
        with pytest.raises(InvalidInput, match="history_sample_s"):
            ServeConfig.resolve({}, config)


def test_the_policy_comes_from_the_files_policy_table(tmp_path: Path) -> None:
    config = tmp_path / "arbiter.toml"
    config.write_text(
        '[serve]\nport = 9000\n[policy]\ngrace_s = "30s"\nidle_reclaim_s = "5m"\n'
        "starvation_s = inf\nmax_concurrent_loads = 2\n"
    )
    policy = ServeConfig.resolve({}, config).policy
    assert (policy.grace_s, policy.idle_reclaim_s) == (30.0, 300.0)
    assert policy.starvation_s == float("inf") and policy.max_concurrent_loads == 2
    flat = tmp_path / "flat.toml"
    flat.write_text('port = 9000\n[policy]\nplacement = "spread"\n')
    assert ServeConfig.resolve({}, flat).policy.placement == "spread"
    assert ServeConfig.resolve({}, None).policy == Policy()


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ("grace = 3", "policy"),  # not a setting: named with the known ones
        ('grace_s = "soon"', "policy.grace_s"),
        ('idle_reclaim_s = "١٢m"', "policy.idle_reclaim_s"),  # ASCII digits only
        ("max_concurrent_loads = 0", "policy.max_concurrent_loads"),
        ('placement = "random"', "policy.placement"),
        ("aging_interval_s = -1", "policy.aging_interval_s"),
    ],
)
def test_a_bad_policy_setting_is_named(tmp_path: Path, table: str, field: str) -> None:
    config = tmp_path / "arbiter.toml"
    config.write_text(f"[policy]\n{table}\n")
    with pytest.raises(InvalidInput) as refused:
        ServeConfig.resolve({}, config)
    assert refused.value.field == field
