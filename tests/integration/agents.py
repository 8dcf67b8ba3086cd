"""Real agent and ``gpu-arbiter run`` processes for integration tests, and the child
program they run (a stand-in for a model server: it reports GPU memory to the fake
probe, then waits for a go file)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from .conftest import SRC, ManagedProcess, wait_for

CHILD = """
import json, os, signal, sys, time
from pathlib import Path
from gpu_arbiter.agent.probes import report_usage

info_path, go_path, mb, ignore_term, code, checkpoint_s = (
    Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5]),
    float(sys.argv[6]))
terms = []
def on_term(signum, frame):
    terms.append(time.time())
    with info_path.with_suffix(".signals").open("a") as signals:  # every one it receives
        signals.write(f"TERM {terms[-1]}\\n")
    info_path.with_suffix(".term").write_text(str(terms[0]))
    if not ignore_term and not checkpoint_s:
        sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
indexes = [int(i) for i in visible.split(",") if i]
if mb and os.environ.get("GPU_ARBITER_FAKE_USAGE_DIR"):
    report_usage({i: mb // 2 for i in indexes})
    time.sleep(0.3)
    report_usage({i: mb for i in indexes})
names = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
         "ROCR_VISIBLE_DEVICES", "GPU_ARBITER_LEASE", "GPU_ARBITER_FENCING_TOKEN")
info = {"pid": os.getpid(), "pgid": os.getpgid(0), "env": {n: os.environ.get(n) for n in names}}
partial = info_path.with_suffix(".tmp")
partial.write_text(json.dumps(info))
os.replace(partial, info_path)
while not go_path.exists():
    if terms and not ignore_term and time.time() - terms[0] >= checkpoint_s:
        sys.exit(143)  # stopped after writing its checkpoint
    time.sleep(0.05)
sys.exit(code)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def token_file(path: Path, token: str) -> Path:
    """``token`` in a file of mode 0600 at ``path``, as an agent or a gateway takes it
    (``--token-file``): a secret is never written on a command line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(token + "\n")
    return path


def env_for(runtime: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "GPU_ARBITER_RUNTIME_DIR": str(runtime)}
    for name in (
        "GPU_ARBITER_URL",
        "GPU_ARBITER_TOKEN",
        "GPU_ARBITER_TOKEN_FILE",
        "GPU_ARBITER_CONFIG",
    ):
        env.pop(name, None)
    return env


class AgentProcess(ManagedProcess):
    def __init__(
        self, url: str, token: str, name: str, runtime: Path, spec: str, *extra: str
    ) -> None:
        self.name = name
        self.runtime = runtime
        self.token_file = token_file(runtime / f"agent-{name}.token", token)
        self.command = [sys.executable, "-m", "gpu_arbiter", "agent", "--controller", url]
        self.command += ["--token-file", str(self.token_file), "--name", name]
        self.command += ["--simulate", spec]
        self.command += ["--heartbeat-s", "0.5", "--grace-s", "0.5", *extra]
        self.log = runtime / f"agent-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProcess:
        self.runtime.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=log, env=env_for(self.runtime)
            )
        return self

    @property
    def attachments(self) -> dict[str, Any]:
        path = self.runtime / f"agent-{self.name}.leases.json"
        try:
            found: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return found


class RunProcess:
    """``gpu-arbiter run ... -- python child.py``; the child's info lands in ``info``."""

    def __init__(
        self,
        url: str,
        token: str,
        runtime: Path,
        holder: str,
        *options: str,
        mb: int = 1000,
        ignore_term: bool = False,
        exit_code: int = 0,
        checkpoint_s: float = 0.0,
    ) -> None:
        """``checkpoint_s``: on SIGTERM the child takes this long to stop (0: at once),
        recording every signal it receives meanwhile (see :attr:`signals`)."""
        self.holder = holder
        self.runtime = runtime
        self.info_path = runtime / f"{holder}.json"
        self.go_path = runtime / f"{holder}.go"
        child = runtime / "child.py"
        if not child.exists():
            child.write_text(CHILD)
        self.command = [sys.executable, "-m", "gpu_arbiter", "run", "--controller", url]
        self.command += ["--token", token, "--holder", holder, "--grace-s", "0.5", *options]
        self.command += ["--", sys.executable, str(child), str(self.info_path), str(self.go_path)]
        self.command += [str(mb), "1" if ignore_term else "0", str(exit_code), str(checkpoint_s)]
        self.err = runtime / f"{holder}.err"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, preexec_fn: Callable[[], object] | None = None) -> RunProcess:
        """``preexec_fn`` runs in the wrapper's process before its exec (what a launcher
        leaves behind, such as an ignored signal)."""
        self.runtime.mkdir(parents=True, exist_ok=True)
        with self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env_for(self.runtime),
                preexec_fn=preexec_fn,
            )
        return self

    @property
    def info(self) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = json.loads(self.info_path.read_text())
        except (OSError, ValueError):
            return None
        return found

    @property
    def signals(self) -> list[str]:
        """The signals the child received, in order (SIGKILL cannot be seen)."""
        try:
            lines = self.info_path.with_suffix(".signals").read_text().splitlines()
        except OSError:
            return []
        return [line.split()[0] for line in lines]

    def wait_child(self, timeout_s: float = 30.0) -> dict[str, Any]:
        found: dict[str, Any] = wait_for(lambda: self.info, timeout_s, f"{self.holder} child")
        return found

    def go(self) -> None:
        self.go_path.write_text("go")

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def kill(self) -> None:
        """Ends the wrapper and whatever is left of its child (test cleanup)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=15)
        info = self.info
        if info is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(info["pgid"], signal.SIGKILL)


class ExitWatch:
    """Records the moment a process exits (pidfd: woken by the kernel, no polling)."""

    def __init__(self, pid: int) -> None:
        self.exited_at: float | None = None
        self._fd = os.pidfd_open(pid)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        select.select([self._fd], [], [], 120)
        self.exited_at = time.time()
        os.close(self._fd)

    def wait(self, timeout_s: float = 30.0) -> float:
        self._thread.join(timeout_s)
        assert self.exited_at is not None, "the process did not exit"
        return self.exited_at


def lease_of(client: httpx.Client, holder: str) -> dict[str, Any] | None:
    found = client.get("/v1/leases", params={"holder": holder}).json()
    return found[-1] if found else None


def worker_state(client: httpx.Client, name: str) -> str | None:
    answer = client.get(f"/v1/workers/{name}")
    return str(answer.json()["state"]) if answer.status_code == 200 else None


Started = list[AgentProcess | RunProcess | httpx.Client]
"""What a test started; the ``cleanup`` fixture (conftest) ends it, last first."""
