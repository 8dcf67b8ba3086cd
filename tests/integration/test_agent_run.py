"""The agent and ``gpu-arbiter run`` as real processes against a real controller: fake
probes whose memory follows the real child processes that ``run`` starts."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_arbiter.agent.supervisor import process_alive

from .agents import (
    AgentProcess,
    ExitWatch,
    RunProcess,
    Started,
    env_for,
    free_port,
    lease_of,
    worker_state,
)
from .conftest import Server, events, gpu_figures, wait_for

pytestmark = pytest.mark.timeout(180)


def test_run_holds_a_lease_for_the_life_of_its_command(
    start_server: Callable[..., Server], tmp_path: Path, cleanup: Started
) -> None:
    server = start_server()
    admin = server.client()
    cleanup.append(admin)
    runtime = tmp_path / "rt"
    agent = AgentProcess(server.url, server.admin_token, "box-a", runtime, "2x24G:sm_86")
    cleanup.append(agent.start())
    wait_for(lambda: worker_state(admin, "box-a") == "online", what="box-a online")

    run = RunProcess(server.url, server.admin_token, runtime, "job", "--vram", "4G", exit_code=3)
    cleanup.append(run.start())
    info = run.wait_child()
    lease = lease_of(admin, "job")
    assert lease is not None
    assert lease["constraints"]["worker"] == "box-a"  # the worker of this host's agent
    index = lease["gpus"][0].split(":")[1]
    for name in ("CUDA", "NVIDIA", "HIP", "ROCR"):
        assert info["env"][f"{name}_VISIBLE_DEVICES"] == index
    assert info["env"]["GPU_ARBITER_LEASE"] == lease["id"]
    assert info["env"]["GPU_ARBITER_FENCING_TOKEN"] == str(lease["token"])
    assert info["pgid"] == info["pid"]  # its own process group

    # memory appears on the probe; the agent supervises the child for that lease
    wait_for(lambda: gpu_figures(admin)[lease["gpus"][0]]["used_mb"] == 1000, what="usage")
    wait_for(lambda: lease["id"] in agent.attachments, what="the agent to supervise it")
    # ready by default once the child's GPU memory stopped growing
    wait_for(lambda: lease_of(admin, "job")["state"] == "active", what="ready")  # type: ignore[index]

    run.go()
    assert run.wait() == 3  # the command's own exit code
    ended = lease_of(admin, "job")
    assert ended is not None
    assert ended["state"] == "released"
    wait_for(lambda: gpu_figures(admin)[lease["gpus"][0]]["used_mb"] == 0, what="memory freed")


def test_preemption_kills_a_stubborn_child_and_grants_only_after_it_exited(
    start_server: Callable[..., Server], tmp_path: Path, cleanup: Started
) -> None:
    server = start_server()
    admin = server.client()
    cleanup.append(admin)
    runtime = tmp_path / "rt"
    for name in ("box-a", "box-b"):
        token = server.token("worker", name)
        agent = AgentProcess(server.url, token, name, runtime, "1x24G:sm_86")
        cleanup.append(agent.start())
        wait_for(lambda n=name: worker_state(admin, n) == "online", what=f"{name} online")
    client_token = server.token("client")

    low = RunProcess(
        server.url,
        client_token,
        runtime,
        "low",
        "--vram", "20G", "--priority", "batch", "--worker", "box-a",
        mb=20000,
        ignore_term=True,
    )  # fmt: skip
    cleanup.append(low.start())
    child = low.wait_child()
    exited = ExitWatch(child["pid"])
    wait_for(lambda: lease_of(admin, "low")["state"] == "active", what="low ready")  # type: ignore[index]

    high = RunProcess(
        server.url,
        client_token,
        runtime,
        "high",
        "--vram", "20G", "--priority", "interactive", "--worker", "box-a",
        mb=0,
    )  # fmt: skip
    cleanup.append(high.start())
    high_info = high.wait_child()
    exit_at = exited.wait()
    term_at = float((runtime / "low.term").read_text())

    granted = lease_of(admin, "high")
    assert granted is not None
    assert granted["worker"] == "box-a"
    assert exit_at <= granted["granted_at"]  # the victim had exited before the grant
    assert exit_at - term_at >= 0.5 * 0.9  # SIGTERM ignored: killed after the grace period
    assert high_info["env"]["CUDA_VISIBLE_DEVICES"] == "0"

    assert low.wait() == 75
    assert "revoked" in low.stderr
    victim = lease_of(admin, "low")
    assert victim is not None
    assert victim["state"] == "released"
    assert victim["revoke_reason"] == "preempted"
    high.go()
    assert high.wait() == 0


def test_agent_killed_goes_offline_once_keeps_leases_and_reconciles(
    start_server: Callable[..., Server], tmp_path: Path, cleanup: Started
) -> None:
    server = start_server("--heartbeat-timeout-s", "2")
    admin = server.client()
    cleanup.append(admin)
    runtime = tmp_path / "rt"
    agent = AgentProcess(server.url, server.admin_token, "box-a", runtime, "2x24G:sm_86")
    cleanup.append(agent.start())
    wait_for(lambda: worker_state(admin, "box-a") == "online", what="box-a online")
    token = server.admin_token
    short = RunProcess(server.url, token, runtime, "short", "--vram", "2G", "--ttl", "3")
    long = RunProcess(server.url, token, runtime, "long", "--vram", "2G", "--ttl", "60")
    for run in (short, long):
        cleanup.append(run.start())
        run.wait_child()
        wait_for(lambda r=run: lease_of(admin, r.holder)["id"] in agent.attachments, what="attach")  # type: ignore[index]

    agent.kill9()
    for run in (short, long):  # their children live on, orphaned; nobody renews
        assert run.proc is not None
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait(timeout=30)
    wait_for(lambda: worker_state(admin, "box-a") == "offline", what="box-a offline")
    held = {lease_of(admin, "short")["id"], lease_of(admin, "long")["id"]}  # type: ignore[index]
    figures = gpu_figures(admin)
    assert set().union(*(set(g["leases"]) for g in figures.values())) == held
    assert sum(g["committed_mb"] for g in figures.values()) == 4096  # memory still committed

    # the lease of a supervised process is revoked when its TTL lapses, not freed: the
    # orphan may still use the memory, and only its agent can say it stopped (I4)
    wait_for(lambda: lease_of(admin, "short")["state"] == "revoking", what="short TTL lapses")  # type: ignore[index]
    assert lease_of(admin, "short")["revoke_reason"] == "ttl_lapsed"  # type: ignore[index]
    assert sum(g["committed_mb"] for g in gpu_figures(admin).values()) == 4096
    assert lease_of(admin, "long")["state"] in ("loading", "active")  # type: ignore[index]

    cleanup.append(agent.start())  # restarted: supervises the orphans again
    wait_for(lambda: worker_state(admin, "box-a") == "online", what="box-a back")
    # the orphan whose lease was revoked meanwhile: the agent stops it, then reports it
    short_pid = short.info["pid"]  # type: ignore[index]
    wait_for(lambda: not process_alive(short_pid), what="the revoked orphan stopped")
    assert (runtime / "short.term").exists()
    wait_for(lambda: lease_of(admin, "short")["id"] not in agent.attachments, what="forgotten")  # type: ignore[index]
    ended = lease_of(admin, "short")
    assert (ended["state"], ended["end_reason"]) == ("released", "holder_stopped")  # type: ignore[index]
    assert not (runtime / "long.term").exists()  # the one with a lease runs on
    long_id = lease_of(admin, "long")["id"]  # type: ignore[index]
    assert admin.post(f"/v1/leases/{long_id}/revoke").status_code == 200
    wait_for(lambda: lease_of(admin, "long")["state"] == "released", what="agent stops it")  # type: ignore[index]
    assert lease_of(admin, "long")["end_reason"] == "holder_stopped"  # type: ignore[index]
    assert (runtime / "long.term").exists()  # the agent sent SIGTERM to the orphan
    assert len(events(admin, "worker.offline")) == 1


def test_controller_killed_and_restarted_loses_nothing(
    start_server: Callable[..., Server], tmp_path: Path, cleanup: Started
) -> None:
    port = str(free_port())
    state = tmp_path / "state"
    server = start_server("--port", port, state_dir=state)
    admin = server.client()
    cleanup.append(admin)
    runtime = tmp_path / "rt"
    for name in ("box-a", "box-b"):
        agent = AgentProcess(server.url, server.admin_token, name, runtime, "1x24G:sm_86")
        cleanup.append(agent.start())
        wait_for(lambda n=name: worker_state(admin, n) == "online", what=f"{name} online")
    runs = []
    for name in ("box-a", "box-b"):
        run = RunProcess(
            server.url, server.admin_token, runtime, f"on-{name}", "--vram", "8G", "--ttl", "6",
            "--worker", name,
        )  # fmt: skip
        cleanup.append(run.start())
        run.wait_child()
        runs.append(run)
    before = {r.holder: lease_of(admin, r.holder) for r in runs}

    server.kill9()
    server.start()
    admin = server.client()
    cleanup.append(admin)
    for name in ("box-a", "box-b"):
        wait_for(lambda n=name: worker_state(admin, n) == "online", what=f"{name} back")
    wait_for(  # the runs renewed through the restart
        lambda: all(
            lease_of(admin, h)["expires_at"] > before[h]["expires_at"]  # type: ignore[index]
            for h in before
        ),
        what="renewals",
    )
    for holder, lease in before.items():
        now = lease_of(admin, holder)
        assert now is not None
        for key in ("id", "token", "gpus"):
            assert now[key] == lease[key]
        assert now["state"] in ("loading", "active")

    late = RunProcess(server.url, server.admin_token, runtime, "late", "--vram", "8G", mb=0)
    cleanup.append(late.start())
    late.wait_child()
    fresh = lease_of(admin, "late")
    assert fresh is not None
    assert fresh["token"] > max(lease["token"] for lease in before.values())  # never reused

    for run in [*runs, late]:
        run.go()
        assert run.wait() == 0


def test_run_without_a_controller_says_how_to_start_one(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "gpu_arbiter", "run", "--controller", url, "--", "true"]
    done = subprocess.run(
        command, capture_output=True, text=True, env=env_for(tmp_path), timeout=60
    )
    assert done.returncode == 69
    assert "gpu-arbiter serve --local" in done.stderr


def test_serve_local_runs_the_controller_and_an_agent_for_this_machine(
    start_server: Callable[..., Server],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cleanup: Started,
) -> None:
    runtime = tmp_path / "rt"
    monkeypatch.setenv("GPU_ARBITER_RUNTIME_DIR", str(runtime))
    server = start_server("--local", "--simulate", "2x24G:sm_86")
    admin = server.client()
    cleanup.append(admin)
    workers = wait_for(lambda: admin.get("/v1/workers").json(), what="the local worker")
    assert len(workers) == 1
    assert [g["total_mb"] for g in workers[0]["gpus"]] == [24576, 24576]
    assert workers[0]["simulated"]  # a real agent, on the fake probe: it says so
    log = server.log.read_text()
    assert "simulated GPUs 2x24G:sm_86" in log
    assert f"GPU_ARBITER_TOKEN=$(cat {server.state_dir / 'admin.token'})" in log
    assert " run --vram 8G -- python3 -c " in log  # started as python -m: printed as such

    run = RunProcess(server.url, server.admin_token, runtime, "job", "--vram", "1G", mb=0)
    cleanup.append(run.start())
    run.wait_child()
    run.go()
    assert run.wait() == 0


def test_run_exit_codes_when_the_lease_is_not_granted(
    start_server: Callable[..., Server], tmp_path: Path, cleanup: Started
) -> None:
    server = start_server("--simulate", "1x24G:sm_86")  # a worker inside the controller
    admin = server.client()
    cleanup.append(admin)
    held = admin.post("/v1/leases", json={"vram_mb": 20480, "ttl_s": 120})
    assert held.status_code == 201, held.text

    def run(*options: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "gpu_arbiter", "run", "--controller", server.url]
        command += ["--token", server.admin_token, *options, "--", "true"]
        env = env_for(tmp_path)
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)

    too_big = run("--vram", "48G")
    assert too_big.returncode == 65
    assert "refused" in too_big.stderr

    waited = run("--vram", "20G", "--max-wait", "1")
    assert waited.returncode == 124
    assert "waiting for lease" in waited.stderr
    assert "timed_out" in waited.stderr

    at_once = run("--vram", "20G", "--max-wait", "0")  # 409 not_granted: a timeout, no crash
    assert at_once.returncode == 124, at_once.stderr
    assert "was not granted: timed_out (max_wait)" in at_once.stderr
    assert "Traceback" not in at_once.stderr

    other_digits = run("--vram", "1G", "--priority", "٨٠٠")  # ASCII digits only
    assert other_digits.returncode == 2
    assert "priority" in other_digits.stderr
