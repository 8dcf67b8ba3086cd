"""The controller without HTTP: a fake clock, a memory store, restarts on the same store."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpu_arbiter.controller import Controller, GpuProbeReport, ServiceUnavailable
from gpu_arbiter.core import Conflict, Gpu, LeaseState, WorkerStatus
from gpu_arbiter.store import MemoryStore

from .support import Clock, FailingStore, request


def gpus(name: str, count: int = 2, total_mb: int = 24576) -> list[Gpu]:
    return [Gpu(index=i, total_mb=total_mb, worker=name, arch="sm_86") for i in range(count)]


def start(store: MemoryStore, clock: Clock, **kwargs: Any) -> Controller:
    controller = Controller(store, clock=clock, heartbeat_timeout_s=15.0, **kwargs)
    controller.start()
    return controller


def ask(controller: Controller, vram_mb: int, **fields: Any) -> str:
    return controller.leases.submit("client-1", request(vram_mb, **fields)).record.id


async def test_a_restart_keeps_leases_and_tokens_and_waits_for_the_worker() -> None:
    store, clock = MemoryStore(), Clock()
    first = start(store, clock)
    first.workers.register("box-1", gpus("box-1"))
    held = first.leases.get(ask(first, 20_000, ttl_s=300))
    assert held.state is LeaseState.LOADING
    first.close()

    clock.now += 5
    second = start(store, clock)
    again = second.leases.get(held.id)
    assert again.state is LeaseState.LOADING
    assert again.token == held.token
    assert [f.committed_mb for f in second.workers.gpu_figures("box-1")] in (
        [20_000, 0],
        [0, 20_000],
    )
    waiting = ask(second, 1_000)  # memory of a worker not yet heard from is unknown
    view = second.leases.pending_view(waiting)
    assert view is not None
    assert view.reason.code == "workers_draining"
    second.workers.heartbeat("box-1", [GpuProbeReport(0, 0), GpuProbeReport(1, 0)])
    granted = second.leases.get(waiting)
    assert granted.state is LeaseState.LOADING
    assert granted.token is not None
    assert held.token is not None
    assert granted.token > held.token


async def test_a_worker_silent_after_a_restart_goes_offline_once() -> None:
    store, clock = MemoryStore(), Clock()
    first = start(store, clock)
    first.workers.register("box-1", gpus("box-1"))
    first.close()
    second = start(store, clock)
    clock.now += 16
    second.pause()  # any change runs the overdue timers
    second.resume()
    assert second.workers.get("box-1").status is WorkerStatus.OFFLINE
    kinds = [e.kind for e in second.events.after(0, 1000)]
    assert kinds.count("worker.offline") == 1


async def test_heartbeat_without_news_writes_nothing() -> None:
    store, clock = MemoryStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1"))
    before = controller.events.last_seq
    for _ in range(3):
        clock.now += 1
        controller.workers.heartbeat("box-1", [GpuProbeReport(0, 500)])
    assert controller.events.last_seq == before


async def test_a_change_the_store_refuses_is_undone_and_the_controller_serves_on() -> None:
    store, clock = FailingStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1"))
    seq = controller.events.last_seq
    store.fail = True
    with pytest.raises(ServiceUnavailable):
        ask(controller, 1_000)
    assert controller.gate.broken is None  # reloaded: memory is what the store holds
    assert controller.leases.all() == []
    assert controller.events.last_seq == seq == store.load().last_event_seq
    store.fail = False
    controller.workers.heartbeat(
        "box-1", [GpuProbeReport(0, 0), GpuProbeReport(1, 0)]
    )  # known again
    granted = ask(controller, 1_000)
    assert controller.leases.get(granted).state is LeaseState.LOADING
    restarted = start(store, clock)
    assert [r.id for r in restarted.leases.all()] == [granted]  # only what was acknowledged


async def test_a_store_that_cannot_be_read_refuses_changes_until_a_reload_succeeds() -> None:
    store, clock = FailingStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1"))
    store.fail = store.fail_loads = True
    with pytest.raises(ServiceUnavailable):
        ask(controller, 1_000)
    assert controller.gate.broken is not None
    store.fail = False
    with pytest.raises(ServiceUnavailable, match="cannot be read"):
        ask(controller, 1_000)
    store.fail_loads = False
    for _ in range(100):  # the controller tries again by itself, backing off
        if controller.gate.broken is None:
            break
        await asyncio.sleep(0.05)
    assert controller.gate.broken is None
    assert controller.leases.all() == []
    controller.workers.heartbeat("box-1", [GpuProbeReport(0, 0), GpuProbeReport(1, 0)])
    assert controller.leases.get(ask(controller, 1_000)).state is LeaseState.LOADING


async def test_drain_counts_leases_that_ended_on_their_own() -> None:
    store, clock = MemoryStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1"))
    short = ask(controller, 1_000, ttl_s=1)
    controller.leases.ready(short)
    long = ask(controller, 1_000, ttl_s=300)
    clock.now += 2
    outcome = controller.workers.drain("box-1", force=True)
    assert outcome.already_finished == 1
    assert outcome.revoked == 1
    assert controller.leases.get(short).state is LeaseState.EXPIRED
    assert controller.leases.get(long).state is LeaseState.REVOKING
    again = controller.workers.drain("box-1", force=True)
    assert again.revoked == 0
    assert again.already_revoking == 1


async def test_simulated_worker_takes_no_heartbeats_and_no_registration() -> None:
    controller = start(MemoryStore(), Clock(), simulated=gpus("local", 1))
    with pytest.raises(Conflict):
        controller.workers.heartbeat("local", [])
    with pytest.raises(Conflict):
        controller.workers.register("local", gpus("local", 1))
    clock_far = controller.workers.get("local")
    assert clock_far.status is WorkerStatus.ONLINE


async def test_total_pending_limit_answers_too_many() -> None:
    from gpu_arbiter.controller import Limits, TooManyRequests

    controller = start(MemoryStore(), Clock(), limits=Limits(max_pending=2))
    controller.workers.register("box-1", gpus("box-1", 1, 1000))
    ask(controller, 1000)
    ask(controller, 1000)
    ask(controller, 1000, holder="other")
    with pytest.raises(TooManyRequests, match="already pending"):
        ask(controller, 1000, holder="third")


async def test_long_poll_on_an_ended_lease_answers_at_once() -> None:
    controller = start(MemoryStore(), Clock())
    controller.workers.register("box-1", gpus("box-1"))
    lease_id = ask(controller, 1000)
    controller.leases.release(lease_id)
    record = await controller.events.wait_lease(lease_id, LeaseState.RELEASED, 30)
    assert record.state is LeaseState.RELEASED


async def test_idempotency_key_finds_an_ended_lease_in_the_store() -> None:
    store, clock = MemoryStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1"))
    first = controller.leases.submit("c", request(1000, idempotency_key="k"))
    assert first.new
    controller.leases.release(first.record.id)
    again = controller.leases.submit("c", request(1000, idempotency_key="k"))
    assert not again.new
    assert again.record.id == first.record.id
    assert again.record.state is LeaseState.RELEASED
    other = controller.leases.submit("d", request(1000, idempotency_key="k"))
    assert other.new
    assert other.record.id != first.record.id


async def test_a_submit_answers_with_the_place_and_reason_its_change_found() -> None:
    """The answer to a submit is made in its change: a request left pending carries its
    position and reason (what a later read finds at the same moment), a granted one none,
    a replay the earlier request as it is now."""
    store, clock = MemoryStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1", count=1))
    granted = controller.leases.submit("c", request(20_000, idempotency_key="a"))
    assert granted.record.state is LeaseState.LOADING and granted.pending is None
    waiting = controller.leases.submit("c", request(20_000, idempotency_key="b"))
    assert waiting.record.state is LeaseState.PENDING
    assert waiting.pending is not None
    assert waiting.pending == controller.leases.pending_view(waiting.record.id)
    assert (waiting.pending.position, waiting.pending.reason.code) == (1, "insufficient_vram")
    replay = controller.leases.submit("c", request(20_000, idempotency_key="b"))
    assert not replay.new and replay.record.id == waiting.record.id
    assert replay.pending == waiting.pending


async def test_a_live_lease_is_read_listed_and_stored_as_the_core_holds_it() -> None:
    """A live lease exists once, in the core: after every verb, the record read, the one
    listed and the one stored carry the core's own lease (its state, expiry, size, idle
    flag), with the owner that asked; an ended one keeps the core's last word on it."""
    store, clock = MemoryStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1", count=1))
    lease_id = ask(controller, 20_000, ttl_s=60)
    waiting = ask(controller, 20_000)
    core = controller.changes.scheduler
    verbs = [
        lambda: controller.leases.ready(lease_id),
        lambda: controller.leases.renew(lease_id, ttl_s=120),
        lambda: controller.leases.set_idle(lease_id, True),
        lambda: controller.leases.shrink(lease_id, 10_000),
        lambda: controller.leases.set_idle(lease_id, False),
    ]
    for verb in verbs:
        clock.now += 1
        answered = verb()
        held = core.leases[lease_id]
        listed = controller.leases.all(state=held.state)
        assert [r.id for r in listed] == [lease_id]
        for record in (answered, controller.leases.get(lease_id), *listed, store.lease(lease_id)):
            assert record is not None
            assert (record.id, record.lease, record.state) == (lease_id, held, held.state)
            assert (record.request, record.owner) == (held.request, "client-1")
    (pending,) = [r for r, _ in controller.leases.queue()]
    assert (pending.id, pending.owner, pending.request) == (
        waiting,
        "client-1",
        core.queue.get(waiting),
    )
    last = core.leases[lease_id]
    released = controller.leases.release(lease_id)
    assert released.state is LeaseState.RELEASED and released.end_reason == "released"
    assert released.lease is not None and released.lease.expires_at == last.expires_at
    assert store.lease(lease_id) == released
    assert controller.leases.get(waiting).state is LeaseState.LOADING  # granted its room


