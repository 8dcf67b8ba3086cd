"""``gpu-arbiter run --vram 8G -- CMD ARGS...``: hold a lease for the life of a command.

::

    ask --pending--> wait (live reason) --granted--> start CMD in its own group
                                                      | renew every ttl/3
                                                      | ready: --ready-url / --ready-after /
                                                      |   GPU memory unchanged for 3 s (above
                                                      |   zero, but on a simulated GPU) /
                                                      |   --ready-timeout
            revoked or lost: SIGTERM group once, SIGKILL after --grace-s
                             (by the local agent when it supervises the command)
                                                      v
                                   CMD exited -> group gone -> release -> exit

Exit codes: the command's own (128+N when a signal N ended it); 75 when the lease
was revoked or lost (preempted, drained); 124 when ``--max-wait`` passed before a
grant; 65 when the request can never be granted (rejected); 69 when no controller
answered; 127/126 when the command cannot be found/run; 130 when interrupted while
waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.live import Live
from rich.text import Text

from ..agent.local import agent_request, local_workers
from ..client import ApiError, ArbiterClient, ControllerUnreachable, NotGranted, pending_text
from ..core import ArbiterError, InvalidInput, format_mb, format_s, parse_mb, parse_priority
from .access import TOKEN_HELP, Credentials, credentials, refusal

EXIT_PREEMPTED = 75
EXIT_MAX_WAIT = 124
EXIT_REJECTED = 65
EXIT_UNREACHABLE = 69
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
EXIT_INTERRUPTED = 130
VISIBLE_DEVICES = (
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STABLE_S = 3.0
UNSEEN_NOTE_S = 5.0  # no GPU memory seen this long: say why the lease is still loading
AGENT_MARGIN_S = 5.0  # beyond the grace, before run kills what the agent did not
Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class RunOptions:
    command: list[str]
    request: Json
    controller: str | None = None
    credentials: Credentials = field(default_factory=lambda: Credentials(None))
    ready_url: str | None = None
    ready_after_s: float | None = None
    ready_timeout_s: float = 120.0
    grace_s: float = 10.0


HELPERS_END_S = 5.0
"""Once the command ended: how long its renewal, watch and readiness tasks may take to end."""


def say(text: str) -> None:
    print(f"gpu-arbiter run: {text}", file=sys.stderr, flush=True)


class Interrupted(Exception):
    """A signal arrived while the request was still waiting."""


class Runner:
    def __init__(self, options: RunOptions, client: ArbiterClient) -> None:
        self.options = options
        self.client = client
        self.lease: Json = {}
        self.revoked: str | None = None  # why the lease was taken back or lost
        self.child: Child | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._signals: list[int] = []
        self._worker = ""
        self._simulated = False  # the local agent's GPUs are simulated
        self._group_termed_at: float | None = None  # when the group got its one SIGTERM

    # ------------------------------------------------------------------ waiting

    async def acquire(self) -> int | None:
        """The lease granted (None), or the exit code saying why not."""
        try:
            self.lease = await self.client.create_lease(**self.options.request)
        except NotGranted as error:  # ended before it was granted (max_wait_s passed...)
            say(f"lease {error.lease_id} was not granted: {error.state} ({error.reason})")
            return EXIT_MAX_WAIT if error.state == "timed_out" else EXIT_REJECTED
        except ApiError as error:  # it answered: a refusal; 5xx: it cannot serve now
            say(f"request refused: {refusal(error, self.options.credentials)}")
            return EXIT_UNREACHABLE if error.status >= 500 else EXIT_REJECTED
        if self.lease["state"] == "pending":
            try:
                await self._wait()
            except (Interrupted, asyncio.CancelledError):
                with contextlib.suppress(ArbiterError):
                    await self.client.release(self.lease["id"])
                say("interrupted while waiting; the request was cancelled")
                return EXIT_INTERRUPTED
        state = self.lease["state"]
        if state in ("loading", "active"):
            return None
        reason = self.lease.get("end_reason") or state
        say(f"lease {self.lease['id']} was not granted: {state} ({reason})")
        return EXIT_MAX_WAIT if state == "timed_out" else EXIT_REJECTED

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        waiting = asyncio.current_task()
        for signum in FORWARDED:
            loop.add_signal_handler(signum, lambda: waiting and waiting.cancel())
        started = time.monotonic()
        live = sys.stderr.isatty()
        console = Console(stderr=True)
        try:
            if not live:
                say(f"waiting for lease {self.lease['id']}: {pending_text(self.lease)}")
                await self._poll(30.0)
                return
            with Live(_waiting(self.lease, 0.0), console=console, transient=True) as view:
                while self.lease["state"] == "pending":
                    await self._poll(1.0)
                    view.update(_waiting(self.lease, time.monotonic() - started))
        finally:
            for signum in FORWARDED:
                loop.remove_signal_handler(signum)

    async def _poll(self, wait_s: float) -> None:
        """Long-polls until the request leaves ``pending`` (or ``wait_s`` for the view)."""
        backoff = 0.5
        once = wait_s < 30.0
        while self.lease["state"] == "pending":
            try:
                self.lease = await self.client.lease(
                    self.lease["id"], wait_s=wait_s, state="pending"
                )
                backoff = 0.5
            except ControllerUnreachable:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            if once:
                return

    # ------------------------------------------------------------------ running

    async def execute(self) -> int:
        lease = self.lease
        worker = self._worker = str(lease["worker"])
        indexes = ",".join(g.rpartition(":")[2] for g in lease["gpus"])
        env = dict(os.environ)
        local = await agent_request(worker, {"op": "env"})
        if local and local.get("ok"):
            env.update({str(k): str(v) for k, v in (local.get("env") or {}).items()})
            self._simulated = bool(local.get("simulated"))
        env.update({name: indexes for name in VISIBLE_DEVICES})
        env["GPU_ARBITER_LEASE"] = str(lease["id"])
        env["GPU_ARBITER_FENCING_TOKEN"] = str(lease["token"])
        try:
            self.child = Child.start(self.options.command, env)
        except FileNotFoundError:
            say(f"command not found: {self.options.command[0]}")
            await self._release()
            return EXIT_NOT_FOUND
        except PermissionError:
            say(f"command not executable: {self.options.command[0]}")
            await self._release()
            return EXIT_NOT_EXECUTABLE
        await self._attach(worker)
        loop = asyncio.get_running_loop()
        for signum in FORWARDED:
            loop.add_signal_handler(signum, self._forward, signum)
        try:
            code = await self._supervise(worker)
        finally:
            for signum in FORWARDED:
                loop.remove_signal_handler(signum)
        await self._reap_group()
        await self._release()
        if self.revoked is not None:
            say(f"the command was stopped: lease {lease['id']} {self.revoked} (exit {code})")
            return EXIT_PREEMPTED
        return code

    async def _supervise(self, worker: str) -> int:
        assert self.child is not None
        helpers = [
            asyncio.create_task(self._renew(worker)),
            asyncio.create_task(self._watch()),
            asyncio.create_task(self._ready(worker)),
        ]
        try:
            returncode = await self.child.wait()
        finally:
            for task in helpers:
                task.cancel()
            # bounded: a helper that lost its cancellation (asyncio.wait_for in 3.11 can
            # swallow one) once kept run waiting here, its command long gone
            await asyncio.wait(helpers, timeout=HELPERS_END_S)
            if self._stopping is not None:
                await self._stopping
        return 128 - returncode if returncode < 0 else returncode

    def _forward(self, signum: int) -> None:
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, signum)

    async def _attach(self, worker: str) -> bool:
        assert self.child is not None
        pid = self.child.pid
        body = {"op": "attach", "lease": self.lease["id"], "pid": pid, "pgid": pid}
        answer = await agent_request(worker, body)
        return bool(answer and answer.get("ok"))

    async def _renew(self, worker: str) -> None:
        ttl_s = float(self.lease.get("ttl_s") or 30.0)
        while True:
            await asyncio.sleep(max(0.2, ttl_s / 3))
            try:
                self.lease = await self.client.renew(self.lease["id"])
            except (ControllerUnreachable, httpx.HTTPError):
                continue  # the lease is not lost until the controller says so
            except ApiError as error:
                if error.status in (404, 409):
                    self._take_back(f"was lost ({error})")
                    return
                continue
            await self._attach(worker)  # a restarted agent learns the process again

    async def _watch(self) -> None:
        state = str(self.lease["state"])
        backoff = 0.5
        while True:
            try:
                lease = await self.client.lease(self.lease["id"], wait_s=30.0, state=state)
                backoff = 0.5
            except ControllerUnreachable:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            state = str(lease["state"])
            if state == "revoking" or lease.get("ended_at") is not None:
                reason = lease.get("revoke_reason") or lease.get("end_reason") or state
                self._take_back(f"was revoked ({reason})" if state == "revoking" else state)
                return

    def _take_back(self, why: str) -> None:
        if self.revoked is None:
            self.revoked = why
            say(
                f"lease {self.lease['id']} {why}: stopping the command "
                f"(SIGTERM, SIGKILL after {self.options.grace_s:g}s)"
            )
            self._stopping = asyncio.create_task(self._stop_child())

    async def _stop_child(self) -> None:
        """One SIGTERM to the group, SIGKILL after the grace. Where the local agent
        supervises the command it sends both (it may have started already, seeing the
        revocation first): ``run`` only steps in if the agent has not stopped it by
        the grace and a margin."""
        assert self.child is not None
        pgid = self.child.pid
        grace_s = self.options.grace_s
        self._group_termed_at = time.monotonic()
        body = {"op": "stop", "lease": self.lease["id"], "grace_s": grace_s}
        answer = await agent_request(self._worker, body)
        by_agent = bool(answer and answer.get("ok"))
        if not by_agent:
            _killpg(pgid, signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s + (AGENT_MARGIN_S if by_agent else 0)):
                await self.child.wait()
        except TimeoutError:
            say(f"the command ignored SIGTERM for {grace_s:g}s: SIGKILL")
            _killpg(pgid, signal.SIGKILL)

    async def _reap_group(self) -> None:
        """What the command left in its group is ended too: the lease covers the group.
        A group that already had its SIGTERM gets none again, only SIGKILL after the grace."""
        assert self.child is not None
        pgid = self.child.pid
        if not _group_alive(pgid):
            return
        if self._group_termed_at is None:
            self._group_termed_at = time.monotonic()
            _killpg(pgid, signal.SIGTERM)
        deadline = self._group_termed_at + self.options.grace_s
        while _group_alive(pgid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        while _group_alive(pgid):
            _killpg(pgid, signal.SIGKILL)
            await asyncio.sleep(0.05)

    async def _ready(self, worker: str) -> None:
        if self.lease.get("state") != "loading":
            return
        options = self.options
        if options.ready_after_s is not None:
            await asyncio.sleep(options.ready_after_s)
        else:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(options.ready_timeout_s):
                    await self._loaded(worker)
        backoff = 0.5
        while True:
            try:
                self.lease = await self.client.ready(self.lease["id"])
                return
            except ControllerUnreachable:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except ApiError:
                return  # no longer held: the watcher handles it

    async def _loaded(self, worker: str) -> None:
        """Returns once ``--ready-url`` answers 2xx, or else once the process's GPU memory
        (as the local agent's probe sees it) has not changed for ``STABLE_S``: above zero on
        a real GPU (a load that has not started is not over), any amount on a simulated
        one (a command there may never report memory)."""
        if self.options.ready_url is not None:
            async with httpx.AsyncClient(timeout=2.0) as http:
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get(self.options.ready_url)).is_success:
                            return
                    await asyncio.sleep(0.5)
        started = last_at = time.monotonic()
        last: int | None = None
        told = False
        while True:
            answer = await agent_request(worker, {"op": "usage", "lease": self.lease["id"]})
            used = answer.get("used_mb") if answer else None
            now = time.monotonic()
            if not isinstance(used, int) or used != last:
                last, last_at = used if isinstance(used, int) else None, now
            elif (used > 0 or self._simulated) and now - last_at >= STABLE_S:
                return
            if not told and not last and now - started >= UNSEEN_NOTE_S:
                told = True
                self._say_why_loading(seen=used is not None)
            await asyncio.sleep(0.5)

    def _say_why_loading(self, *, seen: bool) -> None:
        """Once: why the lease is still loading (its GPU's load gate holds other loads)."""
        why = (
            "the command has used no GPU memory yet"
            if seen
            else "no agent on this host reports the command's GPU memory"
        )
        say(
            f"lease {self.lease['id']} is still loading: {why}; other loads on "
            f"{', '.join(self.lease['gpus'])} wait until it is ready, at the latest after "
            f"{format_s(self.options.ready_timeout_s)} (--ready-timeout; --ready-url URL or "
            "--ready-after S say when it is)"
        )

    async def _release(self) -> None:
        for _ in range(20):
            try:
                await self.client.release(self.lease["id"])
                return
            except ControllerUnreachable:
                await asyncio.sleep(1.0)
            except ApiError:
                return


class Child:
    """The command: a process in a group of its own, whose exit the event loop sees
    through a pidfd (read once it exits, then reaped here), not through asyncio's child
    watcher: under load, that watcher's thread once reaped a command that exited at once
    and its exit never reached ``wait()``, leaving ``run`` waiting with its lease lapsed.
    Where pidfds do not exist (Linux before 5.3), the exit is polled every 50 ms."""

    POLL_S = 0.05

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid
        self._exited = asyncio.Event()
        self._fd: int | None = None
        self._poller: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()
        try:
            self._fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self._poller = loop.create_task(self._poll())
        else:
            loop.add_reader(self._fd, self._check)
        self._check()

    @classmethod
    def start(cls, command: list[str], env: dict[str, str]) -> Child:
        """Starts ``command`` in a group of its own (FileNotFoundError, PermissionError
        as ``exec`` raises them)."""
        return cls(subprocess.Popen(command, env=env, process_group=0))

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def _check(self) -> None:
        if self._exited.is_set() or self.popen.poll() is None:
            return
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        self._exited.set()

    async def _poll(self) -> None:
        while not self._exited.is_set():
            await asyncio.sleep(self.POLL_S)
            self._check()

    async def wait(self) -> int:
        """The exit status (negative: the signal that ended it), once it exited."""
        await self._exited.wait()
        code = self.popen.returncode
        assert code is not None
        return code


def _killpg(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _group_has_live_member(pgid)


def _group_has_live_member(pgid: int) -> bool:
    """A group whose members are all zombies holds no memory (the driver freed it)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _waiting(lease: Json, waited_s: float) -> Text:
    line = Text()
    line.append("waiting ", style="bold yellow")
    line.append(f"{format_s(waited_s):>5} ", style="bold")
    gpus = f" x {lease['gpu_count']} GPUs" if lease["gpu_count"] > 1 else ""
    line.append(f"for {format_mb(lease['vram_mb'])}{gpus} ({lease['id']}) - ")
    line.append(pending_text(lease))
    return line


async def _local_worker(request: Json) -> None:
    """Without ``--worker``, the lease is asked on this host's worker when exactly one agent
    runs here: the command runs here, so its GPUs must be here."""
    constraints = request["constraints"]
    if "worker" in constraints:
        return
    here = await local_workers()
    if len(here) == 1:
        constraints["worker"] = here[0]
    elif not here:
        say("no agent runs on this host: the granted GPUs may be on another machine")


async def _main(options: RunOptions) -> int:
    await _local_worker(options.request)
    async with ArbiterClient(options.controller, token=options.credentials.token) as client:
        runner = Runner(options, client)
        try:
            refused = await runner.acquire()
        except ControllerUnreachable as error:
            say(str(error))
            return EXIT_UNREACHABLE
        if refused is not None:
            return refused
        say(f"lease {runner.lease['id']} granted on {', '.join(runner.lease['gpus'])}")
        return await runner.execute()


def _printable(text: str) -> str:
    """A holder has no control characters: a newline in an argument shows as a space."""
    return "".join(" " if not c.isprintable() else c for c in text)


BARE_MIB_BELOW = 1024
"""``--vram`` needs a unit below this many MiB: ``30`` is more likely 30G than 30 MiB."""


def parse_vram(text: str) -> int:
    """``--vram``: ``8G``, ``512M``, ``24000`` (MiB); a bare number below 1024 is refused
    (``did you mean 30G?``) rather than taken as a few MiB."""
    mb = parse_mb(text, "--vram")
    number = text.strip()
    if number.isdigit() and mb < BARE_MIB_BELOW:
        raise InvalidInput(
            "--vram", f"{number} has no unit: did you mean {number}G? (write {number}M for MiB)"
        )
    return mb


def build_request(
    *,
    vram: str,
    gpus: int,
    priority: str,
    arch: list[str] | None,
    min_cc: str | None,
    worker: str | None,
    ttl_s: float,
    max_wait_s: float | None,
    holder: str | None,
    command: list[str],
) -> Json:
    constraints: Json = {}
    if arch:
        constraints["gpu_arch"] = arch
    if min_cc is not None:
        constraints["min_compute_capability"] = min_cc
    if worker is not None:
        constraints["worker"] = worker
    return {
        "vram_mb": parse_vram(vram),
        "gpus": gpus,
        "priority": parse_priority(priority, "--priority"),
        "constraints": constraints,
        "holder": holder or _printable(f"run@{socket.gethostname()}: {shlex.join(command)}")[:256],
        "metadata": {"host": socket.gethostname()[:200], "run_pid": os.getpid()},
        "ttl_s": ttl_s,
        "max_wait_s": max_wait_s,
    }


def _opt(text: str, *names: str, envvar: str | None = None, **more: Any) -> Any:
    return typer.Option(*names, envvar=envvar, help=text, show_default=False, **more)


def run(
    command: Annotated[list[str], typer.Argument(help="The command, after --.")],
    vram: Annotated[str, _opt("VRAM per GPU: 8G, 512M, 24000 (MiB).")] = "1G",
    gpus: Annotated[int, _opt("Number of GPUs (all on one worker).", min=1, max=64)] = 1,
    priority: Annotated[
        str, _opt("0..1000 or batch, background, normal, interactive, critical.")
    ] = "normal",
    arch: Annotated[list[str] | None, _opt("Accepted GPU architecture (repeat): sm_86.")] = None,
    min_cc: Annotated[str | None, _opt("Minimum compute capability, e.g. 8.0.")] = None,
    worker: Annotated[str | None, _opt("Only this worker.")] = None,
    ttl: Annotated[float, _opt("Lease TTL in seconds (renewed every ttl/3).", min=1)] = 30.0,
    max_wait: Annotated[float | None, _opt("Give up after waiting this long (s).", min=0)] = None,
    ready_url: Annotated[str | None, _opt("Ready once this URL answers 2xx.")] = None,
    ready_after: Annotated[
        float | None, _opt("Ready this many seconds after start (0: at once).", min=0)
    ] = None,
    ready_timeout: Annotated[
        float, _opt("Ready at the latest after this many seconds (default 120).", min=0)
    ] = 120.0,
    grace_s: Annotated[float, _opt("Seconds between SIGTERM and SIGKILL.", min=0)] = 10.0,
    holder: Annotated[str | None, _opt("Who holds the lease (shown in the queue).")] = None,
    controller: Annotated[
        str | None, _opt("Controller URL(s), comma-separated.", envvar="GPU_ARBITER_URL")
    ] = None,
    token: Annotated[str | None, _opt(TOKEN_HELP, envvar="GPU_ARBITER_TOKEN")] = None,
) -> None:
    """Run a command holding a lease of VRAM for its whole life.

    The lease is loading (its GPUs' load gate holds other loads) until it is ready: once
    --ready-url answers, after --ready-after, or by default once the command's GPU memory
    has not changed for 3 s, above zero on a real GPU, any amount on a simulated one; at
    the latest after --ready-timeout."""
    if ready_url is not None and ready_after is not None:
        raise typer.BadParameter("give --ready-url or --ready-after, not both")
    try:
        request = build_request(
            vram=vram,
            gpus=gpus,
            priority=priority,
            arch=arch,
            min_cc=min_cc,
            worker=worker,
            ttl_s=ttl,
            max_wait_s=max_wait,
            holder=holder,
            command=command,
        )
        found = credentials(controller, token)
    except ArbiterError as error:
        raise typer.BadParameter(str(error)) from error
    options = RunOptions(
        command=command,
        request=request,
        controller=controller,
        credentials=found,
        ready_url=ready_url,
        ready_after_s=ready_after,
        ready_timeout_s=ready_timeout,
        grace_s=grace_s,
    )
    raise typer.Exit(asyncio.run(_main(options)))
