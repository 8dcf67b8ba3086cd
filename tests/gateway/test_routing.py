"""The front door's routing decision, alone (``gateway/routing.py``), and the cluster
view it is made on (``gateway/cluster.py``) on a virtual clock."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gpu_arbiter.gateway.cluster.cluster import DOWN_S, GONE_KEEP_S, Cluster
from gpu_arbiter.gateway.cluster.routing import Kind, route
from gpu_arbiter.gateway.profile import Candidate as Host
from gpu_arbiter.peer_identity import Identity, Relayed, decode_key


def test_a_ready_replica_with_a_free_slot_and_the_fewest_in_flight_wins() -> None:
    hosts = [
        Host("gw-1", local=True, ready=1, slots=2, in_flight=2),  # full
        Host("gw-2", ready=1, slots=4, in_flight=3),
        Host("gw-3", ready=1, slots=4, in_flight=1),
    ]
    decided = route("chat", hosts)
    assert (decided.kind, decided.gateway) == (Kind.PEER, "gw-3")
    assert "warm" in decided.why


def test_this_host_wins_a_tie() -> None:
    hosts = [Host("gw-2", ready=1, slots=1), Host("gw-9", local=True, ready=1, slots=1)]
    decided = route("chat", hosts)
    assert (decided.kind, decided.gateway) == (Kind.LOCAL, "gw-9")


def test_a_warm_copy_beats_a_load_on_its_way_and_a_load_beats_a_new_one() -> None:
    coming = Host("gw-2", coming=True)
    warm = Host("gw-3", ready=1, slots=1, in_flight=1)
    assert route("chat", [coming, warm]).gateway == "gw-3"
    decided = route("chat", [Host("gw-1", local=True), coming])
    assert (decided.kind, decided.gateway) == (Kind.PEER, "gw-2")


def test_cold_everywhere_is_one_load_for_the_cluster_and_cold_alone_is_local() -> None:
    decided = route("chat", [Host("gw-1", local=True), Host("gw-2")])
    assert decided.kind is Kind.LOAD and decided.gateway is None
    alone = route("chat", [Host("gw-1", local=True)])
    assert alone.kind is Kind.LOCAL
    # another host declares it, out of routing now: still the cluster's load (the
    # arbiter places it among the routable hosts, or names why none can take it)
    others_out = route("chat", [Host("gw-1", local=True), Host("gw-2", routable=False)])
    assert others_out.kind is Kind.LOAD and others_out.gateway is None


def test_a_host_that_is_not_routable_is_never_chosen_and_none_left_says_why() -> None:
    draining = Host("gw-2", routable=False, ready=1, slots=8, why_not="worker box-2 is draining")
    assert route("chat", [Host("gw-1", local=True, coming=True), draining]).gateway == "gw-1"
    decided = route("chat", [draining])
    assert decided.kind is Kind.NONE
    assert "box-2 is draining" in decided.why


hosts = st.lists(
    st.builds(
        Host,
        gateway=st.sampled_from([f"gw-{i}" for i in range(6)]),
        local=st.booleans(),
        routable=st.booleans(),
        ready=st.integers(0, 2),
        slots=st.integers(0, 8),
        in_flight=st.integers(0, 8),
        coming=st.booleans(),
    ),
    max_size=6,
    unique_by=lambda h: h.gateway,
)


@given(hosts)
def test_the_decision_is_always_a_usable_host_or_a_load_or_none(found: list[Host]) -> None:
    decided = route("chat", found)
    usable = {h.gateway: h for h in found if h.routable}  # this host too: its worker online
    if decided.kind in (Kind.LOCAL, Kind.PEER):
        chosen = usable[str(decided.gateway)]
        assert chosen.local is (decided.kind is Kind.LOCAL)
        if any(h.ready for h in usable.values()):
            assert chosen.ready  # warm before anything else
            free = [h for h in usable.values() if h.ready and h.in_flight < h.slots]
            if free:
                assert chosen.in_flight < chosen.slots
                assert chosen.in_flight == min(h.in_flight for h in free)
        else:
            assert chosen.coming or (len(found) == 1 and chosen.local)
    elif decided.kind is Kind.LOAD:
        assert not any(h.ready or h.coming for h in usable.values())
        assert len(found) > 1 or not any(h.local for h in usable.values())
    else:
        assert not usable


def _old_route(model: str, hosts: list[Host]) -> tuple[Kind, str | None, str]:
    """The front door's rule as it was before the profile, on the same figures (but for
    this host, now dropped too while its own worker is not online)."""
    usable = [h for h in hosts if h.routable]
    if not usable:
        gone = "; ".join(f"{h.gateway}: {h.why_not or 'not routable'}" for h in hosts)
        return Kind.NONE, None, f"{model}: no host can serve it now ({gone or 'none'})"
    ready = [h for h in usable if h.ready]
    if ready:
        best = min(
            ready, key=lambda h: (h.in_flight >= h.slots, h.in_flight, not h.local, h.gateway)
        )
        free = "full" if best.in_flight >= best.slots else f"{best.in_flight} in flight"
        kind = Kind.LOCAL if best.local else Kind.PEER
        return kind, best.gateway, f"{model} -> {best.gateway}: warm, {free}"
    coming = [h for h in usable if h.coming]
    if coming:
        there = min(coming, key=lambda h: (not h.local, h.gateway))
        kind = Kind.LOCAL if there.local else Kind.PEER
        return kind, there.gateway, f"{model} -> {there.gateway}: its load is on the way"
    if len(hosts) == 1 and usable[0].local:  # no other host declares it at all
        return Kind.LOCAL, usable[0].gateway, f"{model}: cold, only this host runs it"
    names = ", ".join(sorted(h.gateway for h in usable))
    return Kind.LOAD, None, f"{model}: cold, a load for the cluster ({names})"


many_hosts = st.lists(
    st.builds(
        Host,
        gateway=st.sampled_from([f"gw-{i}" for i in range(12)]),
        local=st.booleans(),
        routable=st.booleans(),
        ready=st.integers(0, 3),
        slots=st.integers(0, 12),
        in_flight=st.integers(0, 40),
        coming=st.booleans(),
        why_not=st.sampled_from(["", "worker box is draining"]),
    ),
    max_size=12,
    unique_by=lambda h: h.gateway,
)


@given(many_hosts)
def test_the_default_profile_routes_exactly_as_the_rule_before_it(found: list[Host]) -> None:
    decided = route("chat", found)
    assert (decided.kind, decided.gateway, decided.why) == _old_route("chat", found)


def test_the_route_keeps_each_profiles_run_as_its_diagnosis() -> None:
    hosts = [
        Host("gw-1", local=True, coming=True),
        Host("gw-2", routable=False, ready=1, slots=8, why_not="worker box-2 is draining"),
    ]
    decided = route("chat", hosts)
    assert decided.gateway == "gw-1"
    warm, coming = decided.diagnosis()
    assert warm["profile"] == "warm" and warm["picked"] is None
    assert [c.get("dropped") for c in warm["candidates"]] == [
        {"filter": "ready", "why": "no replica ready"},
        {"filter": "routable", "why": "worker box-2 is draining"},
    ]
    assert coming["profile"] == "coming" and coming["picked"] == "gw-1"
    assert coming["candidates"][0] | {"scores": {}, "total": 0.0} == coming["candidates"][0]
    assert len(route("chat", [Host("gw-2", ready=1, slots=1)]).diagnosis()) == 1


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds


def _view(*gateways: dict[str, Any]) -> dict[str, Any]:
    return {"signature": "s", "gateways": list(gateways)}


def _gateway(name: str, state: str = "warm", routable: bool = True) -> dict[str, Any]:
    replicas = [{"state": state, "in_flight": 0}] if state != "cold" else []
    model = {"id": "chat", "aliases": ["gpt"], "max_parallel": 2, "replicas": replicas}
    return {
        "name": name, "url": f"http://127.0.0.2:80{name[-1]}", "worker": f"box-{name[-1]}",
        "worker_state": "online" if routable else "draining", "routable": routable,
        "models": [model],
    }  # fmt: skip


def _cluster(clock: _Clock) -> Cluster:
    return Cluster(None, name="gw-1", worker="box-1", models={}, routes={}, clock=clock)  # type: ignore[arg-type]


def test_a_peer_that_refused_a_connection_is_routed_around_until_its_time_is_up() -> None:
    clock = _Clock()
    cluster = _cluster(clock)
    cluster.apply(_view(_gateway("gw-2"), _gateway("gw-3", state="busy")))
    assert cluster.decide("gpt").gateway == "gw-2"
    cluster.peer_down("gw-2")
    assert cluster.decide("gpt").gateway == "gw-3"
    clock.t += DOWN_S + 0.1
    assert cluster.decide("gpt").gateway == "gw-2"


def test_a_draining_peer_leaves_routing_and_a_view_without_a_peer_forgets_it() -> None:
    cluster = _cluster(_Clock())
    cluster.apply(_view(_gateway("gw-2", routable=False)))
    decided = cluster.decide("chat")
    assert decided.kind.value == "none" and "draining" in decided.why
    cluster.apply(_view())
    assert not cluster.knows("chat")


def test_a_peers_key_is_dropped_when_replaced_and_kept_a_while_when_its_gateway_left() -> None:
    """A key replaced by another in the view (the peer restarted) is refused from that
    view on; a gateway gone from the view (a new leader it has not reported to yet) keeps
    its key for GONE_KEEP_S, then it is refused too."""
    clock = _Clock()
    cluster = Cluster(
        None,  # type: ignore[arg-type]
        name="gw-1", worker="box-1", models={}, routes={}, clock=clock, wall=lambda: clock.t,
    )  # fmt: skip
    first, second = Identity("gw-2", wall=lambda: clock.t), Identity("gw-2", wall=lambda: clock.t)
    relayed = Relayed("POST", b"/v1/chat/completions")

    def from_(identity: Identity) -> str | None:
        gw1 = decode_key(cluster.identity.public_key)
        verdict = cluster.verify(identity.sign("gw-1", gw1, relayed), relayed)
        return verdict if isinstance(verdict, str) else None

    cluster.apply(_view(_gateway("gw-2") | {"public_key": first.public_key}))
    clock.t += 1000.0  # one key for long: still good
    assert from_(first) == "gw-2" and from_(second) is None
    cluster.apply(_view(_gateway("gw-2") | {"public_key": second.public_key}))  # restarted
    assert from_(first) is None and from_(second) == "gw-2"
    cluster.apply(_view())  # a new leader's first view: gw-2 has not reported to it yet
    clock.t += GONE_KEEP_S - 0.1
    assert from_(second) == "gw-2" and from_(first) is None
    cluster.apply(_view())
    assert from_(second) == "gw-2"  # a view that still lacks it does not extend its time
    clock.t += 0.1
    assert from_(second) is None
    cluster.apply(_view(_gateway("gw-2") | {"public_key": second.public_key}))  # reported
    assert from_(second) == "gw-2"
    cluster.apply(_view(_gateway("gw-2")))  # it reports no key now: its old one is refused
    assert from_(second) is None


def test_requests_forwarded_to_a_peer_count_against_it_before_its_next_report() -> None:
    cluster = _cluster(_Clock())
    cluster.apply(_view(_gateway("gw-2"), _gateway("gw-3")))
    assert cluster.decide("chat").gateway == "gw-2"
    cluster.forwarding[("gw-2", "chat")] += 1
    assert cluster.decide("chat").gateway == "gw-3"
