"""Operator commands for the gateways' models: ``models`` (every gateway's models, as a
table), ``unload MODEL``, ``pin MODEL``, ``unpin MODEL``. Arguments -> each gateway's
HTTP API (``GET /v1/models``, ``POST /admin/models/NAME/VERB``) -> rendering; the
gateways decide.

Every command asks every gateway given (``--gateway``, repeatable or comma-separated;
``GPU_ARBITER_GATEWAY``), at once. A gateway that cannot be reached, or refuses, is one
line naming it; the others are still shown. Given no gateway, the controller is asked
(``--controller``, ``--token``, as every other command): its gateways' last reports
(``GET /v1/gateways``; a model whose cluster load waits in its queue, ``GET
/v1/queue``, is shown ``queued`` with why), and a change is queued there for each live
gateway that has the model (``POST /v1/gateways/NAME/models/MODEL/VERB``).

Below the table, one line per conflict a gateway reported (a name both its own file and
the cluster's catalogue declare; the own file's is served there): ``conflict: gw-2
(URL): chat: own file kept over catalogue revision 3``; and one per model of the
catalogue a gateway's host may run but does not serve: ``left out: gw-2 (URL): big:
WHY``.

``gateways forget NAME`` (an admin's): the controller forgets a gateway and frees its
name (``DELETE /v1/gateways/NAME``), for a gateway given a new token: a name belongs to
the token that first reported it, even once it stopped reporting.

``gateways reload`` (an admin key's, where the gateways have keys): each gateway given
reads its config file again and applies its models without a restart (``POST
/admin/reload``); one line per gateway says what changed, or why nothing did.

Exit codes: 0 done; 1 ``models``: no gateway answered with its models; a change: a
gateway was not reached or refused it, or none knows the model; a reload: a gateway was
not reached or refused it; 2 bad arguments.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

import httpx
import typer
from rich.table import Table

from ..client import ArbiterClient
from ..core import format_mb, format_s
from ..gateway.cluster.queued import queued_words
from ..gateway.servers.lease import Lease
from ..gateway.servers.states import most_advanced
from .ops import EXIT_API_ERROR, Controller, Token, call_controller, option, stdout_console

__all__ = ["MODEL_COMMANDS", "conflict_lines", "gateways_app", "models_view"]

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
LIST_TIMEOUT_S = 10.0
CHANGE_TIMEOUT_S = 300.0  # an unload answers once its servers are gone: two graces or so
CLUSTER_MODEL = "cluster_model"
"""The metadata key naming the model of a cluster load's lease (the controller's)."""
Json = dict[str, Any]

Gateways = Annotated[
    list[str] | None,
    option(
        "Gateway URL; repeat it or comma-separate several (default: the gateways that "
        "report to the controller).",
        "--gateway",
        envvar="GPU_ARBITER_GATEWAY",
    ),
]
Key = Annotated[
    str | None,
    option(
        "The gateways' API key (an admin key for unload, pin, unpin and reload).",
        "--key",
        envvar="GPU_ARBITER_GATEWAY_KEY",
    ),
]
AsJson = Annotated[bool, option("Print the gateways' answers as JSON.", "--json")]
ModelArg = Annotated[str, typer.Argument(metavar="MODEL", help="The model (name or alias).")]


@dataclass(frozen=True, slots=True)
class Answer:
    """One gateway's answer: ``status`` 0 when it could not be reached (``error`` says
    why), else the HTTP status and its JSON ``body``."""

    gateway: str
    status: int
    body: Any = None
    error: str = ""

    def refusal(self) -> str:
        """The line for a gateway that did not do what was asked."""
        if not self.status:
            return f"{self.gateway}: not reachable ({self.error})"
        found = self.body.get("error") if isinstance(self.body, dict) else None
        if isinstance(found, dict):
            return f"{self.gateway}: {self.status} {found.get('code')}: {found.get('message')}"
        return f"{self.gateway}: {self.status} (not a gateway's answer)"

    @property
    def unknown_model(self) -> bool:
        found = self.body.get("error") if isinstance(self.body, dict) else None
        return self.status == 404 and isinstance(found, dict) and (
            found.get("code") == "model_not_found"
        )  # fmt: skip


def gateway_urls(given: Sequence[str] | None) -> list[str]:
    """``--gateway`` values (each may hold several, comma-separated), checked."""
    urls = [u.strip().rstrip("/") for value in given or [] for u in value.split(",")]
    urls = [url for url in urls if url] or [DEFAULT_GATEWAY]
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            print(f"error: --gateway: {url!r} is not an http:// or https:// URL", file=sys.stderr)
            raise typer.Exit(2)
    return list(dict.fromkeys(urls))


def ask(
    urls: Sequence[str], method: str, path: str, key: str | None, timeout_s: float
) -> list[Answer]:
    """Every gateway's answer to ``method path``, asked at once."""

    async def one(client: httpx.AsyncClient, url: str) -> Answer:
        try:
            # a change goes as JSON: the simple-request rule's, when there is no key
            sent: Json | None = {} if method == "POST" else None
            response = await client.request(method, url + path, json=sent)
        except httpx.HTTPError as error:
            return Answer(url, 0, error=f"{error.__class__.__name__}: {error}".rstrip(": "))
        try:
            body = response.json()
        except ValueError:
            body = None
        return Answer(url, response.status_code, body)

    async def every() -> list[Answer]:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        timeout = httpx.Timeout(timeout_s, connect=5.0)
        async with httpx.AsyncClient(headers=headers, timeout=timeout) as client:
            return list(await asyncio.gather(*(one(client, url) for url in urls)))

    try:
        return asyncio.run(every())
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


