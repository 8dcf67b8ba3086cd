"""What a newcomer meets first: the command's version and help, a controller on this
machine found with its token, refusals that say why and exit with the documented code."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from .agents import AgentProcess, RunProcess, lease_of, worker_state
from .conftest import SRC, Server, events, wait_for

COMMANDS = [
    "demo", "simulate", "serve", "agent", "run", "status", "queue", "leases", "events",
    "drain", "cancel-drain", "update", "operation", "remove", "pause", "resume", "release",
    "top", "token create",
]  # fmt: skip


def gpu_arbiter(
    *args: str, url: str = "http://127.0.0.1:1", **env: str
) -> subprocess.CompletedProcess[str]:
    """The command as a user types it: no token unless one is given in ``env``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_ARBITER_")}
    full.update({"PYTHONPATH": str(SRC), "COLUMNS": "200", "GPU_ARBITER_URL": url, **env})
    command = [sys.executable, "-m", "gpu_arbiter", *args]
    return subprocess.run(command, capture_output=True, text=True, env=full, timeout=60)


def test_version() -> None:
    from gpu_arbiter import __version__

    done = gpu_arbiter("--version")
    assert done.returncode == 0 and done.stdout == f"gpu-arbiter {__version__}\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_values_and_shows_no_type_placeholders(command: str) -> None:
    done = gpu_arbiter(*command.split(), "--help")
    assert done.returncode == 0, done.stderr
    options = done.stdout.split("Options:")[1]
    assert not re.search(r"<[a-z]", options), options  # no <bool>, <str>, <float range>
    assert "  --help  " in options or "  --help\n" in options


def test_the_cli_finds_the_admin_token_of_a_controller_on_this_machine(
    start_server: object, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    state = home / ".local" / "state" / "gpu-arbiter"  # serve's default state directory
    server = start_server("--simulate", "1x24G", state_dir=state)  # type: ignore[operator]
    assert isinstance(server, Server)
    done = gpu_arbiter("status", url=server.url, HOME=str(home))
    assert done.returncode == 0, done.stderr
    assert "local:0" in done.stdout
    elsewhere = gpu_arbiter("status", url=server.url, GPU_ARBITER_STATE_DIR=str(state))
    assert elsewhere.returncode == 0, elsewhere.stderr


def test_a_401_says_where_tokens_come_from(server: Server, tmp_path: Path) -> None:
    nobody = gpu_arbiter("queue", url=server.url, HOME=str(tmp_path))
    assert nobody.returncode == 1
    assert nobody.stderr.startswith("error: 401 unauthorized: missing bearer token")
    assert "--token or GPU_ARBITER_TOKEN" in nobody.stderr
    assert "admin.token" in nobody.stderr and "token create --role client" in nobody.stderr
    assert len(nobody.stderr.splitlines()) == 1
    other = tmp_path / "other-state"
    other.mkdir()
    (other / "admin.token").write_text("gat_of_another_controller")
    wrong = gpu_arbiter("queue", url=server.url, GPU_ARBITER_STATE_DIR=str(other))
    assert wrong.returncode == 1 and "401 unauthorized: unknown token" in wrong.stderr
    assert f"the admin token of {other / 'admin.token'} was sent" in wrong.stderr


def test_run_exits_65_when_refused_and_says_why_once(server: Server, tmp_path: Path) -> None:
    bad = gpu_arbiter("run", "--token", "gat_bad", "--", "true", url=server.url)
    assert bad.returncode == 65, bad.stderr
    assert "refused: 401 unauthorized: unknown token" in bad.stderr
    token = {"GPU_ARBITER_TOKEN": server.admin_token, "GPU_ARBITER_RUNTIME_DIR": str(tmp_path)}
    big = gpu_arbiter("run", "--vram", "100G", "--", "true", url=server.url, **token)
    assert big.returncode == 65, big.stderr
    assert "refused: 422 unschedulable: 100.0 GiB per GPU is more than" in big.stderr
    assert "unschedulable: unschedulable" not in big.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--priority", "urgent"], "--priority: 'urgent' is not an integer 0..1000 nor one of"),
        (["--vram", "lots"], "--vram: 'lots' is not a size"),
        (["--vram", "30"], "--vram: 30 has no unit: did you mean 30G? (write 30M for MiB)"),
    ],
)
def test_run_refuses_bad_arguments_before_asking_anyone(args: list[str], says: str) -> None:
    done = gpu_arbiter("run", *args, "--", "true")  # no controller listens on port 1
    assert done.returncode == 2
    assert says in done.stderr
    assert "no controller answered" not in done.stderr


