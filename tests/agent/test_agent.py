"""The agent against a stand-in controller (an httpx mock transport): what it registers
and heartbeats, how it stops a revoked lease's process and reports it, what it keeps
across a restart, and what its local endpoint accepts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_arbiter.agent.agent import Agent, AgentConfig
from gpu_arbiter.agent.local import RUNTIME_DIR_ENV, agent_request
from gpu_arbiter.agent.probes import FakeProbe, report_usage
from gpu_arbiter.client import ArbiterClient

pytestmark = pytest.mark.timeout(60)


class Controller:
    """Answers register and heartbeat; ``revoking`` is what the next answers revoke."""

    def __init__(self) -> None:
        self.heartbeats: list[dict[str, Any]] = []
        self.registered: list[dict[str, Any]] = []
        self.held: set[str] = set()
        self.revoking: set[str] = set()
        self.changed = asyncio.Event()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if request.url.path == "/v1/workers":
            self.registered.append(body)
            return httpx.Response(201, json={"name": body["name"]})
        self.heartbeats.append(body)
        self.held -= set(body["stopped"])  # the controller releases what stopped
        self.changed.set()
        answer = {"name": "box", "state": "online", "leases": sorted(self.held)}
        return httpx.Response(200, json={**answer, "revoking": sorted(self.revoking & self.held)})

    async def until(self, predicate: Any) -> dict[str, Any]:
        async with asyncio.timeout(20):
            while True:
                if self.heartbeats and predicate(self.heartbeats[-1]):
                    return self.heartbeats[-1]
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=0)
    yield proc
    proc.kill()
    proc.wait()


def _agent(
    runtime: Path,
    controller: Controller,
    grace_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
) -> Agent:
    usage = runtime / "usage"
    usage.mkdir(exist_ok=True)
    client = ArbiterClient("http://ctl", transport=httpx.MockTransport(controller))
    probe = FakeProbe.from_spec("2x24G:sm_86", usage_dir=usage)
    config = AgentConfig(name="box", heartbeat_s=0.1, grace_s=grace_s, headroom_mb=0)
    return Agent(config, probe, client=client, clock=clock)


@contextlib.asynccontextmanager
async def _running(agent: Agent) -> AsyncIterator[None]:
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    try:
        yield
    finally:
        stop.set()
        await running


async def test_a_revoked_lease_is_stopped_then_reported_and_forgotten(
    runtime: Path, child: subprocess.Popen[bytes]
) -> None:
    controller = Controller()
    agent = _agent(runtime, controller)
    async with _running(agent):
        await controller.until(lambda hb: True)
        assert controller.registered[0]["gpus"][0]["total_mb"] == 24576
        env = await agent_request("box", {"op": "env"})
        assert env is not None
        assert env["env"]["GPU_ARBITER_FAKE_USAGE_DIR"] == str(runtime / "usage")

        controller.held.add("lease-1")  # granted before the holder attaches its process
        attach = {"op": "attach", "lease": "lease-1", "pid": child.pid, "pgid": child.pid}
        assert await agent_request("box", attach) == {"ok": True}
        report_usage({1: 3000}, pid=child.pid, usage_dir=runtime / "usage")
        agent_probe = agent.probe
        assert isinstance(agent_probe, FakeProbe)
        agent_probe.fail(0)
        beat = await controller.until(lambda hb: hb["stale"] == [0])
        assert [g["index"] for g in beat["gpus"]] == [1]  # no reading for a stale GPU
        agent_probe.recover(0)
        beat = await controller.until(lambda hb: not hb["stale"] and hb["gpus"][1].get("processes"))
        assert beat["stale"] == []
        assert beat["gpus"][1]["processes"] == [
            {"pid": child.pid, "used_mb": 3000, "lease": "lease-1"}
        ]
        assert beat["leases"] == ["lease-1"]
        usage = await agent_request("box", {"op": "usage", "lease": "lease-1"})
        assert usage == {"ok": True, "used_mb": 3000}

        controller.revoking.add("lease-1")
        beat = await controller.until(lambda hb: hb["stopped"] == ["lease-1"])
        assert child.poll() is not None  # stopped before it was reported
        assert beat["leases"] == []
        await controller.until(lambda hb: hb["stopped"] == [])  # released: forgotten
        assert json.loads((runtime / "agent-box.leases.json").read_text()) == {}


async def test_a_restarted_agent_supervises_the_same_processes_again(
    runtime: Path, child: subprocess.Popen[bytes]
) -> None:
    (runtime / "agent-box.leases.json").write_text(
        json.dumps(
            {
                "alive": [child.pid, child.pid, _start_time(child.pid)],
                "reused": [os.getpid(), os.getpid(), 1],  # same pid, another process
            }
        )
    )
    controller = Controller()
    controller.held |= {"alive", "reused"}
    agent = _agent(runtime, controller)
    async with _running(agent):
        beat = await controller.until(lambda hb: True)
        assert beat["leases"] == ["alive"]
        assert beat["stopped"] == ["reused"]  # never signalled: reported as ended


async def test_a_process_whose_lease_the_controller_no_longer_holds_is_stopped(
    runtime: Path, child: subprocess.Popen[bytes]
) -> None:
    """A lease that lapsed (its ``run`` was killed, nobody renewed) leaves its process on
    no lease: the agent stops it, reports it stopped, and forgets it."""
    controller = Controller()
    agent = _agent(runtime, controller)
    async with _running(agent):
        await controller.until(lambda hb: True)
        attach = {"op": "attach", "lease": "lease-1", "pid": child.pid, "pgid": child.pid}
        assert await agent_request("box", attach) == {"ok": True}  # the controller: no lease
        beat = await controller.until(lambda hb: hb["stopped"] == ["lease-1"])
        assert child.poll() is not None  # stopped, then reported
        assert beat["leases"] == []
        await controller.until(lambda hb: hb["stopped"] == [])  # forgotten


async def test_an_answer_older_than_an_attachment_does_not_judge_it(
    runtime: Path, child: subprocess.Popen[bytes]
) -> None:
    agent = _agent(runtime, Controller())
    sent_at = time.monotonic()  # a heartbeat leaves; the lease is granted, then attached
    attach = {"op": "attach", "lease": "lease-1", "pid": child.pid, "pgid": child.pid}
    assert await agent._local(attach, 0) == {"ok": True}
    agent._act({"leases": [], "revoking": []}, sent_at)  # its answer cannot know the lease
    agent._act({"revoking": []}, time.monotonic())  # an answer without the list says nothing
    await asyncio.sleep(0.3)
    assert child.poll() is None
    agent._act({"leases": [], "revoking": []}, time.monotonic())  # a later one can
    async with asyncio.timeout(20):
        while child.poll() is None:
            await asyncio.sleep(0.05)
    await agent.supervisor.close()


async def test_attach_refuses_a_process_of_another_user(
    runtime: Path, child: subprocess.Popen[bytes]
) -> None:
    agent = _agent(runtime, Controller())
    other_uid = os.stat(f"/proc/{child.pid}").st_uid + 1
    request = {"op": "attach", "lease": "lease-1", "pid": child.pid, "pgid": child.pid}
    answer = await agent._local(request, other_uid)
    assert answer["ok"] is False
    assert "another user" in answer["error"]
    assert agent.supervisor.get("lease-1") is None
    bad = await agent._local({"op": "attach", "lease": "lease-1", "pid": 1, "pgid": 1}, 0)
    assert bad["ok"] is False


async def test_a_second_agent_of_the_same_name_refuses_to_start(runtime: Path) -> None:
    controller = Controller()
    async with _running(_agent(runtime, controller)):
        await controller.until(lambda hb: True)
        with pytest.raises(RuntimeError, match="another agent"):
            await _agent(runtime, controller).run(asyncio.Event())


# Appends the time of each SIGTERM to a file; exits LINGER seconds after the first.
TERM_COUNTER = """
import signal, sys, time
terms = []
def term(*_):
    terms.append(time.time())
    with open(sys.argv[1], "a") as out:
        out.write(f"{terms[-1]}\\n")
