"""Operator commands: look at a controller (``status``, ``queue``, ``leases``, ``events``)
and act on it (``drain``, ``cancel-drain``, ``update``, ``remove``, ``pause``, ``resume``,
``release``). Arguments -> client -> rendering; the controller decides everything.

Exit codes: 0 done; 1 the controller refused (one ``error:`` line on stderr); 2 bad
arguments; 69 no controller answered; 130 interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from enum import StrEnum
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..client import ApiError, ArbiterClient, ControllerUnreachable, verdict_text
from ..core import ArbiterError, InvalidInput, format_mb, format_s, parse_seconds
from .access import TOKEN_HELP, credentials, refusal

EXIT_API_ERROR = 1
EXIT_UNREACHABLE = 69
EXIT_INTERRUPTED = 130
BAR_WIDTH = 30
PIPED_HISTORY = 20
HISTORY_SCAN = 5000  # events looked back through for the history of one lease or worker
Json = dict[str, Any]
T = TypeVar("T")


class Output(StrEnum):
    human = "human"
    json = "json"


def option(text: str, *names: str, envvar: str | None = None, **more: Any) -> Any:
    return typer.Option(*names, envvar=envvar, help=text, show_default=False, **more)


Controller = Annotated[
    str | None, option("Controller URL(s), comma-separated.", envvar="GPU_ARBITER_URL")
]
Token = Annotated[str | None, option(TOKEN_HELP, envvar="GPU_ARBITER_TOKEN")]
OutputOpt = Annotated[Output, option("human or json.", "--output", "-o")]


def parse_duration(value: str) -> float:
    """``90s``, ``10m``, ``1h``, ``2d``, ``45`` (seconds) -> seconds (``parse_seconds``)."""
    try:
        return parse_seconds(value, "duration")
    except InvalidInput as error:
        raise typer.BadParameter(error.reason) from None


# ---------------------------------------------------------------- calling the controller


def call_controller(
    controller: str | None, token: str | None, action: Callable[[ArbiterClient], Awaitable[T]]
) -> T:
    """Runs ``action`` with a client; a refusal or no answer becomes one line and an exit.
    Without a token, one on this machine is looked for (:mod:`.access`)."""
    try:
        found = credentials(controller, token)
    except ArbiterError as error:  # a malformed --controller
        _fail(str(error), 2)

    async def main() -> T:
        async with ArbiterClient(controller, token=found.token) as client:
            return await action(client)

    try:
        return asyncio.run(main())
    except ApiError as error:
        _fail(refusal(error, found), EXIT_API_ERROR)
    except ControllerUnreachable as error:
        _fail(str(error), EXIT_UNREACHABLE)
    except ArbiterError as error:
        _fail(str(error), 2)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _fail(message: str, code: int) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


def _json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def stdout_console() -> Console:
    # Not a terminal (a pipe, a file): no wrapping at 80 columns.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


# ---------------------------------------------------------------- rendering


def memory_bar(gpu: Json, width: int = BAR_WIDTH) -> Text:
    """Committed (solid), observed use beyond it (shaded), free (dots), to scale."""
    total = max(int(gpu["total_mb"]), 1)
    committed = int(gpu["committed_mb"])
    used = int(gpu["used_mb"] or 0)
    solid = round(width * min(committed, total) / total)
    shaded = max(0, round(width * min(max(used, committed), total) / total) - solid)
    bar = Text("[")
    bar.append("█" * solid, style="cyan")
    bar.append("▒" * shaded, style="yellow")
    bar.append("·" * (width - solid - shaded), style="dim")
    bar.append("]")
    return bar


def _ago(at: float | None) -> str:
    return "-" if at is None else format_s(max(0.0, time.time() - at))


def _mb(value: Any) -> str:
    return "-" if value is None else format_mb(int(value))


def status_view(workers: list[Json], status: Json, controllers: Sequence[Json] = ()) -> Group:
    """Every worker and GPU with its memory bar, then the totals (free memory counted only
    on GPUs that may take new work: an offline, draining or drained worker's, or one whose
    probe is stale, offers none)."""
    lines: list[RenderableType] = []
    totals = {"total_mb": 0, "committed_mb": 0, "used_mb": 0, "free_mb": 0}
    for worker in workers:
        seen = worker.get("last_heartbeat_at")
        heartbeat = "no heartbeat" if seen is None else f"heartbeat {_ago(seen)} ago"
        update = worker.get("update")
        lines.append(
            Text.assemble(
                (worker["name"], "bold"),
                f"  {worker['state']}  {heartbeat}",
                "  (simulated)" if worker.get("simulated") else "",
                (
                    (f"  updating: {update['operation']} waits on {update['waiting_on']}", "cyan")
                    if update
                    else ""
                ),
            )
        )
        for gpu in worker["gpus"]:
            for key in totals:
                totals[key] += int(gpu[key] or 0)
            if worker["state"] != "online" or gpu["stale"]:
                totals["free_mb"] -= int(gpu["free_mb"] or 0)  # takes no new work: no room
            lines.append(_gpu_line(gpu))
    if not workers:
        lines.append(Text("no workers registered"))
    leases = status.get("leases_by_state", {})
    held = ", ".join(f"{n} {state}" for state, n in sorted(leases.items())) or "none"
    lines.append(
        Text(
            f"total: {len(workers)} workers, "
            f"{sum(len(w['gpus']) for w in workers)} GPUs; committed {_mb(totals['committed_mb'])}"
            f", used {_mb(totals['used_mb'])}, free {_mb(totals['free_mb'])}"
            f" of {_mb(totals['total_mb'])} (free: on GPUs that take new work)"
        )
    )
    lines.append(Text(f"leases: {held}; pending: {status.get('pending', 0)}"))
    if status.get("paused"):
        lines.append(Text("paused: nothing is granted until `gpu-arbiter resume`", "bold red"))
    if status.get("role") == "standby":
        leader = status.get("leader") or "none elected yet"
        lines.append(Text(f"read from a standby controller (leader: {leader})", "yellow"))
    if len(controllers) > 1:
        roles = ", ".join(f"{c['url']} {c['role']}" for c in controllers)
        lines.append(Text(f"controllers: {roles}"))
    return Group(*lines)


def _gpu_line(gpu: Json) -> Text:
    line = Text(f"  {gpu['id']:<10} ")
    line.append_text(memory_bar(gpu))
    line.append(
        f" committed {_mb(gpu['committed_mb'])}  used {_mb(gpu['used_mb'])}"
        f"  free {_mb(gpu['free_mb'])} / {_mb(gpu['total_mb'])}"
    )
    if gpu["loading"]:
        line.append(f"  loading {gpu['loading']}", style="yellow")
    if gpu["stale"]:
        line.append("  stale", style="red")
    return line


def queue_view(pending: list[Json], verbose: bool = False) -> RenderableType:
    """Pending requests in order with why they wait; with ``verbose``, what the GPUs say:
    for each outcome, the GPU nearest to taking the request and how many more say it."""
    if not pending:
        return Text("the queue is empty")
    table = Table("pos", "id", "holder", "vram", "gpus", "priority", "waiting", "reason")
    for lease in pending:
        reason = lease.get("reason") or {}
        table.add_row(
            str(lease.get("position", "-")),
            lease["id"],
            lease["holder"] or "-",
            _mb(lease["vram_mb"]),
            str(lease["gpu_count"]),
            f"{lease['priority_name']} ({lease['priority']})",
            _ago(lease["submitted_at"]),
            reason.get("message", ""),
        )
    if not verbose:
        return table
    parts: list[RenderableType] = [table]
    for lease in pending:
        verdicts = (lease.get("reason") or {}).get("gpus") or []
        parts.append(Text(f"{lease['id']}:", "bold"))
        for v in verdicts:
            gpu, _, rest = verdict_text(v).partition(" ")
            parts.append(Text(f"  {gpu:<10} {rest}"))
        if not verdicts:
            parts.append(Text("  no per-GPU detail"))
    return Group(*parts)


def leases_view(leases: list[Json]) -> RenderableType:
    if not leases:
        return Text("no leases")
    table = Table("id", "state", "holder", "worker", "gpus", "vram", "priority", "age")
    for lease in leases:
        table.add_row(
            lease["id"],
            lease["state"],
            lease["holder"] or "-",
            lease["worker"] or "-",
            ",".join(lease["gpus"]) or "-",
            _mb(lease["vram_mb"]),
            lease["priority_name"],
            _ago(lease["granted_at"] or lease["submitted_at"]),
        )
    return table


def operation_view(operation: Json) -> RenderableType:
    reason = f": {operation['reason']}" if operation.get("reason") else ""
    head = Text(
        f"{operation['kind']} of {operation['worker']}, operation {operation['id']}: "
        f"{operation['state']}{reason}"
    )
    table = Table("step", "outcome", "at", "detail")
    for step in operation["steps"]:
        at = time.strftime("%H:%M:%S", time.localtime(step["at"]))
        table.add_row(step["name"], step["outcome"], at, step["detail"])
    return Group(head, table)


def event_line(event: Json) -> str:
    at = time.strftime("%H:%M:%S", time.localtime(event.get("at") or time.time()))
    parts = [f"{at} #{event.get('seq')} {event.get('kind')}"]
    if event.get("lease_id"):
        parts.append(f"lease={event['lease_id']}")
    if event.get("worker"):
        parts.append(f"worker={event['worker']}")
    parts += [f"{k}={_value(k, v)}" for k, v in sorted((event.get("data") or {}).items())]
    return " ".join(parts)


def _value(key: str, value: Any) -> str:
    """An event's datum as the rest of the CLI shows it: sizes and durations in words."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if key.endswith("_mb"):
            return format_mb(int(value)).replace(" ", "")
        if key.endswith("_s"):
            return format_s(float(value))
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def render_answer(action: str, answer: Json) -> None:
    """What an action did, from the controller's answer."""
    if "previous_state" in answer:  # drain, cancel-drain, remove
        print(
            f"{action} {answer['worker']}: {answer['previous_state']} -> {answer['state']}; "
            f"revoked {answer['revoked']}, already revoking {answer['already_revoking']}, "
            f"already finished {answer['already_finished']}, leases left {answer['leases_left']}"
        )
    elif "paused" in answer:
        print("paused: nothing is granted until resume" if answer["paused"] else "resumed")
    elif "kind" in answer and "steps" in answer:  # an operation (update)
        print(
            f"{action} {answer['worker']}: operation {answer['id']} {answer['state']}; "
            f"follow it with GET /v1/operations/{answer['id']}"
        )
    else:  # a lease (release)
        reason = f" ({answer['end_reason']})" if answer.get("end_reason") else ""
        print(f"{action} {answer['id']}: {answer['state']}{reason}")


