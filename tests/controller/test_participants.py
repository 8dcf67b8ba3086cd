"""The participants of a change: declared once, in order; every hook runs for each of
them in that order; an exception in any participant's hook hands the error to the
recovery hook, and memory is then what the store holds (nothing stored when the hook
ran before the store's commit)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from gpu_arbiter.controller import Controller, ServiceUnavailable
from gpu_arbiter.controller.change import Participant
from gpu_arbiter.core import Gpu, LeaseState
from gpu_arbiter.store import MemoryStore

from .support import Clock, request

NAMES = (
    "Leases",
    "Workers",
    "Updates",
    "GatewayNames",
    "CatalogueRevisions",
    "Events",
    "Timer",
    "Roles",
)
HOOKS = ("sweep", "absorb", "encode", "stored", "committed")  # in the order a change runs them
BEFORE_THE_COMMIT = ("sweep", "absorb", "encode")


class Bug(Exception):
    """Any exception a hook may raise: not a store error, not a refusal."""


def started(*, grouped: bool = False) -> tuple[Controller, MemoryStore]:
    store = MemoryStore()
    gpu = Gpu(index=0, total_mb=81920, worker="local", arch="sm_90")
    controller = Controller(store, clock=Clock(), simulated=[gpu])
    controller.start()
    if grouped:
        controller.changes.commit_in_groups()
    return controller, store


def named(participant: Participant) -> str:
    return type(participant).__name__


def stored_state(store: MemoryStore) -> tuple[Any, ...]:
    snapshot = store.load()
    leases = sorted((r.id, str(r.state), r.token) for r in snapshot.leases)
    return leases, snapshot.last_event_seq, dict(snapshot.meta)


def live_leases(controller: Controller) -> list[tuple[str, str, int | None]]:
    return sorted((r.id, str(r.state), r.token) for r in controller.leases.all())


def record_hooks(controller: Controller, calls: list[tuple[str, str]]) -> None:
    """Each hook of each participant notes (hook, participant) in ``calls``, then runs."""
    for participant in controller.changes.participants:
        for hook in (*HOOKS, "recover"):
            original: Callable[..., None] = getattr(participant, hook)

            def noted(
                *args: Any, _hook: str = hook, _p: str = named(participant), _o: Any = original
            ) -> None:
                calls.append((_hook, _p))
                _o(*args)

            setattr(participant, hook, noted)


def fail_once(participant: Participant, hook: str) -> Bug:
    """``participant``'s ``hook`` raises :class:`Bug` the first time it runs, then runs."""
    error = Bug(f"a bug in {named(participant)}.{hook}")
    original: Callable[..., None] = getattr(participant, hook)
    raised: list[Bug] = []

    def failing(*args: Any) -> None:
        if not raised:
            raised.append(error)
            raise error
        original(*args)

    setattr(participant, hook, failing)
    return error


def recovered(controller: Controller) -> list[BaseException]:
    """The errors handed to the recovery hook (which still reloads)."""
    roles = controller.changes.participants[-1]
    errors: list[BaseException] = []
    original = roles.recover

    def noting(error: BaseException) -> None:
        errors.append(error)
        original(error)

    roles.recover = noting  # type: ignore[method-assign]
    return errors


async def test_the_participants_are_declared_once_in_the_order_of_a_change() -> None:
    controller, _ = started()
    participants = controller.changes.participants
    assert tuple(map(named, participants)) == NAMES
    assert participants[:6] == (
        controller.leases,
        controller.workers,
        controller.updates,
        controller.names,
        controller.catalogue,
        controller.events,
    )
    assert all(isinstance(p, Participant) for p in participants)


@pytest.mark.parametrize("grouped", [False, True], ids=["one_by_one", "group_commit"])
async def test_each_hook_runs_for_every_participant_in_the_declared_order(grouped: bool) -> None:
    controller, _ = started(grouped=grouped)
    calls: list[tuple[str, str]] = []
    record_hooks(controller, calls)
    controller.pause()  # one change: the core paused, one event
    await asyncio.wait_for(controller.changes.settled(controller.changes.failures), 60)
    assert calls == [(hook, name) for hook in HOOKS for name in NAMES]
    await controller.changes.flush()


def _hook_cases() -> list[Any]:
    return [
        pytest.param(index, hook, id=f"{name}.{hook}")
        for hook in HOOKS
        for index, name in enumerate(NAMES)
    ]


@pytest.mark.parametrize(("index", "hook"), _hook_cases())
async def test_a_bug_in_any_hook_goes_to_recovery_and_memory_is_what_is_stored(
    index: int, hook: str
) -> None:
    controller, store = started()
    before = stored_state(store)
    errors = recovered(controller)
    error = fail_once(controller.changes.participants[index], hook)
    raised = Bug if hook in ("sweep", "absorb") else ServiceUnavailable  # the cycle's, as is
    with pytest.raises(raised) as caught:
        controller.leases.submit("client-1", request(1_000, holder="h"))
    assert caught.value is error or caught.value.__cause__ is error
    assert errors == [error]
    assert controller.gate.broken is None  # reloaded, serving on
    if hook in BEFORE_THE_COMMIT:
        assert stored_state(store) == before  # nothing of the change was stored
        assert controller.leases.all() == []
    assert live_leases(controller) == stored_state(store)[0]
    assert controller.events.last_seq == store.load().last_event_seq
    for stored in controller.leases.all():  # its load done: the GPU may load the next
        controller.leases.ready(stored.id)
    record = controller.leases.submit("client-1", request(1_000, holder="h")).record
    assert record.state is LeaseState.LOADING


@pytest.mark.parametrize(("index", "hook"), _hook_cases())
async def test_with_group_commit_a_bug_in_any_hook_fails_the_answer_and_reloads(
    index: int, hook: str
) -> None:
    controller, store = started(grouped=True)
    before = stored_state(store)
    errors = recovered(controller)
    error = fail_once(controller.changes.participants[index], hook)
    failures = controller.changes.failures
    if hook in BEFORE_THE_COMMIT:  # the change fails on the loop, before it is handed over
        with pytest.raises((Bug, ServiceUnavailable)):
            controller.pause()
    else:  # it fails once stored, when it is announced: its answer fails
        controller.pause()
    with pytest.raises(ServiceUnavailable, match="a bug in"):
        await asyncio.wait_for(controller.changes.settled(failures), 60)
    await asyncio.wait_for(controller.changes.flush(), 60)
    assert errors == [error]
    assert controller.gate.broken is None
    if hook in BEFORE_THE_COMMIT:
        assert stored_state(store) == before  # nothing of the change was stored
        assert not controller.scheduler.paused
    else:
        assert controller.scheduler.paused  # stored before the bug: the reload has it
    assert store.load().meta.get("paused", 0) == int(controller.scheduler.paused)
    assert controller.events.last_seq == store.load().last_event_seq
