"""The fake probe: GPUs from a spec or a file, memory following real processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_arbiter.agent.probes import (
    FAKE_USAGE_DIR_ENV,
    FakeGpu,
    FakeProbe,
    load_fake_file,
    parse_fake_spec,
    process_alive,
    report_usage,
)
from gpu_arbiter.core.errors import InvalidInput

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real child process that would live for 30 s; always reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


# --- specs and files ---------------------------------------------------------------------


def test_spec_declares_identical_gpus() -> None:
    assert parse_fake_spec("2x24G:sm_86") == (
        FakeGpu(0, 24576, "sm_86", "Simulated GPU", "nvidia"),
        FakeGpu(1, 24576, "sm_86", "Simulated GPU", "nvidia"),
    )


def test_spec_groups_models_vendors_and_capabilities() -> None:
    gpus = parse_fake_spec("1x80G:sm_90:H100 SXM, 3 x 16G:8.6 ,24576::Mystery,1x24G:gfx1100")

    assert [(g.index, g.total_mb, g.arch, g.model, g.vendor) for g in gpus] == [
        (0, 81920, "sm_90", "H100 SXM", "nvidia"),
        (1, 16384, "sm_86", "Simulated GPU", "nvidia"),
        (2, 16384, "sm_86", "Simulated GPU", "nvidia"),
        (3, 16384, "sm_86", "Simulated GPU", "nvidia"),
        (4, 24576, "", "Mystery", "nvidia"),
        (5, 24576, "gfx1100", "Simulated GPU", "amd"),
    ]
    assert len({g.uuid for g in gpus}) == 6


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ("", "simulate: empty spec"),
        ("2x", "simulate '2x': '2x' is not a size"),
        ("x24G", "simulate 'x24G': 'x24G' is not a size"),
        ("2x24Q", "simulate '2x24Q': '24Q' is not a size"),
        ("0x24G", "simulate '0x24G': declare 1 to 64 GPUs"),
        ("2x0", "simulate '2x0': a GPU needs more than 0 MiB"),
        ("2x24G:sm86", "simulate '2x24G:sm86': arch 'sm86' is not like sm_86"),
        ("65x1G", "simulate '65x1G': declare 1 to 64 GPUs"),
        ("2x24G,", "simulate '': not N x SIZE"),
        ("2 GPUs", "simulate '2 GPUs': not N x SIZE"),
    ],
)
def test_spec_errors_are_one_line_naming_the_group(spec: str, complaint: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_fake_spec(spec)
    message = str(caught.value)
    assert message.startswith(complaint), message
    assert "\n" not in message


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "gpus.toml"
    path.write_text(
        '[[gpus]]\ncount = 2\ntotal = "24G"\narch = "sm_86"\nmodel = "RTX 3090"\n\n'
        '[[gpus]]\ntotal = 65520\narch = "gfx90a"\nexternal = "1G"\n'
    )

    gpus = load_fake_file(path)

    assert [(g.index, g.total_mb, g.arch, g.model, g.vendor, g.external_mb) for g in gpus] == [
        (0, 24576, "sm_86", "RTX 3090", "nvidia", 0),
        (1, 24576, "sm_86", "RTX 3090", "nvidia", 0),
        (2, 65520, "gfx90a", "Simulated GPU", "amd", 1024),
    ]


def test_json_file(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [{"total": "80G", "vendor": "NVIDIA", "arch": "9.0"}]}))

    [gpu] = load_fake_file(path)

    assert (gpu.total_mb, gpu.arch, gpu.vendor) == (81920, "sm_90", "nvidia")


@pytest.mark.parametrize(
    ("name", "text", "complaint"),
    [
        ("a.toml", "[[gpus]]\ntotal = ", "not valid TOML"),
        ("a.json", "{", "not valid JSON"),
        ("a.json", '{"gpus": []}', "needs a non-empty list 'gpus'"),
        ("a.json", '{"gpus": [3]}', "gpus[0]: must be a table"),
        ("a.json", '{"gpus": [{"count": 1}]}', "gpus[0]: needs 'total'"),
        ("a.json", '{"gpus": [{"total": "1G", "colour": "red"}]}', "unknown key 'colour'"),
        ("a.json", '{"gpus": [{"total": "1G", "count": 0}]}', "'count' must be an integer"),
        ("a.json", '{"gpus": [{"total": "1G", "external": "2G"}]}', "external usage is larger"),
    ],
)
def test_file_errors_name_the_file_and_entry(
    tmp_path: Path, name: str, text: str, complaint: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InvalidInput, match=re.escape(complaint)) as caught:
        load_fake_file(path)
    assert str(caught.value).startswith(str(path))


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="cannot read: No such file"):
        load_fake_file(tmp_path / "nope.toml")


# --- memory ------------------------------------------------------------------------------


async def test_fresh_gpus_are_empty_and_named_by_their_spec() -> None:
    probe = FakeProbe.from_spec("2x24G:sm_86")

    snap = await probe.snapshot()

    assert probe.name == "fake:2x24G:sm_86"
    assert snap.ok
    assert [(g.index, g.total_mb, g.used_mb, g.arch) for g in snap.gpus] == [
        (0, 24576, 0, "sm_86"),
        (1, 24576, 0, "sm_86"),
    ]
    assert [g.processes for g in snap.gpus] == [{}, {}]


async def test_external_usage_counts_without_a_process() -> None:
    probe = FakeProbe.from_spec("2x24G")
    probe.set_external(1, 5000)

    snap = await probe.snapshot()

    assert [g.used_mb for g in snap.gpus] == [0, 5000]
    assert snap.gpus[1].processes == {}


async def test_memory_follows_a_real_child_process(sleeper: subprocess.Popen[bytes]) -> None:
    probe = FakeProbe.from_spec("2x24G:sm_86")
    probe.attach(sleeper.pid, 1, 4096)
    probe.set_external(1, 100)

    while_running = await probe.snapshot()
    sleeper.kill()
    sleeper.wait()
    after_exit = await probe.snapshot()

    assert while_running.gpus[1].used_mb == 4196
    assert while_running.gpus[1].processes == {sleeper.pid: 4096}
    assert after_exit.gpus[1].used_mb == 100
    assert after_exit.gpus[1].processes == {}


async def test_an_exited_unreaped_child_holds_no_memory(sleeper: subprocess.Popen[bytes]) -> None:
    probe = FakeProbe.from_spec("1x24G")
    probe.attach(sleeper.pid, 0, 2048)
    sleeper.kill()
    os.waitid(os.P_PID, sleeper.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped

    snap = await probe.snapshot()

    assert not process_alive(sleeper.pid)
    assert snap.gpus[0].used_mb == 0


async def test_attach_replaces_and_detach_is_idempotent(sleeper: subprocess.Popen[bytes]) -> None:
    probe = FakeProbe.from_spec("2x24G")
    probe.attach(sleeper.pid, 0, 1000)
    probe.attach(sleeper.pid, 0, 3000)
    probe.attach(sleeper.pid, 1, 500)

    attached = await probe.snapshot()
    probe.detach(sleeper.pid)
    probe.detach(sleeper.pid)
    detached = await probe.snapshot()

    assert [g.used_mb for g in attached.gpus] == [3000, 500]
    assert [g.used_mb for g in detached.gpus] == [0, 0]


def test_attach_checks_its_arguments() -> None:
    probe = FakeProbe.from_spec("1x24G")
    with pytest.raises(InvalidInput, match="no fake GPU 3; have"):
        probe.attach(os.getpid(), 3, 10)
    with pytest.raises(InvalidInput, match="pid must be > 0"):
        probe.attach(0, 0, 10)
    with pytest.raises(InvalidInput, match="used_mb: must be >= 0"):
        probe.set_external(0, -1)


async def test_injected_failure_marks_the_gpu_stale_until_it_recovers() -> None:
    probe = FakeProbe.from_spec("2x24G")
    probe.fail(1, "GPU is lost")

    failed = await probe.snapshot()
    probe.recover(1)
    recovered = await probe.snapshot()

    assert [g.index for g in failed.gpus] == [0]
    assert [(f.index, f.error, f.uuid) for f in failed.failures] == [
        (1, "fake: GPU is lost", "GPU-fake-0001")
    ]
    assert recovered.ok
    assert [g.index for g in recovered.gpus] == [0, 1]


async def test_a_child_reports_memory_while_it_loads_and_it_vanishes_on_exit(
    tmp_path: Path,
) -> None:
    """The child writes its own usage to the usage dir: 1 GiB, then 3 GiB, then exits."""
    child = """
