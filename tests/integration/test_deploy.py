"""deploy/: the Grafana dashboard queries only metrics ``/metrics`` exposes, and the
systemd units run real ``gpu-arbiter`` commands with options that exist."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import SRC, Server

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = (
    "gpu-arbiter-controller.service",
    "gpu-arbiter-agent.service",
    "gpu-arbiter-gateway.service",
)

#  PromQL words that are not metric names (functions are found by their "(").
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
_KEYWORDS |= {"and", "or", "unless", "offset", "inf", "nan"}
_NOT_NAMES = re.compile(
    r'"(?:[^"\\]|\\.)*"'  # strings
    r"|\{[^}]*\}"  # label matchers
    r"|\[[^\]]*\]"  # ranges
    r"|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"  # label lists
)
_IDENTIFIER = re.compile(r"(?<![\w.$])([A-Za-z_:][\w:]*)\b(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    stripped = _NOT_NAMES.sub(" ", expr)
    return {name for name in _IDENTIFIER.findall(stripped) if name.lower() not in _KEYWORDS}


def test_metric_names_are_found_in_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{i=~"$x", b="c d"}[5m]))) '
        "/ on (gpu) group_left b_total + sum without (state) (c) > bool 0.5"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}


def walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def exposed(server: Server) -> set[str]:
    """Names that can be queried: every sample's name, and gauges without a sample yet."""
    with server.client() as admin:
        admin.post("/v1/leases", json={"vram_mb": "1G"})  # a grant: every histogram fills
        text = admin.get("/metrics").text
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(sample.name for sample in family.samples)
        if family.type == "gauge":
            names.add(family.name)
    return names


def test_dashboard_queries_only_exposed_metrics(server: Server) -> None:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    names = exposed(server)
    exprs = [node["expr"] for node in walk(dashboard["panels"]) if "expr" in node]
    assert len(exprs) >= 15
    used: set[str] = set()
    for expr in exprs:
        found = metric_names(expr)
        assert found, expr
        assert found <= names, (expr, found - names)
        used |= found
    for wanted in (
        "gpu_arbiter_gpu_memory_committed_bytes",
        "gpu_arbiter_gpu_memory_free_bytes",
        "gpu_arbiter_gpu_memory_used_bytes",
        "gpu_arbiter_queue_depth",
        "gpu_arbiter_grants_total",
        "gpu_arbiter_preemptions_total",
        "gpu_arbiter_revocations_total",
        "gpu_arbiter_wait_seconds_bucket",
        "gpu_arbiter_workers",
    ):
        assert wanted in used, wanted
    for variable in dashboard["templating"]["list"]:
        query = variable.get("definition", "")
        for metric in re.findall(r"label_values\((\w+)", query):
            assert metric in names, (variable["name"], metric)


def units() -> Iterator[tuple[str, configparser.ConfigParser]]:
    for name in UNITS:
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read_string((DEPLOY / name).read_text())
        yield name, parser


def help_text(subcommand: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "250", "NO_COLOR": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "gpu_arbiter", subcommand, "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(("name", "unit"), list(units()))
def test_unit_runs_a_real_command(name: str, unit: configparser.ConfigParser) -> None:
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "gpu-arbiter", argv
    subcommand = {"controller": "serve", "agent": "agent", "gateway": "gateway"}[
        name.removeprefix("gpu-arbiter-").removesuffix(".service")
    ]
    assert argv[1] == subcommand
    options = [a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")]
    assert options, argv
    text = help_text(subcommand)
    for option in options:
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text), (name, option)
    assert not any("token" in a.lower() or a.startswith("gat_") for a in argv), argv
    assert service["Restart"] == "on-failure"
    assert service["User"] not in ("", "root")
    assert service.get("EnvironmentFile")
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_units_hardening_keeps_nvml_for_the_agent() -> None:
    found = dict(units())
    controller = found["gpu-arbiter-controller.service"]["Service"]
    agent = found["gpu-arbiter-agent.service"]["Service"]
    assert controller["StateDirectory"] == "gpu-arbiter"
    assert "%S/gpu-arbiter" in controller["ExecStart"]
    assert controller["PrivateDevices"] == "yes"
    assert "PrivateDevices" not in agent and "DevicePolicy" not in agent
    assert agent["RuntimeDirectory"] == "gpu-arbiter"
    for service in (controller, agent):
        assert service["NoNewPrivileges"] == "yes"
        assert service["ProtectSystem"] == "strict"


@pytest.mark.parametrize("command", ["agent", "gateway"])
def test_the_token_comes_from_a_file_the_unit_names(command: str) -> None:
    """The unit names the file of the token (never the token), by a variable the command
    reads, and no token stands in an environment file's example."""
    text = (DEPLOY / f"gpu-arbiter-{command}.service").read_text()
    named = f"\nEnvironment=GPU_ARBITER_TOKEN_FILE=/etc/gpu-arbiter/{command}.token\n"
    assert named in text
    assert "GPU_ARBITER_TOKEN_FILE" in help_text(command)
    assert "GPU_ARBITER_TOKEN=" not in text