# ---------------------------------------------------------------- rendering


def models_view(answers: Sequence[Answer]) -> Table:
    """One row per model of every gateway that answered (aliases are not rows)."""
    table = Table(
        "gateway", "model", "state", "lease", "memory", "in flight", "queued", "last used",
        "keep-alive left", "pinned",
    )  # fmt: skip
    for answer in answers:
        if answer.status != 200:
            continue
        for model in _models(answer.body):
            table.add_row(answer.gateway, *_row(model))
    return table


def conflict_lines(answers: Sequence[Answer]) -> list[str]:
    """One line per name that both a gateway's own file and the catalogue declare (as its
    report to the controller names them): ``conflict: gw-2 (URL): chat: own file kept
    over catalogue revision 3``; then one per catalogue model it leaves out, with why."""
    lines = []
    for answer in answers:
        found = answer.body.get("conflicts") if isinstance(answer.body, dict) else None
        for conflict in found if isinstance(found, list) else ():
            if isinstance(conflict, dict):
                model, kept, over = (conflict.get(k) for k in ("model", "kept", "over"))
                lines.append(f"conflict: {answer.gateway}: {model}: {kept} kept over {over}")
        found = answer.body.get("left_out") if isinstance(answer.body, dict) else None
        for left in found if isinstance(found, list) else ():
            if isinstance(left, dict):
                lines.append(f"left out: {answer.gateway}: {left.get('model')}: {left.get('why')}")
    return lines


def _models(body: Any) -> list[Json]:
    data = body.get("data") if isinstance(body, dict) else None
    return [m for m in data or [] if isinstance(m, dict) and "alias_of" not in m]


def _row(model: Json) -> list[str]:
    replicas = model.get("replicas") or []
    leases = [_lease_words(r) for r in replicas if r.get("lease")]
    left = [_keep_alive_words(r) for r in replicas if "keep_alive_left_s" in r]
    return [
        str(model.get("id")),
        _state_words(model),
        ", ".join(leases) or "-",
        format_mb(int(model["held_mb"])) if model.get("held_mb") else "-",
        str(model.get("in_flight", 0)),
        str(model.get("queued", 0)),
        _last_used_words(model),
        ", ".join(left) or "-",
        _pin_words(model) if model.get("pinned") else "-",
    ]