signal.signal(signal.SIGTERM, term)
while not terms or time.time() - terms[0] < float(sys.argv[2]):
    time.sleep(0.01)
"""


@contextlib.contextmanager
def _term_counter(path: Path, linger_s: float) -> Iterator[subprocess.Popen[bytes]]:
    command = [sys.executable, "-c", TERM_COUNTER, str(path), str(linger_s)]
    proc = subprocess.Popen(command, process_group=0)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _terms(path: Path) -> list[float]:
    return [float(line) for line in path.read_text().split()] if path.exists() else []


async def test_a_holder_that_stops_its_process_itself_gets_to_do_it(runtime: Path) -> None:
    """attach with holder_stops_s: on a revocation the agent does not SIGTERM at once;
    the holder's own stop (the ``stop`` op) is the one SIGTERM, even when the agent's
    deferred stop comes due while the process is still exiting; the lease is reported
    stopped only once the process has exited."""
    terms = runtime / "terms"
    controller = Controller()
    async with _running(_agent(runtime, controller, grace_s=5.0)):
        await controller.until(lambda hb: True)
        with _term_counter(terms, linger_s=3.0) as child:
            controller.held.add("lease-1")
            attach = {"op": "attach", "lease": "lease-1", "pid": child.pid, "pgid": child.pid}
            assert await agent_request("box", {**attach, "holder_stops_s": 2.0}) == {"ok": True}
            controller.revoking.add("lease-1")
            beats = len(controller.heartbeats)
            await controller.until(lambda hb: len(controller.heartbeats) > beats + 3)
            assert _terms(terms) == []  # the holder's requests are finishing
            stop = {"op": "stop", "lease": "lease-1", "grace_s": 5.0}
            stopped_at = time.time()
            assert await agent_request("box", stop) == {"ok": True}
            beat = await controller.until(lambda hb: hb["stopped"] == ["lease-1"])
            assert child.poll() is not None  # exited before it was reported
            assert beat["leases"] == []
        [term] = _terms(terms)  # the agent's own (due after 2 s) was not sent: one SIGTERM
        assert term >= stopped_at


async def test_a_holder_that_does_not_stop_its_process_is_stopped_after_at_most_the_grace(
    runtime: Path,
) -> None:
    """The holder's seconds are bounded by the agent's --grace-s: a holder that says an
    hour, then never stops its process, has it stopped after the agent's grace."""
    terms = runtime / "terms"
    controller = Controller()
    async with _running(_agent(runtime, controller, grace_s=1.0)):
        await controller.until(lambda hb: True)
        with _term_counter(terms, linger_s=0.2) as child:
            controller.held.add("lease-1")
            attach = {"op": "attach", "lease": "lease-1", "pid": child.pid, "pgid": child.pid}
            assert await agent_request("box", {**attach, "holder_stops_s": 3600}) == {"ok": True}
            revoked_at = time.time()
            controller.revoking.add("lease-1")
            await controller.until(lambda hb: hb["stopped"] == ["lease-1"])
            assert child.poll() == 0  # SIGTERM, not SIGKILL
        [term] = _terms(terms)
        assert 1.0 <= term - revoked_at < 5.0