def _act(
    name: str,
    controller: str | None,
    token: str | None,
    output: Output,
    action: Callable[[ArbiterClient], Awaitable[Json]],
) -> None:
    answer = call_controller(controller, token, action)
    if output is Output.json:
        _json(answer)
    else:
        render_answer(name, answer)


# ---------------------------------------------------------------- commands: looking


def status(
    controller: Controller = None, token: Token = None, output: OutputOpt = Output.human
) -> None:
    """Every worker and GPU with a memory bar (committed, used, free), loads, totals."""

    async def fetch(client: ArbiterClient) -> tuple[list[Json], Json, list[Json]]:
        workers, figures = await client.workers(), await client.status()
        controllers = await client.controllers() if len(client.urls) > 1 else []
        return workers, figures, controllers

    workers, figures, controllers = call_controller(controller, token, fetch)
    if output is Output.json:
        _json({"workers": workers, "status": figures, "controllers": controllers})
    else:
        stdout_console().print(status_view(workers, figures, controllers))


def queue(
    verbose: Annotated[
        bool, option("Per-GPU verdicts for each request.", "--verbose", "-v")
    ] = False,
    controller: Controller = None,
    token: Token = None,
    output: OutputOpt = Output.human,
) -> None:
    """Pending requests in order: position, wait so far and why they wait."""
    pending = call_controller(controller, token, lambda client: client.queue())
    if output is Output.json:
        _json(pending)
    else:
        stdout_console().print(queue_view(pending, verbose))