def _state_words(model: Json) -> str:
    """The state, and why where it says: the arbiter's reason for a queued model, the
    failure of a failed one and when a request may start it again."""
    state = str(model.get("state"))
    if model.get("pending_reason"):
        state += f": {model['pending_reason']}"
    if state == "failed":
        state += f": {model.get('failure') or 'its last start failed'}"
        left = model.get("retry_in_s")
        if isinstance(left, int | float):
            state += f"; next start in {format_s(float(left))}" if left > 0 else "; may start now"
    return state


def _last_used_words(model: Json) -> str:
    """``now`` while requests are in flight (its last use is this one), else how long ago."""
    in_flight = int(model.get("in_flight") or 0)
    if in_flight:
        return f"now ({in_flight} in flight)"
    ago = model.get("last_used_ago_s")
    return "never" if ago is None else f"{format_s(float(ago))} ago"


def _keep_alive_words(replica: Json) -> str:
    """How long until keep_alive stops the replica; an asleep one says so (it still stops
    then: keep_alive runs on while it sleeps)."""
    left = format_s(float(replica["keep_alive_left_s"]))
    return f"{left} (asleep)" if replica.get("state") == "asleep" else left


def _lease_words(replica: Json) -> str:
    """A replica's lease, and whether it is marked idle (the arbiter may reclaim it)."""
    return f"{replica['lease']} (idle)" if replica.get("lease_idle") else str(replica["lease"])


def _pin_words(model: Json) -> str:
    """What the pin means: who may still take the GPU (I5)."""
    by = model.get("preemptible_by")
    return f"yes; preemptible by {by}" if by else "yes; not preemptible"


def _changed_line(verb: str, answer: Answer) -> str:
    body: Json = answer.body
    name = body.get("id")
    if verb == "unload":
        stopped, cancelled, left = body["stopped"], body["cancelled"], body["still_stopping"]
        done = f"{left} still stopping" if left else "its leases released"
        return (
            f"{answer.gateway}: unloaded {name}: {stopped} replica(s) stopped, {cancelled} "
            f"queued cancelled; {done}; now {body.get('state')}"
        )
    if verb == "pin":
        return (
            f"{answer.gateway}: pinned {name} ({body.get('state')}): never marked idle, never "
            f"stopped for keep_alive; {_pin_words(body).removeprefix('yes; ')}"
        )
    return (
        f"{answer.gateway}: unpinned {name} ({body.get('state')}): idle_after and keep_alive "
        "count again, from now"
    )


# ---------------------------------------------------------------- through the controller


def reported(controller: str | None, token: str | None) -> list[Answer]:
    """The controller's gateways as answers: a live one's models, a stale one refused."""

    async def fetch(client: ArbiterClient) -> tuple[list[Json], list[Json]]:
        return await client.gateways(), await client.queue()

    found, pending = call_controller(controller, token, fetch)
    loads = {
        str(lease["metadata"][CLUSTER_MODEL]): lease
        for lease in pending
        if CLUSTER_MODEL in (lease.get("metadata") or {})
    }
    workers = {str(e.get("worker")): str(e["name"]) for e in found if e.get("worker")}
    answers = []
    for entry in found:
        name = f"{entry['name']} ({entry['url']})"
        if entry.get("stale"):
            why = {
                "error": {
                    "code": "stale",
                    "message": f"not reporting for {entry['reported_ago_s']:.0f}s",
                }
            }
            answers.append(Answer(name, 409, why))
        else:
            models = [_queued(m, loads.get(str(m.get("id"))), workers) for m in entry["models"]]
            more = {key: entry.get(key) or [] for key in ("conflicts", "left_out")}
            answers.append(Answer(name, 200, {"data": models, **more}))
    return answers


