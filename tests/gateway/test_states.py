"""The replica's one table of allowed moves, against the drawings of its life
(``replica.py``: queued to ended; ``asleep.py``: the tier between warm and stopped), and
the one method that moves a replica refusing what the table does not allow."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gpu_arbiter.gateway.servers.replica import Replica
from gpu_arbiter.gateway.servers.states import TRANSITIONS, EndKind, ReplicaState, check_move

from .fakes import World

pytestmark = pytest.mark.timeout(20)

S = ReplicaState
REPLICA_DRAWING = {
    (S.QUEUED, S.LOADING),  # granted
    (S.QUEUED, S.ENDED),  # nobody waits: cancelled
    (S.LOADING, S.WARM),  # ready 2xx
    (S.LOADING, S.STOPPING),  # exited, not ready in load_timeout: failed
    (S.WARM, S.BUSY),  # a request in
    (S.BUSY, S.WARM),  # all out
    (S.WARM, S.STOPPING),  # keep_alive quiet, revoked, reclaimed, preempted...
    (S.BUSY, S.STOPPING),  # the same, requests in flight (they get the grace)
    (S.STOPPING, S.ENDED),  # released
}
ASLEEP_DRAWING = {
    (S.WARM, S.ASLEEP),  # idle sleep_after
    (S.ASLEEP, S.WARM),  # the server did not sleep
    (S.ASLEEP, S.WAKING),  # a request waits
    (S.WAKING, S.WARM),  # granted, woken
    (S.WAKING, S.ASLEEP),  # nobody waits any more
    (S.ASLEEP, S.STOPPING),  # keep_alive, revoked, reclaimed, the server exited
    (S.WAKING, S.STOPPING),
}


def test_the_table_is_the_drawings_every_arrow_and_nothing_else() -> None:
    table = {(now, to) for now, moves in TRANSITIONS.items() for to in moves}
    assert table == REPLICA_DRAWING | ASLEEP_DRAWING
    assert set(TRANSITIONS) == set(ReplicaState)


def test_ended_has_no_way_out_and_every_state_can_end() -> None:
    assert TRANSITIONS[S.ENDED] == frozenset()
    for state in ReplicaState:  # from anywhere, ended is reached (through stopping)
        seen, frontier = {state}, [state]
        while frontier:
            for to in TRANSITIONS[frontier.pop()]:
                if to not in seen:
                    seen.add(to)
                    frontier.append(to)
        assert S.ENDED in seen, state


@pytest.mark.parametrize("now", list(ReplicaState))
def test_a_move_the_table_does_not_allow_names_both_states(now: ReplicaState) -> None:
    for to in ReplicaState:
        if to in TRANSITIONS[now]:
            check_move(now, to)
            continue
        with pytest.raises(AssertionError, match=f"replica state {now} -> {to} "):
            check_move(now, to)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    found = World(keep_alive="5m")
    yield found
    await found.close()


async def test_a_replica_refuses_an_illegal_move_and_keeps_its_state(world: World) -> None:
    replica = Replica(world.model, 1)
    assert replica.state is S.QUEUED
    with pytest.raises(AssertionError, match="replica state queued -> warm"):
        replica.move(S.WARM)
    assert replica.state is S.QUEUED
    replica.move(S.LOADING)
    replica.move(S.LOADING)  # staying is no move
    replica.move(S.STOPPING)
    replica.move(S.ENDED)
    with pytest.raises(AssertionError, match="replica state ended -> loading"):
        replica.move(S.LOADING)
    assert replica.state is S.ENDED


async def test_a_served_replica_went_only_through_allowed_moves(world: World) -> None:
    await world.request()
    replica = world.replica
    assert replica.state is S.WARM
    replica.unload()
    await world.clock.advance(30)
    assert replica.state is S.ENDED and replica.ending is not None
    assert replica.ending.kind is EndKind.UNLOADED and str(replica.ending.kind) == "unloaded"


def test_an_ending_kind_is_its_word() -> None:
    assert [str(kind) for kind in EndKind] == [
        "keep_alive", "reclaimed", "preempted", "revoked", "failed", "cancelled", "shutdown",
        "unloaded", "dropped", "retired",
    ]  # fmt: skip
    assert f"{EndKind.KEEP_ALIVE}" == "keep_alive" and EndKind.FAILED == "failed"
    assert not EndKind.FAILED.graced and EndKind.PREEMPTED.graced


def test_each_ending_says_what_the_requests_it_cuts_off_get() -> None:
    graced = {kind for kind in EndKind if kind.graced}
    assert graced == {
        EndKind.PREEMPTED, EndKind.RECLAIMED, EndKind.REVOKED, EndKind.SHUTDOWN,
        EndKind.UNLOADED, EndKind.RETIRED,
    }  # fmt: skip
    stopped = {kind for kind in EndKind if kind.status == 503}
    assert stopped == graced | {EndKind.KEEP_ALIVE}
    assert {kind.status for kind in EndKind} == {502, 503}
    assert EndKind.DROPPED.status == 502 and not EndKind.DROPPED.graced  # as it was
    assert [kind for kind in EndKind if not kind.retry_elsewhere] == [EndKind.FAILED]