def leases(
    state: Annotated[str | None, option("Only leases in this state.")] = None,
    worker: Annotated[str | None, option("Only leases on this worker.")] = None,
    holder: Annotated[str | None, option("Only leases of this holder.")] = None,
    controller: Controller = None,
    token: Token = None,
    output: OutputOpt = Output.human,
) -> None:
    """Leases, filtered by state, worker or holder."""
    found = call_controller(
        controller, token, lambda c: c.leases(state=state, worker=worker, holder=holder)
    )
    if output is Output.json:
        _json(found)
    else:
        stdout_console().print(leases_view(found))


def screenful() -> int:
    """Lines of history ``events`` shows first: a screen less two lines on a terminal."""
    if not sys.stdout.isatty():
        return PIPED_HISTORY
    return max(1, shutil.get_terminal_size().lines - 2)


def events(
    lease: Annotated[str | None, option("Only events of this lease.")] = None,
    worker: Annotated[str | None, option("Only events of this worker.")] = None,
    lines: Annotated[
        int | None,
        option(
            "Show this many past events first (default: a screenful; 20 when piped).",
            "--lines",
            "-n",
            min=0,
        ),
    ] = None,
    since: Annotated[
        int | None, option("Start after this event number instead of the last --lines.", min=0)
    ] = None,
    count: Annotated[int | None, option("Stop after this many events.", min=1)] = None,
    controller: Controller = None,
    token: Token = None,
    output: OutputOpt = Output.human,
) -> None:
    """The latest events (a screenful), then new ones as they happen, one line each, until
    Ctrl-C (or --count): as journalctl -n -f."""
    history = screenful() if lines is None else lines

    async def follow(client: ArbiterClient) -> None:
        printed = 0
        async with contextlib.aclosing(_event_feed(client, history, since, lease, worker)) as feed:
            async for data in feed:
                as_json = output is Output.json
                print(json.dumps(data, sort_keys=True) if as_json else event_line(data), flush=True)
                printed += 1
                if count is not None and printed >= count:
                    return

    call_controller(controller, token, follow)


