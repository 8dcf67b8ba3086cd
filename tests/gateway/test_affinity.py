"""Prefix affinity, the one rule added as one scorer: a request's prefix (``profile/
affinity.py``), where prefixes went, and the profiles with the scorer picking the host
at the front door and the replica inside it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gpu_arbiter.gateway.cluster.cluster import Cluster
from gpu_arbiter.gateway.profile import Affinity, Ask, Candidate, Memory, profiles, rendezvous
from gpu_arbiter.gateway.profile.affinity import MAX_PARSED_BYTES

from .fakes import FakeClock, World


def _chat(*said: tuple[str, Any], model: str = "chat") -> bytes:
    messages = [{"role": role, "content": content} for role, content in said]
    return json.dumps({"model": model, "messages": messages}).encode()


SYSTEM, FIRST = ("system", "You answer in French."), ("user", "What is a GPU?")


def test_every_turn_of_a_conversation_has_the_prefix_of_its_first() -> None:
    affinity = Affinity()
    first = affinity.prefix("chat", _chat(SYSTEM, FIRST))
    later = affinity.prefix(
        "chat", _chat(SYSTEM, FIRST, ("assistant", "Un GPU..."), ("user", "Et?"))
    )
    assert first and first == later
    assert affinity.prefix("chat", _chat(SYSTEM, ("user", "Another question"))) != first
    assert affinity.prefix("other", _chat(SYSTEM, FIRST)) != first  # one model's prefixes
    parts = [{"type": "text", "text": "What is a GPU?"}]
    assert affinity.prefix("chat", _chat(SYSTEM, ("user", parts))) not in ("", first)


def test_a_prompt_or_input_is_its_own_prefix_up_to_chars() -> None:
    affinity = Affinity(16)
    a = affinity.prefix("m", json.dumps({"prompt": "0123456789abcdef and then a"}).encode())
    b = affinity.prefix("m", json.dumps({"prompt": "0123456789abcdef and then b"}).encode())
    assert a and a == b
    assert affinity.prefix("m", json.dumps({"input": ["0123456789abcdef!"]}).encode()) == a
    assert Affinity(17).prefix("m", json.dumps({"prompt": "0123456789abcdef!"}).encode()) != a


def test_no_prefix_without_a_json_body_that_says_something() -> None:
    affinity = Affinity()
    for body in (None, b"", b"not json", b"[1, 2]", b'{"model": "m"}', b'{"messages": []}'):
        assert affinity.prefix("m", body) == ""
    huge = json.dumps({"prompt": "x" * MAX_PARSED_BYTES}).encode()
    assert affinity.prefix("m", huge) == ""


def test_memory_keeps_the_newest() -> None:
    memory = Memory(2)
    memory.put("a", "gw-1")
    memory.put("b", "gw-2")
    memory.put("a", "gw-3")  # a is the newest now
    memory.put("c", "gw-4")
    assert (memory.get("a"), memory.get("b"), memory.get("c")) == ("gw-3", "", "gw-4")
    memory.put("", "gw-5")
    assert memory.get("") == "" and len(memory) == 2


WARM, REPLICA = profiles(True)


def test_where_a_prefix_went_wins_while_it_has_a_free_slot() -> None:
    busier = Candidate("gw-2", ready=1, slots=4, in_flight=3)
    idle = Candidate("gw-3", ready=1, slots=4)
    ask = Ask("chat", "p", "gw-2")
    assert WARM.pick(ask, [busier, idle]).picked == busier
    full = Candidate("gw-2", ready=1, slots=4, in_flight=4)
    assert WARM.pick(ask, [full, idle]).picked == idle  # full: the free slot wins
    assert profiles(False)[0].pick(ask, [busier, idle]).picked == idle  # off: as before


@given(
    st.lists(
        st.builds(
            Candidate, gateway=st.sampled_from(["gw-1", "gw-2", "gw-3", "gw-4"]),
            ready=st.integers(0, 2), slots=st.integers(0, 4), in_flight=st.integers(0, 5),
        ),
        unique_by=lambda c: c.gateway, max_size=4,
    ),
    st.text(min_size=1, max_size=4),
    st.sampled_from(["", "gw-1", "gw-2"]),
)  # fmt: skip
def test_affinity_never_prefers_a_full_candidate_and_keeps_where_it_went_if_free(
    found: list[Candidate], prefix: str, went: str
) -> None:
    picked = WARM.pick(Ask("chat", prefix, went), found).picked
    ready = [c for c in found if c.ready]
    if picked is None:
        assert not ready
        return
    if any(c.in_flight < c.slots for c in ready):
        assert picked.in_flight < picked.slots
    there = [c for c in ready if c.name == went and c.in_flight < c.slots]
    if there:
        assert picked == there[0]


def test_new_prefixes_spread_over_equal_replicas_by_rendezvous() -> None:
    found = [Candidate("", n, local=True, ready=1, slots=2) for n in (1, 2, 3)]
    firsts = set()
    for prefix in map(str, range(60)):
        picked = REPLICA.pick(Ask("chat", prefix), found).picked
        assert picked == max(found, key=lambda c: rendezvous(prefix, c.name))
        firsts.add(picked)
    assert firsts == set(found)


def _view(*gateways: tuple[str, int]) -> dict[str, Any]:
    return {
        "signature": "s",
        "gateways": [
            {"name": name, "url": f"http://127.0.0.2:80{name[-1]}", "worker": f"box-{name[-1]}",
             "worker_state": "online", "routable": True,
             "models": [{"id": "chat", "aliases": [], "max_parallel": 4, "in_flight": busy,
                         "replicas": [{"state": "busy" if busy else "warm", "in_flight": busy}]}]}
            for name, busy in gateways
        ],
    }  # fmt: skip


def test_the_front_door_sends_a_conversation_where_it_went_while_it_has_room() -> None:
    cluster = Cluster(
        None,
        name="gw-1",
        worker="box-1",
        models={},
        routes={},
        clock=FakeClock(),
        affinity=Affinity(),
    )  # type: ignore[arg-type]
    cluster.apply(_view(("gw-2", 0), ("gw-3", 0)))
    first = cluster.decide("chat", _chat(SYSTEM, FIRST))
    went = str(first.gateway)
    other = "gw-3" if went == "gw-2" else "gw-2"
    cluster.forwarding[(went, "chat")] += 2  # busier now than the other
    assert (
        cluster.decide("chat", _chat(SYSTEM, FIRST, ("assistant", "a"), ("user", "b"))).gateway
        == went
    )
    assert cluster.decide("chat").gateway == other  # no body: no prefix, fewest in flight
    [warm] = cluster.decide("chat", _chat(SYSTEM, FIRST)).diagnosis()
    assert warm["weights"] == {"free_slot": 4.0, "prefix_affinity": 2.0, "fewest_in_flight": 1.0}
    scores = {c["name"]: c["scores"]["prefix_affinity"] for c in warm["candidates"]}
    assert scores == {went: 1.0, other: 0.0}
    cluster.forwarding[(went, "chat")] += 2  # full: 4 in flight of 4
    assert cluster.decide("chat", _chat(SYSTEM, FIRST)).gateway == other
    assert cluster.decide("chat", _chat(SYSTEM, FIRST)).gateway == other  # it went there last


def _replica(number: int, in_flight: int) -> Any:
    return SimpleNamespace(
        number=number, accepting=True, state="busy", in_flight=in_flight, generation=0
    )


async def test_inside_a_host_a_conversation_keeps_its_replica_while_it_has_a_free_slot() -> None:
    world = World(max_parallel=2)
    try:
        model = world.model
        model.affinity = Affinity()
        prefix = model.affinity.prefix("chat", _chat(SYSTEM, FIRST))
        model.replicas = [_replica(1, 0), _replica(2, 0)]
        first = model._free_replica(prefix)
        assert first is not None
        first.in_flight = 1  # busier than the other now
        assert model._free_replica(prefix) is first
        assert model._free_replica("") is not first  # no prefix: fewest in flight
        first.in_flight = 2  # full
        second = model._free_replica(prefix)
        assert second is not None and second is not first
        model.affinity = None
        first.in_flight, second.in_flight = 0, 1
        assert model._free_replica(prefix) is first  # off: fewest in flight, as before
    finally:
        model.replicas = []
        await world.close()