async def test_renewing_a_lapsed_lease_conflicts_even_before_its_timer_ran() -> None:
    clock = Clock()
    controller = start(MemoryStore(), clock)
    controller.workers.register("box-1", gpus("box-1"))
    lease_id = ask(controller, 1000, ttl_s=5)
    clock.now += 6  # no timer has run: the fake clock moved, the loop did not
    with pytest.raises(Conflict, match="expired"):
        controller.leases.renew(lease_id)
    assert controller.leases.get(lease_id).state is LeaseState.EXPIRED


async def test_an_update_is_recorded_step_by_step_and_survives_a_restart() -> None:
    store, clock = MemoryStore(), Clock()
    first = start(store, clock)
    first.workers.register("box-1", gpus("box-1"), agent_version="1.0")
    held = ask(first, 1_000, ttl_s=300)
    operation = first.updates.start("box-1")
    assert first.workers.get("box-1").status is WorkerStatus.DRAINING
    assert first.updates.for_agent("box-1") == {"operation": operation.id, "run": False}
    with pytest.raises(Conflict):
        first.updates.start("box-1")  # one update at a time
    clock.now += 1
    first.leases.release(held)
    assert first.updates.for_agent("box-1") == {"operation": operation.id, "run": True}
    first.updates.report(operation.id, "update_command", "started", "running")
    assert first.updates.for_agent("box-1") == {"operation": operation.id, "run": False}
    first.close()

    second = start(store, clock)  # the operation is in the store
    clock.now += 1
    second.updates.report(operation.id, "update_command", "ok", "")
    second.workers.register("box-1", gpus("box-1"), agent_version="2.0")
    done = second.updates.get(operation.id)
    assert done.state == "succeeded"
    assert (done.from_version, done.to_version) == ("1.0", "2.0")
    assert [(s.name, s.outcome) for s in done.steps] == [
        ("drain", "started"),
        ("drain", "ok"),
        ("update_command", "started"),
        ("update_command", "ok"),
        ("restart", "started"),
        ("restart", "ok"),
        ("cancel_drain", "ok"),
    ]
    assert second.workers.get("box-1").status is WorkerStatus.ONLINE
    assert second.updates.for_agent("box-1") is None