async def _event_feed(
    client: ArbiterClient, history: int, since: int | None, lease: str | None, worker: str | None
) -> AsyncGenerator[Json, None]:
    """The last ``history`` events of the lease or worker (or all), then every new one; from
    ``since`` on when given. One stream, so nothing falls between the past and the new."""
    if since is None:
        last = int((await client.status()).get("last_event") or 0)
        scan = history if lease is None and worker is None else HISTORY_SCAN
        since = max(0, last - scan) if history else last
    else:
        last = since
    past: deque[Json] | None = deque(maxlen=history) if last > since else None
    async with contextlib.aclosing(client.events(last_event_id=str(since))) as stream:
        async for event in stream:
            data = event.data if isinstance(event.data, dict) else {"data": event.data}
            wanted = (lease is None or data.get("lease_id") == lease) and (
                worker is None or data.get("worker") == worker
            )
            if past is None:
                if wanted:
                    yield data
                continue
            if wanted:
                past.append(data)
            if int(data.get("seq") or 0) >= last:
                for earlier in past:
                    yield earlier
                past = None


# ---------------------------------------------------------------- commands: acting


def drain(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The worker.")],
    force: Annotated[bool, option("Revoke every lease now instead of waiting.")] = False,
    deadline: Annotated[
        str | None, option("Revoke what is left after this long: 90s, 10m, 1h.")
    ] = None,
    controller: Controller = None,
    token: Token = None,
    output: OutputOpt = Output.human,
) -> None:
    """Grant nothing more on a worker; let its leases end (or revoke them)."""
    deadline_s = None if deadline is None else parse_duration(deadline)
    _act(
        "drain",
        controller,
        token,
        output,
        lambda c: c.drain(name, force=force, deadline_s=deadline_s),
    )