import sys
from gpu_arbiter.agent.probes import report_usage
for mb in (1024, 3072):
    report_usage({0: mb})
    print("reported", mb, flush=True)
    sys.stdin.readline()
"""
    probe = FakeProbe.from_spec("1x24G", usage_dir=tmp_path)
    env = {**os.environ, **probe.child_env(), "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(
        [sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    used = []
    try:
        for _ in range(2):
            assert proc.stdout.readline().startswith(b"reported")
            used.append((await probe.snapshot()).gpus[0].processes)
            proc.stdin.write(b"next\n")
            proc.stdin.flush()
        proc.wait()
        used.append((await probe.snapshot()).gpus[0].processes)
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()

    assert used == [{proc.pid: 1024}, {proc.pid: 3072}, {}]
    assert list(tmp_path.iterdir()) == []  # the dead process's report is cleaned up


async def test_usage_reports_add_up_with_attached_memory(tmp_path: Path) -> None:
    probe = FakeProbe.from_spec("2x24G", usage_dir=tmp_path)
    report_usage({0: 100, 1: 200}, usage_dir=tmp_path)
    probe.attach(os.getpid(), 0, 50)

    snap = await probe.snapshot()
    report_usage({}, usage_dir=tmp_path)
    withdrawn = await probe.snapshot()

    assert [(g.used_mb, dict(g.processes or {})) for g in snap.gpus] == [
        (150, {os.getpid(): 150}),
        (200, {os.getpid(): 200}),
    ]
    assert [g.used_mb for g in withdrawn.gpus] == [50, 0]


async def test_an_unreadable_usage_report_is_an_error(tmp_path: Path) -> None:
    (tmp_path / f"{os.getpid()}.json").write_text("[1, 2")
    (tmp_path / "notes.json").write_text("ignored: not a pid")

    snap = await FakeProbe.from_spec("1x24G", usage_dir=tmp_path).snapshot()

    assert snap.gpus[0].used_mb == 0
    [error] = snap.errors
    assert error.startswith(f"fake: cannot read usage report {os.getpid()}.json")


async def test_process_liveness_is_injectable() -> None:
    alive = {7: True}
    probe = FakeProbe.from_spec("1x24G", pid_alive=lambda pid: alive.get(pid, False))
    probe.attach(7, 0, 640)

    before = await probe.snapshot()
    alive[7] = False
    after = await probe.snapshot()

    assert (before.gpus[0].used_mb, after.gpus[0].used_mb) == (640, 0)


def test_a_probe_needs_a_gpu() -> None:
    with pytest.raises(InvalidInput, match="at least one GPU"):
        FakeProbe([])


async def test_snapshot_does_not_block_the_event_loop() -> None:
    """Reading process state waits for another coroutine, which attaches a process
    meanwhile: done on the loop's thread (or holding the state lock while it checks), the
    read would stall that coroutine and time out."""
    other_ran = threading.Event()

    def alive_once_other_ran(pid: int) -> bool:
        if not other_ran.wait(timeout=20):
            raise AssertionError("the other coroutine never ran during the snapshot")
        return True

    probe = FakeProbe.from_spec("1x24G", pid_alive=alive_once_other_ran)
    probe.attach(12345, 0, 1)
    events: list[str] = []

    async def other() -> None:
        probe.attach(os.getpid(), 0, 5)
        events.append("other coroutine ran")
        other_ran.set()

    async def read() -> None:
        snap = await probe.snapshot()
        events.append(f"snapshot used {snap.gpus[0].used_mb}")

    await asyncio.gather(read(), other())

    assert events == ["other coroutine ran", "snapshot used 1"]


def test_report_usage_needs_a_usage_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAKE_USAGE_DIR_ENV, raising=False)
    with pytest.raises(InvalidInput, match=f"{FAKE_USAGE_DIR_ENV}: is not set"):
        report_usage({0: 1})
    assert FakeProbe.from_spec("1x1G").child_env() == {}
