"""A real ``gpu-arbiter gateway`` process for integration tests, and the models file
it runs: each model is tests/integration/model_server.py (a small OpenAI-compatible
server that takes memory in the fake probe and records its start and exit)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .agents import env_for, token_file
from .conftest import ManagedProcess, wait_for

MODEL_SERVER = Path(__file__).with_name("model_server.py")
LISTENING = re.compile(r"gateway on http://127\.0\.0\.1:(\d+)")


def model_entry(
    name: str,
    record: Path,
    *,
    mb: int = 1000,
    load_s: float = 0.2,
    drain: bool = True,
    fail_while: Path | None = None,
    ready_when: Path | None = None,
    **keys: Any,
) -> str:
    """One ``[models.NAME]`` table running the test model server (``drain``: whether it
    lets its requests finish on SIGTERM; ``fail_while``: its start fails while that file
    exists; ``ready_when``: it loads until that file exists)."""
    command = [sys.executable, str(MODEL_SERVER), "--port", "{port}", "--name", name]
    command += ["--mb", str(mb), "--load-s", str(load_s), "--record", str(record)]
    command += [] if drain else ["--no-drain"]
    command += [] if fail_while is None else ["--fail-while", str(fail_while)]
    command += [] if ready_when is None else ["--ready-when", str(ready_when)]
    keys = {"idle_after": "0.1s", "grace": "1s", "queue_timeout": "60s", **keys}
    lines = [f"[models.{name}]", f"command = {json.dumps(command)}"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
    return "\n".join(lines) + "\n"


class GatewayProcess(ManagedProcess):
    def __init__(self, url: str, token: str, runtime: Path, models: str) -> None:
        self.runtime = runtime
        self.log_from = 0  # where the log of the last start begins
        self.config = runtime / "models.toml"
        self.models = models
        self.token_file = token_file(runtime / "gateway.token", token)
        self.command = [sys.executable, "-m", "gpu_arbiter", "gateway", "--config"]
        self.command += [str(self.config), "--port", "0", "--controller", url]
        self.command += ["--token-file", str(self.token_file)]
        self.command += ["--state-dir", str(runtime / "state")]  # its lock, servers and logs
        self.log = runtime / "gateway.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout_s: float = 30.0) -> GatewayProcess:
        self.runtime.mkdir(parents=True, exist_ok=True)
        self.config.write_text(self.models)
        self.log_from = self.log.stat().st_size if self.log.exists() else 0  # this start's
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=log, env=env_for(self.runtime)
            )
        port = wait_for(self._port, timeout_s, "the gateway to listen")
        self.url = f"http://127.0.0.1:{port}"
        return self

    def _port(self) -> str | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"gateway exited: {self.log.read_text()}")
        found = LISTENING.findall(self.started_log())
        return found[-1] if found else None

    def started_log(self) -> str:
        """What the gateway wrote to its log since its last start."""
        with self.log.open("rb") as log:
            log.seek(self.log_from)
            return log.read().decode(errors="replace")

    def client(self, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("timeout", 60)
        return httpx.Client(base_url=self.url, **kwargs)

    def model_state(self, name: str) -> dict[str, Any]:
        with self.client() as client:
            found = client.get("/v1/models").json()["data"]
        model: dict[str, Any] = next(m for m in found if m["id"] == name)
        return model


def records(directory: Path, name: str) -> list[dict[str, Any]]:
    """What each process of model ``name`` recorded (started_at, ready_at, term_at), by
    start time."""
    found = []
    for path in directory.glob(f"{name}-*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda r: r.get("started_at", 0))


def chat(model: str, **body: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` with ``labels`` in a Prometheus text page."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None