def cancel_drain(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The worker.")],
    controller: Controller = None,
    token: Token = None,
    output: OutputOpt = Output.human,
) -> None:
    """Put a draining worker back online."""
    _act("cancel-drain", controller, token, output, lambda c: c.cancel_drain(name))


def update(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The worker.")],
    timeout: Annotated[
        str | None,
        option("Fail the update if not done (drain included) after this long; default 1h."),
    ] = None,
    drain_deadline: Annotated[
        str | None, option("Revoke the leases still on the worker after this long: 10m.")
    ] = None,
    wait: Annotated[
        bool, option("Follow it until it ends, step by step; exit 1 if it failed.")
    ] = False,
    controller: Controller = None,
    token: Token = None,
    output: OutputOpt = Output.human,
) -> None:
    """Update a worker's agent: drain, its own update command, restart, back online."""
    timeout_s = None if timeout is None else parse_duration(timeout)
    deadline_s = None if drain_deadline is None else parse_duration(drain_deadline)

    answer = call_controller(
        controller,
        token,
        lambda c: _follow(
            c, c.update(name, timeout_s=timeout_s, drain_deadline_s=deadline_s), wait
        ),
    )
    if wait:
        _show_operation(answer, output)
    elif output is Output.json:
        _json(answer)
    else:
        render_answer("update", answer)


def operation(
    operation_id: Annotated[str, typer.Argument(metavar="ID", help="The operation.")],
    wait: Annotated[bool, option("Wait until it ends; exit 1 if it failed.")] = False,
    controller: Controller = None,
    token: Token = None,
    output: OutputOpt = Output.human,
) -> None:
    """An operation (an update) step by step, with each step's time and outcome."""

    answer = call_controller(
        controller, token, lambda c: _follow(c, c.operation(operation_id), wait)
    )
    _show_operation(answer, output, fail=wait)


async def _follow(
    client: ArbiterClient, first: Awaitable[Json], wait: bool, poll_s: float = 1.0
) -> Json:
    """The operation ``first`` answers; with ``wait``, as it is once it has ended."""
    operation = await first
    while wait and operation["state"] == "running":
        await asyncio.sleep(poll_s)
        operation = await client.operation(operation["id"])
    return operation


def _show_operation(operation: Json, output: Output, *, fail: bool = True) -> None:
    if output is Output.json:
        _json(operation)
    else:
        stdout_console().print(operation_view(operation))
    if fail and operation["state"] == "failed":
        raise typer.Exit(EXIT_API_ERROR)


def remove(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The worker.")],
    force: Annotated[bool, option("Remove it even while it holds leases (revoked).")] = False,
    controller: Controller = None,
    token: Token = None,
    output: OutputOpt = Output.human,
) -> None:
    """Forget a worker."""
    _act("remove", controller, token, output, lambda c: c.remove_worker(name, force=force))


def pause(
    controller: Controller = None, token: Token = None, output: OutputOpt = Output.human
) -> None:
    """Grant nothing until resume (held leases stay held)."""
    _act("pause", controller, token, output, lambda c: c.pause())


def resume(
    controller: Controller = None, token: Token = None, output: OutputOpt = Output.human
) -> None:
    """Grant again after a pause."""
    _act("resume", controller, token, output, lambda c: c.resume())


def release(
    lease_id: Annotated[str, typer.Argument(metavar="ID", help="The lease.")],
    controller: Controller = None,
    token: Token = None,
    output: OutputOpt = Output.human,
) -> None:
    """Release a held lease, or cancel a pending request."""
    _act("release", controller, token, output, lambda c: c.release(lease_id))


COMMANDS: dict[str, Callable[..., None]] = {
    "status": status,
    "queue": queue,
    "leases": leases,
    "events": events,
    "drain": drain,
    "cancel-drain": cancel_drain,
    "update": update,
    "operation": operation,
    "remove": remove,
    "pause": pause,
    "resume": resume,
    "release": release,
}