async def test_a_failed_update_leaves_the_worker_drained() -> None:
    store, clock = MemoryStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1"), agent_version="1.0")
    operation = controller.updates.start("box-1")
    assert controller.workers.get("box-1").status is WorkerStatus.DRAINED  # nothing to wait for
    failed = controller.updates.report(operation.id, "update_command", "failed", "exit 2")
    assert (failed.state, failed.reason) == ("failed", "update_command failed: exit 2")
    controller.workers.register("box-1", gpus("box-1"), agent_version="1.0")  # a plain reconnect
    assert controller.workers.get("box-1").status is WorkerStatus.DRAINED
    with pytest.raises(Conflict):
        controller.updates.report(operation.id, "update_command", "ok", "")
    assert store.operation(operation.id) == controller.updates.get(operation.id)


def _steps(controller: Controller, operation_id: str) -> list[tuple[str, str]]:
    return [(s.name, s.outcome) for s in controller.updates.get(operation_id).steps]


@pytest.mark.parametrize(
    ("reached", "reason"),
    [
        ("nothing", "drain failed: the worker was not drained within 10 s"),
        ("drained", "update_command failed: the update command was not run to its end within 10 s"),
        ("started", "update_command failed: the update command was not run to its end within 10 s"),
        ("restarting", "restart failed: the agent did not register again within 10 s"),
    ],
)
async def test_an_update_not_done_in_time_fails_at_the_step_it_waited_on(
    reached: str, reason: str
) -> None:
    store, clock = MemoryStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1"), agent_version="1.0")
    held = ask(controller, 1_000, ttl_s=300)
    operation = controller.updates.start("box-1", timeout_s=10)
    assert operation.deadline == clock.now + 10
    if reached != "nothing":
        controller.leases.release(held)
        assert controller.updates.for_agent("box-1") == {"operation": operation.id, "run": True}
    if reached in ("started", "restarting"):
        controller.updates.report(operation.id, "update_command", "started", "running")
    if reached == "restarting":
        controller.updates.report(operation.id, "update_command", "ok", "")
    clock.now += 9
    controller.pause()  # a change before the deadline leaves it running
    assert controller.updates.get(operation.id).running
    clock.now += 1
    controller.resume()  # any change runs what is due (the timer does it when idle)
    failed = controller.updates.get(operation.id)
    assert (failed.state, failed.reason) == ("failed", reason)
    assert failed.steps[-1].outcome == "failed"
    assert store.operation(operation.id) == failed
    status = controller.workers.get("box-1").status
    assert status is (WorkerStatus.DRAINING if reached == "nothing" else WorkerStatus.DRAINED)
    assert controller.updates.for_agent("box-1") is None  # the agent is told nothing more
    with pytest.raises(Conflict, match="is failed"):
        controller.updates.report(operation.id, "update_command", "ok", "")
    assert [e.kind for e in controller.events.after(0, 1000)].count("operation.failed") == 1
    controller.updates.start("box-1")  # another may be started


