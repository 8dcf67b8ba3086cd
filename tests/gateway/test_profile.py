"""Routing as a profile (``gateway/profile/``), alone: each filter and scorer, the
picker, and the replica profile against the rule it replaced; all pure and fast."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpu_arbiter.gateway.profile import (
    COMING,
    REPLICA,
    WARM,
    WEIGHTS,
    Ask,
    Candidate,
    Filter,
    Profile,
    Scorer,
    profiles,
    rendezvous,
)
from gpu_arbiter.gateway.profile.rules import (
    COMING_SOON,
    FEWEST_IN_FLIGHT,
    FREE_SLOT,
    HAS_FREE_SLOT,
    PREFIX_AFFINITY,
    READY,
    ROUTABLE,
)

ASK = Ask("chat")


def test_routable_keeps_a_routable_host_and_says_why_it_drops_one() -> None:
    assert ROUTABLE.drops(ASK, Candidate("gw-1", local=True)) is None
    assert ROUTABLE.drops(ASK, Candidate("gw-2")) is None
    ours = Candidate("gw-1", local=True, routable=False, why_not="worker box-1 is draining")
    assert ROUTABLE.drops(ASK, ours) == "worker box-1 is draining"  # this host too
    draining = Candidate("gw-2", routable=False, why_not="worker box-2 is draining")
    assert ROUTABLE.drops(ASK, draining) == "worker box-2 is draining"
    assert ROUTABLE.drops(ASK, Candidate("gw-2", routable=False)) == "not routable"


def test_ready_coming_and_free_slot_filters() -> None:
    assert READY.drops(ASK, Candidate("gw-2", ready=1, slots=1)) is None
    assert READY.drops(ASK, Candidate("gw-2", coming=True)) == "no replica ready"
    assert COMING_SOON.drops(ASK, Candidate("gw-2", coming=True)) is None
    assert COMING_SOON.drops(ASK, Candidate("gw-2")) == "no replica on its way"
    assert HAS_FREE_SLOT.drops(ASK, Candidate("", 1, ready=1, slots=2, in_flight=1)) is None
    full = Candidate("", 1, ready=1, slots=2, in_flight=2)
    assert HAS_FREE_SLOT.drops(ASK, full) == "full: 2 in flight of 2"


figures = st.builds(
    Candidate,
    gateway=st.sampled_from([f"gw-{i}" for i in range(5)]),
    replica=st.integers(0, 4),
    local=st.booleans(),
    routable=st.booleans(),
    ready=st.integers(0, 3),
    slots=st.integers(0, 12),
    in_flight=st.integers(0, 12),
    coming=st.booleans(),
)
asks = st.builds(Ask, model=st.just("chat"), prefix=st.text(max_size=4), went=st.text(max_size=6))


@given(figures, asks)
def test_every_scorer_is_in_zero_to_one(candidate: Candidate, ask: Ask) -> None:
    for scorer in (FREE_SLOT, FEWEST_IN_FLIGHT, PREFIX_AFFINITY):
        assert 0.0 <= scorer.score(ask, candidate) <= 1.0


def test_the_scorers_say_what_they_prefer() -> None:
    free, full = Candidate("a", ready=1, slots=2, in_flight=1), Candidate("b", slots=2, in_flight=2)
    assert FREE_SLOT.score(ASK, free) == 1.0 and FREE_SLOT.score(ASK, full) == 0.0
    assert FEWEST_IN_FLIGHT.score(ASK, free) > FEWEST_IN_FLIGHT.score(ASK, full)
    assert FEWEST_IN_FLIGHT.score(ASK, Candidate("c")) == 1.0
    went = Ask("chat", prefix="p", went="gw-2/3")
    assert PREFIX_AFFINITY.score(went, Candidate("gw-2", 3)) == 1.0
    assert PREFIX_AFFINITY.score(went, Candidate("gw-2", 4)) == 0.0
    assert PREFIX_AFFINITY.score(ASK, Candidate("")) == 0.0  # nowhere known: nothing


def test_the_weights_make_the_rules_strict_in_order() -> None:
    assert WEIGHTS["free_slot"] > WEIGHTS["prefix_affinity"] + WEIGHTS["fewest_in_flight"]
    assert WEIGHTS["prefix_affinity"] > WEIGHTS["fewest_in_flight"]


candidate_lists = st.lists(figures, max_size=8, unique_by=lambda c: (c.gateway, c.replica))
any_profile = st.sampled_from([WARM, COMING, REPLICA, *profiles(True)])


@given(any_profile, candidate_lists, asks)
def test_the_picker_picks_a_candidate_that_passed_every_filter_or_none(
    profile: Profile, found: list[Candidate], ask: Ask
) -> None:
    pick = profile.pick(ask, found)
    assert [v.candidate for v in pick.verdicts] == found
    kept = [c for c in found if all(f.drops(ask, c) is None for f in profile.filters)]
    if pick.picked is None:
        assert not kept
        return
    assert pick.picked in kept
    totals = {v.candidate: v.total for v in pick.verdicts if v.dropped is None}
    assert totals[pick.picked] == max(totals.values())


@given(any_profile, candidate_lists, asks, st.randoms(use_true_random=False))
def test_the_pick_is_deterministic_whatever_the_order_of_the_candidates(
    profile: Profile, found: list[Candidate], ask: Ask, rng: object
) -> None:
    shuffled = list(found)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    assert profile.pick(ask, found).picked == profile.pick(ask, shuffled).picked


@given(candidate_lists, asks)
def test_no_free_slot_is_never_preferred_over_a_free_slot(found: list[Candidate], ask: Ask) -> None:
    for profile in (WARM, REPLICA, *profiles(True)):
        picked = profile.pick(ask, found).picked
        kept = [c for c in found if all(f.drops(ask, c) is None for f in profile.filters)]
        if picked is not None and any(c.in_flight < c.slots for c in kept):
            assert picked.in_flight < picked.slots


def test_a_drop_names_the_first_filter_that_dropped_it_and_the_diagnosis_shows_all() -> None:
    found = [
        Candidate("gw-1", local=True, ready=1, slots=2, in_flight=2),
        Candidate("gw-2", routable=False, why_not="worker box-2 is draining", ready=1),
        Candidate("gw-3", coming=True),
        Candidate("gw-4", ready=1, slots=4, in_flight=1),
    ]
    pick = WARM.pick(ASK, found)
    assert pick.picked == found[3]
    shown = pick.as_json()
    assert shown["profile"] == "warm" and shown["picked"] == "gw-4"
    assert shown["weights"] == {"free_slot": 4.0, "fewest_in_flight": 1.0}
    by_name = {c["name"]: c for c in shown["candidates"]}
    assert by_name["gw-2"]["dropped"] == {"filter": "routable", "why": "worker box-2 is draining"}
    assert by_name["gw-3"]["dropped"] == {"filter": "ready", "why": "no replica ready"}
    assert by_name["gw-1"]["scores"] == {"free_slot": 0.0, "fewest_in_flight": 1 / 3}
    assert by_name["gw-1"]["total"] == 1 / 3
    assert by_name["gw-4"]["scores"] == {"free_slot": 1.0, "fewest_in_flight": 0.5}
    assert by_name["gw-4"]["total"] == 4.5
    assert by_name["gw-4"]["in_flight"] == 1 and by_name["gw-4"]["slots"] == 4


def test_equal_totals_go_to_this_host_then_the_prefix_then_the_name() -> None:
    found = [Candidate("gw-3", ready=1, slots=1), Candidate("gw-2", ready=1, slots=1)]
    assert WARM.pick(ASK, found).picked == found[1]
    here = Candidate("gw-9", local=True, ready=1, slots=1)
    assert WARM.pick(ASK, [*found, here]).picked == here
    for prefix in ("a", "b", "c", "d"):
        ask = Ask("chat", prefix=prefix)
        first = max(found, key=lambda c: rendezvous(prefix, c.name))
        assert WARM.pick(ask, found).picked == first


def test_a_new_rule_is_one_scorer() -> None:
    """A profile built of the same parts and one scorer more: its say, and its weight."""
    bigger = Scorer("most_slots", 0.5, lambda ask, c: min(1.0, c.slots / 16))
    profile = Profile("mine", WARM.filters, (*WARM.scorers, bigger))
    found = [Candidate("gw-2", ready=1, slots=4), Candidate("gw-3", ready=2, slots=8)]
    assert WARM.pick(ASK, found).picked == found[0]  # equal totals: by name
    assert profile.pick(ASK, found).picked == found[1]
    never = Filter("never", lambda ask, c: "no")
    assert Profile("none", (never,)).pick(ASK, found).picked is None


def test_rendezvous_is_stable_and_spreads() -> None:
    assert rendezvous("k", "gw-1") == rendezvous("k", "gw-1")
    assert 0.0 <= rendezvous("k", "gw-1") < 1.0
    names = [f"gw-{i}" for i in range(4)]
    firsts = {max(names, key=lambda n: rendezvous(str(k), n)) for k in range(200)}
    assert firsts == set(names)


def _old_free_replica(found: list[Candidate], max_parallel: int) -> Candidate | None:
    """The rule ``ModelServer._free_replica`` was before the profile, on the figures."""
    best: Candidate | None = None
    for c in found:
        room = bool(c.ready) and c.in_flight < max_parallel
        if room and (best is None or c.in_flight < best.in_flight):
            best = c
    return best


@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=8),
    st.integers(1, 6),
)
def test_the_replica_profile_picks_as_the_rule_it_replaced(
    shapes: list[tuple[bool, int]], max_parallel: int
) -> None:
    found = [
        Candidate("", number, local=True, ready=int(accepting),
                  slots=max_parallel if accepting else 0, in_flight=in_flight)
        for number, (accepting, in_flight) in enumerate(shapes, 1)
    ]  # fmt: skip
    assert REPLICA.pick(ASK, found).picked == _old_free_replica(found, max_parallel)
