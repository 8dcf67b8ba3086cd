"""Supervised processes, end to end: a real controller, real agents and real ``run``
wrappers whose children record every signal they receive.

- A preempted child gets exactly one SIGTERM, then SIGKILL after the grace, however
  many supervisors (``run`` and the agent) see its lease revoked.
- A lease whose wrapper was killed lapses at its TTL, but where the agent supervises
  its process the memory stays committed until the agent saw the process exit (I4).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gpu_arbiter.agent.supervisor import process_alive

from .agents import AgentProcess, ExitWatch, RunProcess, Started, lease_of, worker_state
from .conftest import Server, gpu_figures, wait_for

pytestmark = pytest.mark.timeout(180)


def _cluster(
    start_server: Callable[..., Server], runtime: Path, cleanup: Started, agent_grace_s: str
) -> tuple[Server, httpx.Client, AgentProcess]:
    server = start_server()
    admin = server.client()
    cleanup.append(admin)
    token = server.token("worker", "box-a")
    agent = AgentProcess(
        server.url, token, "box-a", runtime, "1x24G:sm_86", "--grace-s", agent_grace_s
    )
    cleanup.append(agent.start())
    wait_for(lambda: worker_state(admin, "box-a") == "online", what="box-a online")
    return server, admin, agent


def _supervised_victim(
    server: Server,
    agent: AgentProcess,
    admin: httpx.Client,
    runtime: Path,
    cleanup: Started,
    *options: str,
    **child: object,
) -> tuple[RunProcess, dict[str, object]]:
    """A batch ``run`` holding 20 GiB on box-a, ready, its child supervised by the agent."""
    victim = RunProcess(
        server.url, server.token("client"), runtime, "victim",
        "--vram", "20G", "--priority", "batch", "--ready-after", "0.1", *options,
        mb=0, **child,  # type: ignore[arg-type]
    )  # fmt: skip
    cleanup.append(victim.start())
    info = victim.wait_child()
    wait_for(
        lambda: (
            (lease := lease_of(admin, "victim"))
            and lease["state"] == "active"
            and lease["id"] in agent.attachments
        ),
        what="the victim active, its child attached to the agent",
    )
    return victim, info


def _granted_only_after_the_victim_stopped(
    admin: httpx.Client, granted_id: str, stopped_no_earlier_than: float
) -> dict[str, object]:
    """The grant came after the victim's lease ended (released by whoever saw its process
    exit), and after the earliest moment the process could have exited (the child's own
    clock). Nothing depends on when this test's threads happen to run."""
    granted = admin.get(f"/v1/leases/{granted_id}").json()
    victim = lease_of(admin, "victim")
    assert victim is not None and victim["state"] == "released", victim
    assert victim["ended_at"] <= granted["granted_at"]  # I4: freed before it was granted
    assert granted["granted_at"] >= stopped_no_earlier_than
    return victim


def _preempt(admin: httpx.Client) -> str:
    answer = admin.post(
        "/v1/leases",
        json={"vram_mb": 20480, "priority": "interactive", "holder": "preemptor",
              "constraints": {"worker": "box-a"}},
    )  # fmt: skip
    assert answer.status_code in (201, 202), answer.text
    return str(answer.json()["id"])


# ---------------------------------------------------------------- exactly one SIGTERM


def test_a_preempted_child_gets_exactly_one_sigterm_from_run_and_agent_together(
    start_server: Callable[..., Server], tmp_path: Path, cleanup: Started
) -> None:
    """``run`` and the agent both see the revocation; the child, which takes 1.5 s to
    write its checkpoint after SIGTERM (and records each signal meanwhile), gets one."""
    checkpoint_s = 1.5
    runtime = tmp_path / "rt"
    server, admin, agent = _cluster(start_server, runtime, cleanup, agent_grace_s="4")
    victim, info = _supervised_victim(
        server, agent, admin, runtime, cleanup, "--grace-s", "4", checkpoint_s=checkpoint_s
    )
    exited = ExitWatch(int(info["pid"]))  # type: ignore[call-overload]
    preemptor = _preempt(admin)
    exit_at = exited.wait()
    assert victim.wait() == 75
    assert victim.signals == ["TERM"], victim.signals
    term_at = float((runtime / "victim.term").read_text())
    assert exit_at - term_at >= checkpoint_s * 0.9  # it stopped in its own time: not killed
    wait_for(lambda: admin.get(f"/v1/leases/{preemptor}").json()["state"] == "loading",
             what="the preemptor granted")  # fmt: skip
    _granted_only_after_the_victim_stopped(admin, preemptor, term_at + checkpoint_s)