async def test_an_update_past_its_deadline_at_a_restart_fails_at_once() -> None:
    store, clock = MemoryStore(), Clock()
    first = start(store, clock)
    first.workers.register("box-1", gpus("box-1"))
    operation = first.updates.start("box-1", timeout_s=30)
    first.close()
    clock.now += 31
    second = start(store, clock)
    assert second.updates.get(operation.id).state == "failed"


async def test_an_update_with_a_drain_deadline_revokes_what_is_left() -> None:
    store, clock = MemoryStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1"))
    held = ask(controller, 1_000, ttl_s=300)
    operation = controller.updates.start("box-1", drain_deadline_s=10)
    assert "deadline 10 s" in operation.steps[0].detail
    clock.now += 10
    controller.pause()
    revoked = controller.leases.get(held).lease
    assert revoked is not None
    assert (revoked.state, revoked.revoke_reason) == (LeaseState.REVOKING, "drain_deadline")


async def test_cancel_drain_ends_an_update_that_has_not_run_its_command() -> None:
    store, clock = MemoryStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1"))
    ask(controller, 1_000, ttl_s=300)
    operation = controller.updates.start("box-1")
    controller.workers.cancel_drain("box-1")
    cancelled = controller.updates.get(operation.id)
    assert (cancelled.state, cancelled.reason) == (
        "failed",
        "drain failed: cancelled by cancel-drain",
    )
    assert controller.workers.get("box-1").status is WorkerStatus.ONLINE
    assert controller.updates.for_agent("box-1") is None