async def test_attach_refuses_holder_stops_s_that_is_not_seconds(
    runtime: Path, child: subprocess.Popen[bytes]
) -> None:
    agent = _agent(runtime, Controller())
    attach = {"op": "attach", "lease": "lease-1", "pid": child.pid, "pgid": child.pid}
    for bad in ("10", True, -1, 3601, [1]):
        answer = await agent._local({**attach, "holder_stops_s": bad}, 0)
        assert answer == {"ok": False, "error": "holder_stops_s must be seconds, 0 to 3600"}
        assert agent.supervisor.get("lease-1") is None


class Clock:
    def __init__(self) -> None:
        self.time = 100.0

    def __call__(self) -> float:
        return self.time


async def _beat_gpu(agent: Agent, index: int) -> dict[str, Any]:
    gpu: dict[str, Any] = agent._heartbeat_body(await agent.probe.snapshot())["gpus"][index]
    return gpu


async def test_an_accounted_group_s_memory_is_split_among_its_leases(
    runtime: Path, child: subprocess.Popen[bytes]
) -> None:
    """The group of one ``ollama serve``: its memory is reported per lease of the account,
    its process listed as no lease's (the controller counts it once, not as external
    beside the leases); not repeated within 30 s it is dropped."""
    clock = Clock()
    agent = _agent(runtime, Controller(), clock=clock)
    report_usage({1: 5001}, pid=child.pid, usage_dir=runtime / "usage")
    account = {"op": "account", "pgid": child.pid, "shares": {"lease-a": 2000, "lease-b": 3000}}
    assert await agent._local(account, os.getuid()) == {"ok": True}
    gpu = await _beat_gpu(agent, 1)
    assert gpu["lease_used_mb"] == {"lease-a": 2000, "lease-b": 3001}  # exactly the 5001
    assert gpu["processes"] == [{"pid": child.pid, "used_mb": 5001, "lease": None}]
    assert "lease_used_mb" not in await _beat_gpu(agent, 0)  # it has nothing on GPU 0
    clock.time += 29
    assert await agent._local(account, 0) == {"ok": True}  # said again
    clock.time += 29
    assert "lease_used_mb" in await _beat_gpu(agent, 1)
    clock.time += 2
    assert "lease_used_mb" not in await _beat_gpu(agent, 1)  # not said for 31 s: dropped
    assert await agent._local(account, 0) == {"ok": True}
    assert await agent._local({**account, "shares": {}}, 0) == {"ok": True}
    assert "lease_used_mb" not in await _beat_gpu(agent, 1)  # dropped at once


