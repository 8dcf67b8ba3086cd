"""Settings of ``gpu-arbiter serve``: command line > environment > config file > default.

The config file is TOML (``--config`` or ``GPU_ARBITER_CONFIG``), keys as the
options' names with ``_`` (``host``, ``port``, ``state_dir``, ``simulate``,
``auth``, ``store``, ``heartbeat_timeout_s``, ``sync``, ``max_body_bytes``,
``max_pending``, ``max_pending_per_token``, ``max_pending_per_holder``, ``max_streams``,
``max_streams_per_token``, ``max_long_polls``, ``max_long_polls_per_token``,
``log_level``, ``log_format``, ``advertise_url``, ``leader_ttl_s``, ``allowed_hosts``,
``retention``, ``max_header_bytes``, ``max_headers``, ``header_timeout_s``,
``max_connections``, ``history_sample_s``, ``tls_cert``, ``tls_key``, ``tls_client_ca``),
optionally under ``[serve]``.

``tls_cert`` and ``tls_key`` (both or neither): serve HTTPS only; with ``tls_client_ca``,
every client presents a certificate it signed (mutual TLS; see ``tls.py``).

``history_sample_s`` (config file only; default 10): how often the dashboard's history
is sampled; the last 360 samples are kept (an hour at 10 s; see ``history.py``).

``store``: ``sqlite`` (the state directory's ``state.db``), ``memory``, or a
``postgresql://`` URL (a database several controllers share: one leads, see ``ha.py``).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from ..core import Gpu, InvalidInput, Policy, parse_mb, parse_seconds
from ..logs import LOG_FORMATS, LOG_LEVELS
from ..paths import default_state_dir, is_loopback
from ..store import is_postgres_url
from ..tls import ServerTls

__all__ = ["ServeConfig", "default_state_dir", "is_loopback", "parse_simulate", "policy_from"]

SIMULATED_WORKER = "local"
COUNT_LIMITS = (
    "max_pending",
    "max_pending_per_token",
    "max_pending_per_holder",
    "max_streams",
    "max_streams_per_token",
    "max_long_polls",
    "max_long_polls_per_token",
)


@dataclass(frozen=True, slots=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 7070
    state_dir: Path | None = None
    simulate: str | None = None
    auth: bool = True
    store: str = "sqlite"
    sync: Literal["normal", "full"] = "normal"
    heartbeat_timeout_s: float = 15.0
    max_body_bytes: int = 64 * 1024
    max_pending: int = 10_000
    max_pending_per_token: int = 1_000
    max_pending_per_holder: int = 1_000
    max_streams: int = 10_000
    max_streams_per_token: int = 100
    max_long_polls: int = 10_000
    max_long_polls_per_token: int = 1_000
    log_level: str = "info"
    log_format: str = "text"
    advertise_url: str | None = None
    leader_ttl_s: float = 3.0
    allowed_hosts: tuple[str, ...] = ()
    retention: str = "7d"
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    max_connections: int = 10_000
    history_sample_s: float = 10.0
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    policy: Policy = field(default_factory=Policy)  # the file's [policy] table: policy_from

    def __post_init__(self) -> None:
        sample_s = self.history_sample_s
        if isinstance(sample_s, bool) or not isinstance(sample_s, int | float):
            raise InvalidInput("history_sample_s", f"must be a number of seconds, not {sample_s!r}")
        if not 0.1 <= sample_s <= 600:
            raise InvalidInput("history_sample_s", "must be between 0.1 and 600 seconds")
        if self.store not in ("sqlite", "memory") and not is_postgres_url(self.store):
            scheme, sep, _ = self.store.partition("://")  # the rest may hold a password
            shown = f"{scheme}://..." if sep else self.store
            raise InvalidInput(
                "store", f"must be sqlite, memory or a postgresql:// URL, not {shown!r}"
            )

    @classmethod
    def resolve(cls, given: dict[str, Any], config_file: Path | None) -> ServeConfig:
        """``given``: values from the command line or environment (None: not set)."""
        from_file: dict[str, Any] = {}
        if config_file is not None:
            with config_file.open("rb") as handle:
                loaded = tomllib.load(handle)
            from_file = loaded.get("serve", loaded)
            table = from_file.pop("policy", None) or loaded.get("policy")
            if table is not None:
                from_file["policy"] = policy_from(table)
        names = {f.name for f in fields(cls)}
        unknown = set(from_file) - names
        if unknown:
            raise InvalidInput("config", f"unknown settings {', '.join(sorted(unknown))}")
        merged = {**from_file, **{k: v for k, v in given.items() if v is not None}}
        merged.update(_paths(merged))
        if isinstance(merged.get("allowed_hosts"), str):  # a flag: comma-separated
            merged["allowed_hosts"] = merged["allowed_hosts"].split(",")
        merged["allowed_hosts"] = tuple(h.strip() for h in merged.get("allowed_hosts", ()))
        if "retention" in merged:  # TOML: "7d", or a number of seconds
            merged["retention"] = str(merged["retention"])
        config = cls(**merged)
        config.check_limits()
        if config.log_format not in LOG_FORMATS:
            raise InvalidInput("log_format", f"must be one of {', '.join(LOG_FORMATS)}")
        if config.log_level.lower() not in LOG_LEVELS:
            raise InvalidInput("log_level", f"must be one of {', '.join(LOG_LEVELS)}")
        if config.simulate:
            parse_simulate(config.simulate)
        if config.advertise_url is not None and not re.fullmatch(
            r"https?://[^\s/]+(:\d+)?/?", config.advertise_url
        ):
            raise InvalidInput("advertise_url", "must be like http://host:7070")
        if not 0.5 <= config.leader_ttl_s <= 600:
            raise InvalidInput("leader_ttl_s", "must be between 0.5 and 600 seconds")
        config.check_tls()
        return config

    def check_tls(self) -> None:
        """A certificate comes with its key; a client CA only with both."""
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = (
                ("tls_cert", "tls_key") if self.tls_key is None else ("tls_key", "tls_cert")
            )
            raise InvalidInput(missing, f"needed with {given} (a certificate and its key)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise InvalidInput("tls_client_ca", "needs tls_cert and tls_key (TLS to serve)")

    @property
    def tls(self) -> ServerTls | None:
        """The listener's TLS, if it serves HTTPS: clients' certificates required where a
        client CA is given (the controller's clients are all the cluster's own)."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        return ServerTls(self.tls_cert, self.tls_key, self.tls_client_ca)

    def check_limits(self) -> None:
        """Every bound is a number in its range, named when it is not."""
        for name in COUNT_LIMITS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(name, f"must be a whole number of at least 1, not {value!r}")
        parse_seconds(self.retention, "retention")
        bounds = {
            "max_header_bytes": (1024, 1 << 24),
            "max_headers": (8, 10_000),
            "header_timeout_s": (0.1, 3600),
            "max_connections": (1, 1 << 20),
        }
        for name, (low, high) in bounds.items():
            if not low <= getattr(self, name) <= high:
                raise InvalidInput(name, f"must be between {low:g} and {high:g}")
        if any(not host for host in self.allowed_hosts):
            raise InvalidInput("allowed_hosts", "an empty host name")

    @property
    def retention_s(self) -> float:
        """How long ended leases are kept (``retention``, such as ``7d``)."""
        return parse_seconds(self.retention, "retention")

    @property
    def state_path(self) -> Path:
        return self.state_dir or default_state_dir()