async def test_cancel_drain_waits_for_an_update_command_that_runs() -> None:
    store, clock = MemoryStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1"))
    operation = controller.updates.start("box-1")
    controller.updates.report(operation.id, "update_command", "started", "running")
    with pytest.raises(Conflict, match="running its update command"):
        controller.workers.cancel_drain("box-1")
    assert controller.updates.get(operation.id).running
    assert controller.workers.get("box-1").status is WorkerStatus.DRAINED


async def test_removing_a_worker_ends_its_update() -> None:
    store, clock = MemoryStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1"))
    operation = controller.updates.start("box-1")
    controller.workers.remove("box-1")
    removed = controller.updates.get(operation.id)
    assert (removed.state, removed.reason) == (
        "failed",
        "update_command failed: the worker was removed",
    )
    controller.workers.register("box-1", gpus("box-1"))  # the name again: no update of old
    assert controller.updates.for_agent("box-1") is None


async def test_each_update_step_is_one_transaction_with_the_worker_state() -> None:
    """The drain and the operation record, and the return of the agent with the end of
    the drain and of the operation: each all or nothing."""

    store, clock = FailingStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1"), agent_version="1.0")
    store.fail = True
    with pytest.raises(ServiceUnavailable):
        controller.updates.start("box-1")
    store.fail = False
    restarted = start(store, clock)
    assert (
        restarted.workers.get("box-1").status is WorkerStatus.ONLINE
    )  # no drain without its record
    assert restarted.updates.for_agent("box-1") is None

    operation = restarted.updates.start("box-1")
    restarted.updates.report(operation.id, "update_command", "started", "running")
    restarted.updates.report(operation.id, "update_command", "ok", "")
    store.fail = True
    with pytest.raises(ServiceUnavailable):
        restarted.workers.register("box-1", gpus("box-1"), agent_version="2.0")
    store.fail = False
    again = start(store, clock)
    assert again.workers.get("box-1").status is WorkerStatus.DRAINED
    assert again.updates.get(operation.id).step("restart").outcome == "started"
    again.workers.register("box-1", gpus("box-1"), agent_version="2.0")
    done = again.updates.get(operation.id)
    assert (done.state, done.to_version) == ("succeeded", "2.0")
    assert again.workers.get("box-1").status is WorkerStatus.ONLINE
    kinds = [e.kind for e in again.events.after(0, 1000) if e.kind.startswith("operation.")]
    assert kinds.count("operation.succeeded") == 1


async def test_a_gpu_the_probe_cannot_read_gets_no_grants_until_it_reads_again() -> None:
    store, clock = MemoryStore(), Clock()
    controller = start(store, clock)
    controller.workers.register("box-1", gpus("box-1", count=1))
    controller.workers.heartbeat("box-1", [], stale=[0])
    assert controller.workers.gpu_figures("box-1")[0].stale
    waiting = ask(controller, 1_000)
    assert controller.leases.get(waiting).state is LeaseState.PENDING
    controller.workers.heartbeat("box-1", [GpuProbeReport(0, 0)])
    assert controller.leases.get(waiting).state is LeaseState.LOADING


def _expiry(record: Any) -> float:
    assert record is not None and record.lease is not None
    return float(record.lease.expires_at)


async def test_a_restart_rearms_each_ttl_from_its_own_time_without_writing_a_lease() -> None:
    """I4 over an outage: a restored lease lapses one TTL after the restart, not at the
    expiry stored before it; re-arming writes nothing (a restart with many leases costs
    no write per lease), so a second restart re-arms from its own time again."""
    store, clock = MemoryStore(), Clock()
    first = start(store, clock)
    first.workers.register("box-1", gpus("box-1"))
    held = ask(first, 1_000, ttl_s=30)
    stored_expiry = _expiry(first.leases.get(held))
    first.close()
    for outage in (100, 40):
        clock.now += outage  # past the stored expiry: no holder could renew meanwhile
        restarted = start(store, clock)
        assert _expiry(restarted.leases.get(held)) == clock.now + 30
        assert _expiry(store.lease(held)) == stored_expiry  # not rewritten
        restarted.close()
    last = start(store, clock)
    clock.now += 31
    last.pause()  # any change runs the overdue timers
    assert last.leases.get(held).state is LeaseState.EXPIRED
    stored = store.lease(held)
    assert stored is not None and stored.state is LeaseState.EXPIRED