def test_a_child_that_ignores_sigterm_gets_one_then_sigkill_after_the_grace(
    start_server: Callable[..., Server], tmp_path: Path, cleanup: Started
) -> None:
    runtime = tmp_path / "rt"
    server, admin, agent = _cluster(start_server, runtime, cleanup, agent_grace_s="1.5")
    victim, info = _supervised_victim(
        server, agent, admin, runtime, cleanup, "--grace-s", "1.5", ignore_term=True
    )
    exited = ExitWatch(int(info["pid"]))  # type: ignore[call-overload]
    _preempt(admin)
    exit_at = exited.wait()
    assert victim.wait() == 75
    term_at = float((runtime / "victim.term").read_text())
    assert victim.signals == ["TERM"], victim.signals
    assert exit_at - term_at >= 1.5 * 0.9  # SIGKILL only after the grace


# ---------------------------------------------------------------- a lapsed TTL under supervision


def test_a_killed_wrapper_s_lapsed_lease_keeps_its_memory_until_the_agent_saw_the_child_exit(
    start_server: Callable[..., Server], tmp_path: Path, cleanup: Started
) -> None:
    """``run`` is killed with SIGKILL; its child lives on, orphaned, and reports no GPU memory
    to the probe (so only the ledger protects it). The TTL lapses: the lease is revoked,
    not freed; the next request for that memory is granted only once the agent has
    stopped the child (one SIGTERM, ignored; SIGKILL after the grace) and seen it exit."""
    runtime = tmp_path / "rt"
    server, admin, agent = _cluster(start_server, runtime, cleanup, agent_grace_s="2")
    victim, info = _supervised_victim(
        server, agent, admin, runtime, cleanup, "--ttl", "2", ignore_term=True
    )
    lease_id = lease_of(admin, "victim")["id"]  # type: ignore[index]
    wait_for(  # the agent's heartbeat told the controller it watches the child
        lambda: admin.get(f"/v1/leases/{lease_id}").json()["supervised"], what="supervised"
    )
    exited = ExitWatch(int(info["pid"]))  # type: ignore[call-overload]
    assert victim.proc is not None
    victim.proc.kill()  # kill -9: nobody renews any more, nobody stops the child
    victim.proc.wait(timeout=30)
    waiting = admin.post(  # of the same priority: it cannot preempt
        "/v1/leases",
        json={"vram_mb": 20480, "priority": "batch", "holder": "next",
              "constraints": {"worker": "box-a"}},
    )  # fmt: skip
    assert waiting.json()["state"] == "pending", waiting.text
    next_id = waiting.json()["id"]

    lapsed = wait_for(
        lambda: (
            (lease := admin.get(f"/v1/leases/{lease_id}").json())["state"] != "active" and lease
        ),
        what="the TTL to lapse",
    )
    assert lapsed["state"] == "revoking", lapsed
    assert lapsed["revoke_reason"] == "ttl_lapsed"
    assert process_alive(int(info["pid"]))  # type: ignore[call-overload]
    assert gpu_figures(admin)["box-a:0"]["committed_mb"] == 20480  # still committed (I4)
    assert admin.get(f"/v1/leases/{next_id}").json()["state"] == "pending"

    exit_at = exited.wait()
    wait_for(
        lambda: admin.get(f"/v1/leases/{next_id}").json()["state"] == "loading",
        what="the next request granted",
    )
    term_at = float((runtime / "victim.term").read_text())
    assert exit_at - term_at >= 2 * 0.9  # SIGTERM ignored: killed after the agent's grace
    ended = _granted_only_after_the_victim_stopped(admin, next_id, term_at + 2)
    assert ended["end_reason"] == "holder_stopped"
    assert victim.signals == ["TERM"]