def _queued(model: Json, load: Json | None, workers: dict[str, str]) -> Json:
    """A gateway's model as it reported it, or ``queued`` with why when the cluster's
    load of it waits in the controller's queue and the gateway's copy neither serves nor
    loads it (a front door lists it so: ``Cluster.queued``)."""
    state = str(model.get("state"))
    if load is None or state == "queued" or most_advanced((state, "queued")) != "queued":
        return model
    why = queued_words(Lease.of(load), workers.get)
    return {**model, "state": "queued", "pending_reason": why}


def _queue_change(verb: str, model: str, controller: str | None, token: str | None) -> None:
    """The change queued at the controller for each live gateway that has the model."""

    async def queue(client: ArbiterClient) -> list[Json]:
        found = await client.gateways()
        having = [g for g in found if not g.get("stale") and _has(g["models"], model)]
        return [await client.gateway_command(g["name"], model, verb) for g in having]

    queued = call_controller(controller, token, queue)
    for command in queued:
        print(
            f"{command['gateway']}: {verb} {command['model']} queued (command {command['id']}); "
            "the gateway takes it at once"
        )
    if not queued:
        print(
            f"error: no gateway reporting to the controller has a model {model!r}", file=sys.stderr
        )
        raise typer.Exit(EXIT_API_ERROR)


def _has(models: list[Json], name: str) -> bool:
    return any(m.get("id") == name or name in (m.get("aliases") or []) for m in models)


# ---------------------------------------------------------------- commands


def models(
    gateway: Gateways = None,
    key: Key = None,
    as_json: AsJson = False,
    controller: Controller = None,
    token: Token = None,
) -> None:
    """Every gateway's models: state, lease, memory, requests in flight and queued, last
    used, keep-alive left, pinned; below, one line per name a gateway's own file and the
    catalogue both declare (the own file's kept)."""
    if gateway:
        answers = ask(gateway_urls(gateway), "GET", "/v1/models", key, LIST_TIMEOUT_S)
    else:
        answers = reported(controller, token)
    listed = any(answer.status == 200 for answer in answers)
    if as_json:
        print(json.dumps([_as_json(a) for a in answers], indent=2, sort_keys=True))
    elif listed:
        stdout_console().print(models_view(answers))
        for line in conflict_lines(answers):
            print(line)
    for answer in answers:
        if answer.status != 200:
            print(answer.refusal(), file=sys.stderr)
    if not listed:
        raise typer.Exit(EXIT_API_ERROR)


def _as_json(answer: Answer) -> Json:
    if answer.status == 200 and answer.body is not None and "data" in answer.body:
        found = {"gateway": answer.gateway, "models": _models(answer.body)}
        for key in ("conflicts", "left_out"):
            if key in answer.body:
                found[key] = answer.body[key]
        return found
    return {"gateway": answer.gateway, "status": answer.status, "error": answer.refusal()}


def _change(
    verb: str,
    model: str,
    gateway: list[str] | None,
    key: str | None,
    as_json: bool,
    controller: str | None = None,
    token: str | None = None,
) -> None:
    """``POST /admin/models/MODEL/VERB`` on every gateway; those that do not know the
    model are left out, unless none does. Given no gateway: through the controller."""
    if not gateway:
        _queue_change(verb, model, controller, token)
        return
    path = f"/admin/models/{quote(model, safe='')}/{verb}"
    answers = ask(gateway_urls(gateway), "POST", path, key, CHANGE_TIMEOUT_S)
    done = [a for a in answers if a.status == 200]
    failed = [a for a in answers if a.status != 200 and not a.unknown_model]
    if as_json:
        found = [{"gateway": a.gateway, "status": a.status, "answer": a.body} for a in answers]
        print(json.dumps(found, indent=2, sort_keys=True))
    else:
        for answer in done:
            print(_changed_line(verb, answer))
    for answer in failed:
        print(f"error: {answer.refusal()}", file=sys.stderr)
    if not done and not failed:
        print(f"error: no gateway has a model {model!r}", file=sys.stderr)
    if failed or not done:
        raise typer.Exit(EXIT_API_ERROR)


