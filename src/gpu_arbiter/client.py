"""A typed HTTP client for the controller's ``/v1`` API (httpx, asyncio).

The CLI, the ``run`` wrapper and the agent talk to the controller only through
this module. It accepts several controller URLs (``http://a:7070,http://b:7070``)
and moves on to the next one when a controller cannot be reached or is a standby
(307 to its leader, or 503 ``not_leader``): straight to the leader the standby
names when that is one of the URLs given (the token is sent nowhere else). So a
standby taking over is transparent. ``create_lease`` always sends an idempotency
key, so that a retry on another controller never queues a request twice.

Errors::

    ArbiterError
     ├── ApiError               the controller answered with an error body
     │    └── NotGranted        409: the request ended without a grant (or its lease ended)
     └── ControllerUnreachable  no controller URL answered
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import uuid
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from .core import ArbiterError, format_mb
from .tls import client_context, refusal

__all__ = [
    "ApiError",
    "ArbiterClient",
    "ControllerUnreachable",
    "NotGranted",
    "SseEvent",
    "parse_urls",
    "pending_text",
    "verdict_text",
]

DEFAULT_URL = "http://127.0.0.1:7070"
Json = dict[str, Any]


class ApiError(ArbiterError):
    """The controller refused: ``status`` (HTTP), ``code``, ``message``, ``details``."""

    def __init__(self, status: int, code: str, message: str, details: Mapping[str, Any]) -> None:
        super().__init__(message, **dict(details))
        self.status = status
        self.code = code


class NotGranted(ApiError):
    """``create_lease`` answered 409 ``not_granted`` (the request ended before it was granted:
    ``state`` is ``timed_out`` when its ``max_wait_s`` passed) or ``lease_ended`` (a replay
    of a lease that was granted and has ended since). No GPU may be used."""

    @property
    def lease_id(self) -> str:
        return str(self.details.get("lease_id", ""))

    @property
    def state(self) -> str:
        return str(self.details.get("state", ""))

    @property
    def reason(self) -> str | None:
        reason = self.details.get("reason")
        return None if reason is None else str(reason)


class ControllerUnreachable(ArbiterError):
    code = "controller_unreachable"


@dataclass(frozen=True, slots=True)
class SseEvent:
    id: str | None
    type: str
    data: Any


def pending_text(lease: Json) -> str:
    """A pending lease's wait in words, as the API's reason says it, with its position."""
    reason = lease.get("reason") or {}
    text = str(reason.get("message") or reason.get("code") or "waiting")
    position = lease.get("position")
    return text if position is None else f"position {position}: {text}"


def verdict_text(verdict: Mapping[str, Any]) -> str:
    """One GPU's verdict of a pending reason (``reason.gpus``), as ``gpu-arbiter queue -v``
    prints it: 'box-3:0 insufficient_vram: need 6.0 GiB, free 2.0 GiB, committed 22.0 GiB,
    observed 22.0 GiB (2 more GPU(s) say the same)'."""

    def mb(key: str) -> str:
        value = verdict.get(key)
        return "-" if value is None else format_mb(int(value))

    count = int(verdict.get("count") or 1)
    more = f" ({count - 1} more GPU(s) say the same)" if count > 1 else ""
    return (
        f"{verdict.get('gpu')} {verdict.get('code')}: need {mb('need_mb')}, free {mb('free_mb')}"
        f", committed {mb('committed_mb')}, observed {mb('observed_mb')}{more}"
    )


def parse_urls(value: str | Sequence[str] | None) -> list[str]:
    """``"http://a:7070,http://b:7070"`` (or a list) -> clean base URLs; the default if empty."""
    if value is None:
        value = os.environ.get("GPU_ARBITER_URL", "")
    parts = value.split(",") if isinstance(value, str) else list(value)
    urls = [p.strip().rstrip("/") for p in parts if p.strip()]
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ArbiterError(f"controller URL {url!r} must start with http:// or https://")
    return urls or [DEFAULT_URL]