def _paths(merged: Mapping[str, Any]) -> dict[str, Path]:
    """The settings that name a file or a directory, as paths (``~`` expanded)."""
    names = ("state_dir", "tls_cert", "tls_key", "tls_client_ca")
    return {n: Path(merged[n]).expanduser() for n in names if merged.get(n) is not None}


def policy_from(table: Any) -> Policy:
    """The scheduling policy of a config file's ``[policy]`` table: the settings of
    :class:`~..core.Policy` by name; durations (``*_s``) as seconds or ``"90s"``,
    ``"10m"``; ``inf`` (TOML's) for never. Errors name ``policy.KEY``."""
    if not isinstance(table, Mapping):
        raise InvalidInput("policy", "must be a table: [policy] with one setting a line")
    known = {f.name for f in fields(Policy)}
    unknown = set(table) - known
    if unknown:
        raise InvalidInput(
            "policy",
            f"unknown settings {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})",
        )
    values: dict[str, Any] = {
        key: parse_seconds(value, f"policy.{key}")
        if key.endswith("_s") and isinstance(value, str)
        else value
        for key, value in table.items()
    }
    try:
        return Policy(**values)
    except InvalidInput as error:
        raise InvalidInput(f"policy.{error.field}", error.reason) from None
    except TypeError as error:
        raise InvalidInput("policy", f"a setting has the wrong type: {error}") from None


def parse_simulate(spec: str) -> list[Gpu]:
    """``2x24G``, ``24G``, ``2x24G:sm_86``, ``2x24G:sm_86,1x80G:sm_90`` -> GPUs of one
    simulated worker named ``local``."""
    gpus: list[Gpu] = []
    for part in spec.split(","):
        match = re.fullmatch(
            r"\s*(?:(\d{1,2})\s*x\s*)?([0-9.]+\s*[A-Za-z]*)(?::(\w+))?\s*", part, re.ASCII
        )
        if match is None:
            raise InvalidInput("simulate", f"{part!r} is not like 2x24G or 2x24G:sm_86")
        count = int(match.group(1) or 1)
        total = parse_mb(match.group(2), "simulate")
        for _ in range(count):
            gpus.append(
                Gpu(
                    index=len(gpus),
                    total_mb=total,
                    arch=match.group(3) or "",
                    worker=SIMULATED_WORKER,
                    model="simulated",
                    uuid=f"sim-{len(gpus)}",
                )
            )
    if not gpus or len(gpus) > 64:
        raise InvalidInput("simulate", "must describe 1..64 GPUs")
    return gpus