async def test_a_process_supervised_for_a_lease_stays_that_lease_s_in_an_account(
    runtime: Path, child: subprocess.Popen[bytes]
) -> None:
    agent = _agent(runtime, Controller())
    report_usage({0: 1000}, pid=child.pid, usage_dir=runtime / "usage")
    attach = {"op": "attach", "lease": "lease-1", "pid": child.pid, "pgid": child.pid}
    assert await agent._local(attach, 0) == {"ok": True}
    account = {"op": "account", "pgid": child.pid, "shares": {"lease-a": 1}}
    assert await agent._local(account, 0) == {"ok": True}
    gpu = await _beat_gpu(agent, 0)
    assert gpu["processes"] == [{"pid": child.pid, "used_mb": 1000, "lease": "lease-1"}]
    assert "lease_used_mb" not in gpu
    await agent.supervisor.close()


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"pgid": 1}, "pgid must be a process group id"),
        ({"pgid": "123"}, "pgid must be a process group id"),
        ({"pgid": True}, "pgid must be a process group id"),
        ({"pgid": None}, "pgid must be a process group id"),
        ({"pgid": 2**22 + 1}, "pgid: no process group"),
        ({"shares": [["lease-a", 1]]}, "shares must be an object"),
        ({"shares": {"lease-a": -1}}, "shares['lease-a'] must be MiB"),
        ({"shares": {"lease-a": 2**40 + 1}}, "shares['lease-a'] must be MiB"),
        ({"shares": {"": 1}}, "shares: each key must be a lease id"),
        ({"shares": {f"lease-{n}": 1 for n in range(257)}}, "shares: at most 256 leases"),
    ],
)
async def test_account_refuses_bad_input_naming_the_field(
    runtime: Path, child: subprocess.Popen[bytes], change: dict[str, Any], error: str
) -> None:
    agent = _agent(runtime, Controller())
    report_usage({0: 1000}, pid=child.pid, usage_dir=runtime / "usage")
    request = {"op": "account", "pgid": child.pid, "shares": {"lease-a": 1}, **change}
    answer = await agent._local(request, 0)
    assert answer["ok"] is False and answer["error"].startswith(error), answer
    assert "lease_used_mb" not in await _beat_gpu(agent, 0)  # nothing changed


async def test_account_refuses_another_user_s_group_and_a_process_leading_none(
    runtime: Path, child: subprocess.Popen[bytes]
) -> None:
    agent = _agent(runtime, Controller())
    other_uid = os.stat(f"/proc/{child.pid}").st_uid + 1
    request = {"op": "account", "pgid": child.pid, "shares": {"lease-a": 1}}
    answer = await agent._local(request, other_uid)
    assert answer == {"ok": False, "error": f"pgid: process {child.pid} belongs to another user"}
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as member:
        try:  # a process in this test's group leads none
            answer = await agent._local({**request, "pgid": member.pid}, 0)
            assert answer == {"ok": False, "error": f"pgid: no process group {member.pid}"}
        finally:
            member.kill()
    assert agent.accounts.current() == {}


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return int(stat.read().rsplit(b")", 1)[1].split()[19])