class ArbiterClient:
    """``async with ArbiterClient("http://127.0.0.1:7070", token=...) as client: ...``"""

    def __init__(
        self,
        urls: str | Sequence[str] | None = None,
        *,
        token: str | None = None,
        timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: how an https controller is verified (and this client presents itself,
        for mutual TLS); by default from ``GPU_ARBITER_CA``, ``GPU_ARBITER_CLIENT_CERT`` and
        ``GPU_ARBITER_CLIENT_KEY`` (:func:`~.tls.client_context`: a renewed certificate and
        key are loaded again before a new connection), else the system's CAs."""
        self.urls = parse_urls(urls)
        self._current = 0
        token = token if token is not None else os.environ.get("GPU_ARBITER_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        verify = tls or client_context() or True
        self._http = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(timeout_s), transport=transport, verify=verify
        )

    async def __aenter__(self) -> ArbiterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def url(self) -> str:
        """The controller URL in use now."""
        return self.urls[self._current]

    # ------------------------------------------------------------------ transport

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """One call, failing over across the controller URLs; the decoded JSON body."""
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s)
        errors: list[str] = []
        tried: set[str] = set()
        order = [self.urls[(self._current + i) % len(self.urls)] for i in range(len(self.urls))]
        while order:
            url = order.pop(0)
            if url in tried:
                continue
            tried.add(url)
            try:
                response = await self._http.request(
                    method,
                    url + path,
                    json=json_body,
                    params=clean,
                    timeout=timeout,
                    headers=None if method in ("GET", "HEAD") else _JSON,
                )
            except httpx.TransportError as exc:
                closed = isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError)
                why = refusal(exc, closed and url.startswith("https:"))
                why = why or f"{exc.__class__.__name__} {exc}".strip()
                errors.append(f"{url}: {why}")
                continue
            leader = _leader_of(response)
            if leader is not None:  # a standby: its leader first, then the others
                if leader and leader not in self.urls:  # the token goes to given URLs only
                    errors.append(
                        f"{url}: a standby; its leader {leader} is not among the controller "
                        "URLs given (add it to GPU_ARBITER_URL / --controller)"
                    )
                else:
                    errors.append(f"{url}: a standby (the leader is {leader or 'not known'})")
                if leader in self.urls and leader not in tried:
                    order.insert(0, leader)
                continue
            if response.status_code == 503 and len(self.urls) > 1:
                errors.append(f"{url}: 503 not ready")
                continue
            if url in self.urls:
                self._current = self.urls.index(url)
            return _decode(response)
        raise ControllerUnreachable(
            "no controller answered (" + "; ".join(errors) + "). Start one with "
            "`gpu-arbiter serve --local`, or point GPU_ARBITER_URL / --controller at it."
        )

    # ------------------------------------------------------------------ leases

    async def create_lease(self, **request: Any) -> Json:
        """POST /v1/leases: the lease, granted (``state`` loading or active: HTTP 201) or
        pending (HTTP 202, with position and reason). A request that ended before it was
        granted (``max_wait_s`` passed, cancelled) raises :class:`NotGranted`."""
        body = {k: v for k, v in request.items() if v is not None}
        # A retry on another controller (failover) must not queue the request twice.
        body.setdefault("idempotency_key", f"auto-{uuid.uuid4().hex}")
        result: Json = await self.request("POST", "/v1/leases", json_body=body)
        return result

    async def lease(
        self, lease_id: str, *, wait_s: float | None = None, state: str | None = None
    ) -> Json:
        """GET /v1/leases/{id}; with ``wait_s``, answers as soon as the state changes (from
        ``state`` when given: at once if it already differs, so no change is missed)."""
        timeout = None if wait_s is None else wait_s + 10.0
        params = {"wait": wait_s, "state": state}
        result: Json = await self.request(
            "GET", f"/v1/leases/{lease_id}", params=params, timeout_s=timeout
        )
        return result

    async def leases(
        self, *, state: str | None = None, worker: str | None = None, holder: str | None = None
    ) -> list[Json]:
        params = {"state": state, "worker": worker, "holder": holder}
        result: list[Json] = await self.request("GET", "/v1/leases", params=params)
        return result

    async def renew(self, lease_id: str, ttl_s: float | None = None) -> Json:
        body = {} if ttl_s is None else {"ttl_s": ttl_s}
        return await self._post(f"/v1/leases/{lease_id}/renew", body)

    async def ready(self, lease_id: str) -> Json:
        return await self._post(f"/v1/leases/{lease_id}/ready")

    async def idle(self, lease_id: str) -> Json:
        return await self._post(f"/v1/leases/{lease_id}/idle")

    async def busy(self, lease_id: str) -> Json:
        return await self._post(f"/v1/leases/{lease_id}/busy")

    async def shrink(self, lease_id: str, vram_mb: int | str) -> Json:
        """POST /v1/leases/{id}/shrink: the lease holds ``vram_mb`` per GPU (MiB, or a size
        such as ``512M``) from now on; a lease never grows (409: ask for a new one)."""
        return await self._post(f"/v1/leases/{lease_id}/shrink", {"vram_mb": vram_mb})

    async def release(self, lease_id: str) -> Json:
        """DELETE /v1/leases/{id}: releases a held lease, cancels a pending one; idempotent."""
        result: Json = await self.request("DELETE", f"/v1/leases/{lease_id}")
        return result

    async def revoke(self, lease_id: str) -> Json:
        return await self._post(f"/v1/leases/{lease_id}/revoke")

    # ------------------------------------------------------------------ workers

    async def register(self, worker: Json) -> Json:
        return await self._post("/v1/workers", worker)

    async def heartbeat(self, name: str, body: Json) -> Json:
        return await self._post(f"/v1/workers/{name}/heartbeat", body)

    async def workers(self) -> list[Json]:
        result: list[Json] = await self.request("GET", "/v1/workers")
        return result

    async def worker(self, name: str) -> Json:
        result: Json = await self.request("GET", f"/v1/workers/{name}")
        return result

    async def drain(
        self, name: str, *, force: bool = False, deadline_s: float | None = None
    ) -> Json:
        body: Json = {"mode": "force" if force else "graceful"}
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        return await self._post(f"/v1/workers/{name}/drain", body)

    async def cancel_drain(self, name: str) -> Json:
        return await self._post(f"/v1/workers/{name}/cancel-drain")

    async def remove_worker(self, name: str, *, force: bool = False) -> Json:
        result: Json = await self.request(
            "DELETE", f"/v1/workers/{name}", params={"force": "true" if force else None}
        )
        return result

    async def update(
        self, name: str, *, timeout_s: float | None = None, drain_deadline_s: float | None = None
    ) -> Json:
        body: Json = {}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if drain_deadline_s is not None:
            body["drain_deadline_s"] = drain_deadline_s
        return await self._post(f"/v1/workers/{name}/update", body)

    async def operation(self, operation_id: str) -> Json:
        result: Json = await self.request("GET", f"/v1/operations/{operation_id}")
        return result

    # ------------------------------------------------------------------ gateways

    async def report_gateway(self, name: str, report: Json) -> Json:
        """PUT /v1/gateways/{name}: a gateway's report (url, host, worker, models); the
        answer's ``commands`` are those queued for it, handed over now."""
        result: Json = await self.request("PUT", f"/v1/gateways/{name}", json_body=report)
        return result

    async def gateway_commands(self, name: str, *, wait_s: float = 0.0) -> list[Json]:
        """GET /v1/gateways/{name}/commands: the commands queued for the gateway, handed
        over; with ``wait_s``, as soon as one is queued (``[]`` when the wait ends)."""
        result: Json = await self.request(
            "GET",
            f"/v1/gateways/{name}/commands",
            params={"wait": wait_s or None},
            timeout_s=wait_s + 10.0,
        )
        commands: list[Json] = result["commands"]
        return commands

    async def forget_gateway(self, name: str) -> Json:
        """DELETE /v1/gateways/{name}: the gateway's goodbye at a clean stop."""
        result: Json = await self.request("DELETE", f"/v1/gateways/{name}")
        return result

    async def gateways(self) -> list[Json]:
        """GET /v1/gateways: each gateway's last report, ``reported_ago_s`` and ``stale``."""
        result: list[Json] = await self.request("GET", "/v1/gateways")
        return result

    async def gateway_command(self, name: str, model: str, verb: str) -> Json:
        """POST /v1/gateways/{name}/models/{model}/{verb} (unload, pin, unpin): queued for
        the gateway, which takes it at once (202)."""
        return await self._post(f"/v1/gateways/{name}/models/{quote(model, safe='')}/{verb}")

    # ------------------------------------------------------------------ the catalogue

    async def apply_catalogue(self, text: str, file: str = "catalogue.toml") -> Json:
        """PUT /v1/catalogue (an admin's): the catalogue's text, read from ``file`` (its
        errors name it). The answer's ``outcome``: ``applied`` (a new ``revision``) or
        ``unchanged``; a refused catalogue raises :class:`ApiError` (422) whose
        ``details`` name the ``file``, ``line`` and ``field``."""
        result: Json = await self.request(
            "PUT", "/v1/catalogue", json_body={"text": text, "file": file}
        )
        return result

    async def catalogue(self) -> Json | None:
        """GET /v1/catalogue: the current revision (``revision``, ``text``, ``sha256``,
        ``applied_at``, ``applied_by``, ``models``); None while none was ever applied."""
        return await self.catalogue_after(0, 0.0)

    async def catalogue_after(self, revision: int, wait_s: float) -> Json | None:
        """GET /v1/catalogue?after=&wait=: the current revision as soon as it is above
        ``revision``, or as it is once ``wait_s`` (at most 60) has passed; None while
        none was ever applied."""
        params = {"after": revision or None, "wait": wait_s or None}
        try:
            result: Json = await self.request(
                "GET", "/v1/catalogue", params=params, timeout_s=wait_s + 10.0
            )
        except ApiError as error:
            if error.status == 404 and error.code == "not_found":
                return None
            raise
        return result

    async def catalogue_history(self) -> list[Json]:
        """GET /v1/catalogue/history: every revision, newest first, without its text."""
        result: list[Json] = await self.request("GET", "/v1/catalogue/history")
        return result

    async def catalogue_revision(self, revision: int) -> Json:
        """GET /v1/catalogue/revisions/{n}: one revision, with its text."""
        result: Json = await self.request("GET", f"/v1/catalogue/revisions/{int(revision)}")
        return result

    # ------------------------------------------------------------------ arbiter

    async def pause(self) -> Json:
        return await self._post("/v1/pause")

    async def resume(self) -> Json:
        return await self._post("/v1/resume")

    async def status(self) -> Json:
        result: Json = await self.request("GET", "/v1/status")
        return result

    async def controllers(self, timeout_s: float = 3.0) -> list[Json]:
        """Each controller URL given, asked on its own (no failover): ``url``, ``role``
        (``leader``, ``standby`` or ``unreachable``), ``leader``, or ``error``."""

        async def one(url: str) -> Json:
            try:
                answer = await self._http.get(url + "/v1/status", timeout=timeout_s)
                body = answer.json()
            except (httpx.HTTPError, ValueError) as error:
                return {"url": url, "role": "unreachable", "error": str(error) or repr(error)}
            if answer.status_code != 200 or not isinstance(body, dict):
                return {"url": url, "role": "unreachable", "error": f"HTTP {answer.status_code}"}
            return {"url": url, "role": body.get("role", "leader"), "leader": body.get("leader")}

        return list(await asyncio.gather(*(one(url) for url in self.urls)))

    async def queue(self) -> list[Json]:
        result: list[Json] = await self.request("GET", "/v1/queue")
        return result

    async def events(
        self,
        *,
        last_event_id: str | None = None,
        lease: str | None = None,
        worker: str | None = None,
    ) -> AsyncGenerator[SseEvent, None]:
        """Follows ``/v1/events`` (Server-Sent Events) from ``last_event_id``."""
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        params = {k: v for k, v in {"lease": lease, "worker": worker}.items() if v}
        timeout = httpx.Timeout(10.0, read=None)
        async with self._http.stream(
            "GET", self.url + "/v1/events", headers=headers, params=params, timeout=timeout
        ) as response:
            if response.status_code >= 400:
                await response.aread()
                _decode(response)
            fields: dict[str, str] = {}
            async for line in response.aiter_lines():
                if line:
                    key, _, value = line.partition(":")
                    if key in ("id", "event", "data"):
                        fields[key] = fields.get(key, "") + value.lstrip()
                    continue
                if "data" in fields:
                    yield SseEvent(
                        fields.get("id"), fields.get("event", "message"), json.loads(fields["data"])
                    )
                fields = {}

    async def _post(self, path: str, body: Json | None = None) -> Json:
        result: Json = await self.request("POST", path, json_body=body)
        return result


