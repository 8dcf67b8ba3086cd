"""Several hosts on one machine for the cluster tests: each host an agent with its own
worker name, simulated GPUs and runtime directory, and its own gateway listening on its
own loopback address (127.0.0.2, 127.0.0.3, ...), all reporting to one real controller.
Each host's agent holds a worker token and its gateway a gateway token, both bound to
its worker and given in a file of mode 0600, as a deployment gives them."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import httpx

from .agents import AgentProcess, worker_state
from .conftest import Server, wait_for
from .gateways import GatewayProcess


class HostGateway(GatewayProcess):
    """A gateway on ``address`` named ``name`` beside worker ``worker``."""

    def __init__(
        self,
        url: str,
        token: str,
        runtime: Path,
        models: str,
        address: str,
        name: str,
        worker: str | None = None,
    ) -> None:
        head = f'[gateway]\nhost = "{address}"\nname = "{name}"\n'
        head += "\n" if worker is None else f'worker = "{worker}"\n\n'
        super().__init__(url, token, runtime, head + models)
        self.address = address
        self.name = name
        found = re.search(r'^key = "([^"]+)"', models, re.MULTILINE)
        self.key = found.group(1) if found else ""
        self._listening = re.compile(rf"gateway on https?://{re.escape(address)}:(\d+)")

    def start(self, timeout_s: float = 30.0) -> HostGateway:
        super().start(timeout_s)
        self.url = self.url.replace("127.0.0.1", self.address)
        if re.search(r"^tls_cert = ", self.models, re.MULTILINE):
            self.url = self.url.replace("http://", "https://")
        return self

    def _port(self) -> str | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"gateway exited: {self.log.read_text()}")
        found = self._listening.findall(self.started_log())
        return found[-1] if found else None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def client(self, **kwargs: Any) -> httpx.Client:
        """A client with this gateway's own API key, if it has one (``key``)."""
        if self.key:
            kwargs.setdefault("headers", {"authorization": f"Bearer {self.key}"})
        return super().client(**kwargs)


class Host:
    """One host: its agent (worker ``box-N``, a worker token) and its gateway (``gw-N``
    on 127.0.0.N, a gateway token of ``box-N``), both given ``controllers``
    (comma-separated URLs; default: ``server``'s)."""

    def __init__(
        self,
        server: Server,
        root: Path,
        number: int,
        spec: str,
        models: str,
        controllers: str | None = None,
    ) -> None:
        self.server = server
        self.number = number
        self.worker = f"box-{number}"
        self.runtime = root / f"host-{number}"
        urls = controllers or server.url
        self.agent = AgentProcess(
            urls, server.token("worker", self.worker), self.worker, self.runtime, spec
        )
        self.gateway = HostGateway(
            urls,
            server.token("gateway", self.worker),
            self.runtime,
            models,
            f"127.0.0.{number}",
            f"gw-{number}",
            self.worker,
        )

    def start(self, admin: httpx.Client) -> Host:
        self.agent.start()
        wait_for(lambda: worker_state(admin, self.worker) == "online", what=f"{self.worker} up")
        self.gateway.start()
        return self

    def stop(self) -> None:
        self.gateway.stop()
        self.agent.stop()

    def kill(self) -> None:
        """SIGKILL to the gateway and the agent, as a host that loses its power."""
        self.gateway.kill()
        assert self.agent.proc is not None
        self.agent.proc.send_signal(signal.SIGKILL)
        self.agent.proc.wait(10)


def routable(admin: httpx.Client, hosts: list[Host], model: str) -> bool:
    """Whether every gateway of ``hosts`` sees every other as a routable host of
    ``model`` (the view each front door routes on)."""
    for host in hosts:
        with host.gateway.client() as client:
            entries = client.get("/v1/models").json()["data"]
        entry = next((e for e in entries if e["id"] == model), None)
        if entry is None:
            return False
        seen = {h["gateway"] for h in entry.get("hosts", []) if h.get("routable")}
        if seen != {h.gateway.name for h in hosts}:
            return False
    return True


def served_by(response: httpx.Response) -> str:
    return response.headers.get("x-served-by", "")


def cluster_leases(admin: httpx.Client, model: str) -> list[dict[str, Any]]:
    return [
        lease
        for lease in admin.get("/v1/leases").json()
        if (lease.get("metadata") or {}).get("cluster_model") == model and lease["ended_at"] is None
    ]


def model_leases(admin: httpx.Client, model: str) -> list[dict[str, Any]]:
    """The model's leases not ended, the cluster's and each gateway's own."""
    return [
        lease
        for lease in admin.get("/v1/leases").json()
        if (lease.get("metadata") or {}).get("model") == model and lease["ended_at"] is None
    ]