def unload(
    model: ModelArg,
    gateway: Gateways = None,
    key: Key = None,
    as_json: AsJson = False,
    controller: Controller = None,
    token: Token = None,
) -> None:
    """Stop a model's servers now (requests in flight get its grace; queued ones are
    cancelled) and release their leases; the next request starts it again."""
    _change("unload", model, gateway, key, as_json, controller, token)


def pin(
    model: ModelArg,
    gateway: Gateways = None,
    key: Key = None,
    as_json: AsJson = False,
    controller: Controller = None,
    token: Token = None,
) -> None:
    """Keep a model loaded: its lease never marked idle, never stopped for keep_alive; only
    a strictly higher priority may preempt it, if it is preemptible."""
    _change("pin", model, gateway, key, as_json, controller, token)


def unpin(
    model: ModelArg,
    gateway: Gateways = None,
    key: Key = None,
    as_json: AsJson = False,
    controller: Controller = None,
    token: Token = None,
) -> None:
    """Let a pinned model go: idle_after and keep_alive count again, from now."""
    _change("unpin", model, gateway, key, as_json, controller, token)


MODEL_COMMANDS: dict[str, Callable[..., None]] = {
    "models": models,
    "unload": unload,
    "pin": pin,
    "unpin": unpin,
}


gateways_app = typer.Typer(help="The gateways that report to the controller.", no_args_is_help=True)


@gateways_app.command("forget")
def gateways_forget(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The gateway's name.")],
    controller: Controller = None,
    token: Token = None,
) -> None:
    """Forget a gateway and free its name (an admin's): a gateway given a new token may
    then report under it. A gateway still running reports again under its old token."""
    call_controller(controller, token, lambda client: client.forget_gateway(name))
    print(f"gateway {name} forgotten: its name is free")


@gateways_app.command("reload")
def gateways_reload(
    gateway: Annotated[
        list[str] | None,
        option(
            f"Gateway URL; repeat it or comma-separate several (default: {DEFAULT_GATEWAY}).",
            "--gateway",
            envvar="GPU_ARBITER_GATEWAY",
        ),
    ] = None,
    key: Key = None,
    as_json: AsJson = False,
) -> None:
    """Make each gateway read its config file again and apply its models without a
    restart (an admin key where it has keys): what changed, or why nothing did."""
    answers = ask(gateway_urls(gateway), "POST", "/admin/reload", key, CHANGE_TIMEOUT_S)
    if as_json:
        found = [{"gateway": a.gateway, "status": a.status, "answer": a.body} for a in answers]
        print(json.dumps(found, indent=2, sort_keys=True))
    failed = [a for a in answers if a.status != 200]
    for answer in answers:
        if answer.status == 200 and not as_json:
            print(f"{answer.gateway}: {reload_words(answer.body)}")
    for answer in failed:
        print(f"error: {answer.refusal()}", file=sys.stderr)
    if failed:
        raise typer.Exit(EXIT_API_ERROR)


def reload_words(body: Any) -> str:
    """A gateway's answer to a reload, in one line."""
    found = body if isinstance(body, dict) else {}
    parts = [
        f"{label} {', '.join(map(str, found[key]))}"
        for key, label in (
            ("added", "added"), ("removed", "removed"), ("replaced", "replaced"),
            ("in_place", "in place:"),
        )
        if found.get(key)
    ]  # fmt: skip
    text = "; ".join(parts) or "no model changed"
    if found.get("not_applied"):
        text += f"; not applied until a restart: {', '.join(map(str, found['not_applied']))}"
    failed = found.get("failed")
    for name, why in failed.items() if isinstance(failed, dict) else ():
        text += f"; {name}: its change failed ({why})"
    for conflict in found.get("conflicts") or ():
        if isinstance(conflict, dict):
            kept, over = conflict.get("kept"), conflict.get("over")
            text += f"; {conflict.get('model')}: {kept} kept over {over}"
    return text
