"""The real :class:`~.interfaces.AgentLink` (the local agent's unix socket) and
:class:`~.interfaces.HealthCheck` (HTTP on loopback)."""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from ...agent.local import agent_request, attach

__all__ = ["HttpHealthCheck", "LocalAgentLink"]

HEALTH_TIMEOUT_S = 2.0


class LocalAgentLink:
    async def env(self, worker: str) -> Mapping[str, str]:
        answer = await agent_request(worker, {"op": "env"})
        if not (answer and answer.get("ok")):
            return {}
        return {str(k): str(v) for k, v in (answer.get("env") or {}).items()}

    async def attach(self, worker: str, lease_id: str, pid: int, holder_stops_s: float) -> bool:
        return await attach(worker, lease_id, pid, holder_stops_s=holder_stops_s)

    async def stop(self, worker: str, lease_id: str, grace_s: float) -> bool:
        answer = await agent_request(worker, {"op": "stop", "lease": lease_id, "grace_s": grace_s})
        return bool(answer and answer.get("ok"))

    async def used_mb(self, worker: str, pid: int) -> int | None:
        answer = await agent_request(worker, {"op": "usage", "pgid": pid})
        used = answer.get("used_mb") if answer else None
        return used if isinstance(used, int) and not isinstance(used, bool) else None

    async def account(self, worker: str, pgid: int, shares: Mapping[str, int]) -> bool:
        request = {"op": "account", "pgid": pgid, "shares": dict(shares)}
        answer = await agent_request(worker, request)
        return bool(answer and answer.get("ok"))


class HttpHealthCheck:
    """One client for every check of a gateway. No connection is kept: a server being
    stopped waits for its idle clients (llama.cpp's server exits about 110 ms after
    SIGTERM with one kept connection, 2 ms with none), and a swap waits for that exit."""

    def __init__(self) -> None:
        no_keep = httpx.Limits(max_keepalive_connections=0)
        self._http = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S, limits=no_keep)

    async def status(self, port: int, path: str) -> int | None:
        try:
            return (await self._http.get(f"http://127.0.0.1:{port}{path}")).status_code
        except httpx.HTTPError:
            return None

    async def aclose(self) -> None:
        await self._http.aclose()