_JSON = {"Content-Type": "application/json"}
"""Sent with every change, with a body or not: the controller refuses a change a web
page could make, and a page cannot send this type without the controller's consent."""


def _leader_of(response: httpx.Response) -> str | None:
    """For a standby's answer (307 to the leader, or 503 ``not_leader``): the leader's
    base URL, ``""`` when the standby does not know it; None for any other answer."""
    if response.status_code == 307 and response.headers.get("x-gpu-arbiter-leader"):
        return response.headers["x-gpu-arbiter-leader"].rstrip("/")
    if response.status_code == 503:
        try:
            error = response.json().get("error", {})
        except (ValueError, AttributeError):
            return None
        if isinstance(error, dict) and error.get("code") == "not_leader":
            return str((error.get("details") or {}).get("leader") or "").rstrip("/")
    return None


def _decode(response: httpx.Response) -> Any:
    try:
        body = response.json() if response.content else None
    except ValueError:
        body = None
    if response.status_code >= 400:
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            error = {"code": "http_error", "message": response.text[:200] or response.reason_phrase}
        code = str(error.get("code", "error"))
        kind = NotGranted if code in ("not_granted", "lease_ended") else ApiError
        raise kind(
            response.status_code, code, str(error.get("message", "")), error.get("details") or {}
        )
    return body