def test_run_takes_bare_mib_from_1024_up() -> None:
    from gpu_arbiter.cli.run import parse_vram

    assert parse_vram("24000") == 24000
    assert parse_vram("30M") == 30
    assert parse_vram("30G") == 30 * 1024


# ---------------------------------------------------------------- reading the state


def _ask(client: httpx.Client, vram: str, holder: str, **more: Any) -> dict[str, Any]:
    answer = client.post("/v1/leases", json={"vram_mb": vram, "holder": holder, **more})
    assert answer.status_code in (201, 202), answer.text
    lease: dict[str, Any] = answer.json()
    return lease


def test_causes_come_before_the_grants_they_make_room_for(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--simulate", "1x24G")
    with server.client() as admin:
        first = _ask(admin, "24G", "first", ttl_s=0.5)  # never renewed: it lapses
        second = _ask(admin, "24G", "second", ttl_s=60)
        assert second["state"] == "pending"
        wait_for(lambda: admin.get(f"/v1/leases/{second['id']}").json()["state"] != "pending")
        seqs = {(e["kind"], e["lease_id"]): e["seq"] for e in events(admin)}
    assert seqs[("lease.expired", first["id"])] < seqs[("lease.granted", second["id"])]


def test_events_shows_the_latest_history_then_follows(server: Server, tmp_path: Path) -> None:
    with server.client() as admin:
        leases = [_ask(admin, "1G", f"h{i}", ttl_s=300) for i in range(4)]
        last = admin.get("/v1/status").json()["last_event"]
    env = {"GPU_ARBITER_TOKEN": server.admin_token}
    done = gpu_arbiter("events", "-n", "3", "--count", "3", url=server.url, **env)
    assert done.returncode == 0, done.stderr
    seqs = [int(line.split("#")[1].split()[0]) for line in done.stdout.splitlines()]
    assert seqs == [last - 2, last - 1, last]  # the latest three, in order, then it stopped
    one = leases[1]["id"]
    done = gpu_arbiter("events", "--lease", one, "-n", "1", "--count", "1", url=server.url, **env)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert f"lease.granted lease={one}" in done.stdout
    assert "vram_mb=1.0GiB" in done.stdout and "waited_s=" in done.stdout
    assert re.search(r"waited_s=\d+\.\ds\b", done.stdout), done.stdout  # not 0.000123

    with subprocess.Popen(
        [sys.executable, "-m", "gpu_arbiter", "events", "-n", "1", "--count", "2"],
        env={**os.environ, "PYTHONPATH": str(SRC), "GPU_ARBITER_URL": server.url, **env},
        stdout=subprocess.PIPE,
        text=True,
    ) as follower:
        try:
            assert follower.stdout is not None
            assert f"#{last} " in follower.stdout.readline()  # the history first...
            with server.client() as admin:
                new = _ask(admin, "1G", "later", ttl_s=300)
            assert f"lease={new['id']}" in follower.stdout.readline()  # ...then what happens
            assert follower.wait(timeout=20) == 0
        finally:
            follower.kill()


def test_the_serve_log_says_who_was_granted_revoked_and_stopped(server: Server) -> None:
    with server.client() as admin:
        low = _ask(admin, "20G", "batch-job", ttl_s=300, priority="batch")
        admin.post(f"/v1/leases/{low['id']}/revoke").raise_for_status()
        admin.delete(f"/v1/leases/{low['id']}").raise_for_status()
    gpu = low["gpus"][0]

    def lines() -> list[str]:
        return server.log.read_text().splitlines()

    def logged(start: str) -> str:
        found = [line for line in lines() if start in line]
        return found[-1] if found else ""

    who = f"lease {low['id']} (holder 'batch-job') on {gpu}"
    granted = wait_for(lambda: logged(f"granted {who}"), what="the grant logged")
    assert granted.startswith("INFO gpu_arbiter.controller ")
    assert "20.0 GiB, priority 100" in granted
    assert "revoked_by_admin" in wait_for(lambda: logged(f"revoked {who}"), what="revocation")
    assert wait_for(lambda: logged(f"ended {who}"), what="the end logged").endswith(": released")


def test_demo_piped_keeps_each_sentence_on_one_line() -> None:
    done = gpu_arbiter("demo", "--speed", "0.02", COLUMNS="")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert (
        "2. Preemption: a batch fine-tune fills the GPU; an interactive request takes its place"
        in lines
    )
    assert lines[-1].startswith("done: ") and lines[-1].endswith("never two loads at once.")
    assert not any(line.startswith(("place", "take the", "loads at", "until it")) for line in lines)


def test_a_report_piped_into_head_ends_quietly() -> None:
    """``gpu-arbiter demo | head -3``: the reader stops; the demo ends with no traceback."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_ARBITER_")}
    full["PYTHONPATH"] = str(SRC)
    with subprocess.Popen(
        [sys.executable, "-m", "gpu_arbiter", "demo", "--speed", "0.02"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=full,
    ) as demo:
        assert demo.stdout is not None and demo.stderr is not None
        demo.stdout.readline()
        demo.stdout.close()  # as `head -1` does once it has its line
        demo.wait(timeout=60)
        assert demo.stderr.read() == b""
    assert demo.returncode == -signal.SIGPIPE


# ---------------------------------------------------------------- a simulated GPU


def test_on_a_simulated_gpu_a_command_that_reports_no_memory_is_ready_in_seconds(
    start_server: Callable[..., Server], tmp_path: Path
) -> None:
    server = start_server()
    runtime = tmp_path / "rt"
    agent = AgentProcess(server.url, server.admin_token, "box-a", runtime, "1x24G").start()
    runs: list[RunProcess] = []
    try:
        with server.client() as admin:
            wait_for(lambda: worker_state(admin, "box-a") == "online", what="box-a online")
            assert admin.get("/v1/workers/box-a").json()["simulated"] is True
            for holder in ("first", "second"):  # the second waits for the first's load gate
                runs.append(RunProcess(server.url, server.admin_token, runtime, holder, mb=0))
                runs[-1].start().wait_child()
                wait_for(
                    lambda h=holder: (lease_of(admin, h) or {}).get("state") == "active",  # type: ignore[misc]
                    timeout_s=15,
                    what=f"{holder} ready",  # not after 120 s
                )
    finally:
        for run in runs:
            run.kill()
        agent.stop()


# ---------------------------------------------------------------- reasons name the blocker


def _reason(client: httpx.Client, lease_id: str) -> dict[str, Any]:
    lease = client.get(f"/v1/leases/{lease_id}").json()
    assert lease["state"] == "pending", lease
    reason: dict[str, Any] = lease["reason"]
    return reason


def test_a_load_in_progress_names_whose_load_and_when_the_gate_opens(
    start_server: Callable[..., Server], tmp_path: Path
) -> None:
    server = start_server("--simulate", "1x24G")
    with server.client() as admin:
        chat = _ask(admin, "8G", "chat", ttl_s=300)  # loading until it says it is ready
        second = _ask(admin, "8G", "second", ttl_s=300)
        reason = _reason(admin, second["id"])
    assert reason["code"] == "load_in_progress" and reason["blocked_by"] == chat["id"]
    blocker = reason["blocker"]
    assert blocker["kind"] == "loading" and blocker["id"] == chat["id"]
    assert blocker["holder"] == "chat" and blocker["gpus"] == ["local:0"]
    assert blocker["since"] == chat["granted_at"] and blocker["until"] > blocker["since"]
    sentence = f"lease {chat['id']} (holder 'chat') has been loading on local:0 for "
    assert sentence in reason["message"]
    assert "the gate opens when it is ready, at the latest in " in reason["message"]

    env = {"GPU_ARBITER_TOKEN": server.admin_token, "GPU_ARBITER_RUNTIME_DIR": str(tmp_path)}
    queue = gpu_arbiter("queue", url=server.url, **env)
    assert queue.returncode == 0 and sentence in " ".join(queue.stdout.split()), queue.stdout
    run = gpu_arbiter("run", "--vram", "8G", "--max-wait", "1", "--", "true", url=server.url, **env)
    assert run.returncode == 124
    assert "waiting for lease " in run.stderr and sentence in run.stderr, run.stderr


def test_memory_held_for_a_request_ahead_names_that_request(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--simulate", "1x24G")
    with server.client() as admin:
        held = _ask(admin, "20G", "resident", ttl_s=300)
        admin.post(f"/v1/leases/{held['id']}/ready").raise_for_status()
        big = _ask(admin, "20G", "big-train", ttl_s=300)
        small = _ask(admin, "2G", "small", ttl_s=300)
        reason = _reason(admin, small["id"])
    assert reason["code"] == "nominated_for" and reason["blocked_by"] == big["id"]
    assert reason["blocker"]["kind"] == "request" and reason["blocker"]["holder"] == "big-train"
    assert (
        f"up to 20.0 GiB of local:0 is held for request {big['id']} (holder 'big-train'), "
        "ahead in the queue" in reason["message"]
    )


def test_waiting_for_a_preempted_lease_names_it_with_its_grace(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--simulate", "1x24G")
    with server.client() as admin:
        victim = _ask(admin, "20G", "fine-tune", ttl_s=300, priority="batch")
        admin.post(f"/v1/leases/{victim['id']}/ready").raise_for_status()
        urgent = _ask(admin, "20G", "chat", ttl_s=300, priority="interactive")
        reason = _reason(admin, urgent["id"])
        revoked_at = admin.get(f"/v1/leases/{victim['id']}").json()["revoked_at"]
    assert reason["code"] == "preempting" and reason["blocked_by"] is None  # within its grace
    blocker = reason["blocker"]
    assert (blocker["kind"], blocker["id"], blocker["holder"]) == (
        "revoking",
        victim["id"],
        "fine-tune",
    )
    assert blocker["since"] == revoked_at and blocker["until"] == revoked_at + 10
    assert f"lease {victim['id']} (holder 'fine-tune') was preempted " in reason["message"]
    assert " of its 10s grace left to stop" in reason["message"]


# ---------------------------------------------------------------- on PATH, as printed

REPO = SRC.parent
VENV = Path(sys.executable).parent.parent  # the environment running these tests


def test_link_puts_the_command_on_path_in_a_new_shell(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "GPU_ARBITER_VENV": str(VENV)}
    done = subprocess.run(
        [str(REPO / "scripts" / "link")], capture_output=True, text=True, env=env, timeout=30
    )
    assert done.returncode == 0, done.stderr
    bin_dir = home / ".local" / "bin"
    assert (bin_dir / "gpu-arbiter").resolve() == (VENV / "bin" / "gpu-arbiter").resolve()
    advice = f'  export PATH="{bin_dir}:$PATH"'
    assert advice in done.stdout.splitlines(), done.stdout  # not on PATH yet: how to put it
    shell = subprocess.run(
        ["bash", "-c", f"{advice.strip()}\ngpu-arbiter --version"],
        capture_output=True,
        text=True,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(SRC)},
        timeout=60,
    )
    assert shell.returncode == 0 and shell.stdout.startswith("gpu-arbiter "), shell.stderr
    again = subprocess.run(
        [str(REPO / "scripts" / "link")],
        capture_output=True,
        text=True,
        env={**env, "PATH": f"{bin_dir}:/usr/bin:/bin"},
        timeout=30,
    )
    assert again.returncode == 0 and "not on your PATH" not in again.stdout


def test_every_command_the_local_banner_prints_works_as_printed_in_a_new_shell(
    tmp_path: Path,
) -> None:
    """``serve --local`` started by its script with gpu-arbiter not on PATH prints the
    script's full path; a new shell runs the printed lines as they are."""
    home, runtime = tmp_path / "home", tmp_path / "rt"
    home.mkdir()
    script = VENV / "bin" / "gpu-arbiter"
    assert script.is_file(), f"{script} is missing: ./scripts/install makes it"
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    env["GPU_ARBITER_RUNTIME_DIR"] = str(runtime)
    for name in ("GPU_ARBITER_URL", "GPU_ARBITER_TOKEN", "GPU_ARBITER_STATE_DIR"):
        env.pop(name, None)
    log = tmp_path / "serve.log"
    state = tmp_path / "state"
    command = [str(script), "serve", "--local", "--port", "0", "--state-dir", str(state)]
    with log.open("wb") as out, subprocess.Popen(command, stdout=out, stderr=out, env=env) as serve:
        try:
            run_line = re.compile(rf"\n  {re.escape(str(script))} run --vram 8G -- [^\n]*\n")

            def whole_banner() -> str | None:  # down to the end of its last line
                text = log.read_text()
                return text if run_line.search(text) else None

            text = wait_for(whole_banner, timeout_s=30, what="the banner, down to its run line")
            banner = text.split("try it from another shell:\n")[1].splitlines()
            printed = [line.split("  ", 1)[1] for line in banner if line.startswith("  ")][:4]
            assert printed[-1].startswith(f"{script} run --vram 8G -- python3 -c "), printed
            assert any(line.startswith("export GPU_ARBITER_TOKEN=") for line in printed)
            shell = subprocess.run(
                ["bash", "-c", "set -e\n" + "\n".join(printed)],
                capture_output=True,
                text=True,
                env={
                    "HOME": str(home),
                    "PATH": "/usr/bin:/bin",
                    "PYTHONPATH": str(SRC),
                    "GPU_ARBITER_RUNTIME_DIR": str(runtime),
                },
                timeout=60,
            )
            assert shell.returncode == 0, shell.stderr
            assert "granted GPU 0" in shell.stdout and "total: 1 workers" in shell.stdout
        finally:
            serve.terminate()
            serve.wait(timeout=30)
