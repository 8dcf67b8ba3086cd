"""I8's dual, as a property: whatever askers do (submit, long-poll, go away, read or renew
their grant, or never come back), on a virtual clock,

- a pending request ends ``abandoned`` exactly when its asker has been unseen for its
  ``ttl_s`` (never while a long-poll is open, never earlier, and no cycle later);
- a grant its holder has not taken up is given back exactly at its claim bound (shorter
  than its TTL), and a grant taken up (or made while its asker watched) never is.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_arbiter.core import Policy, Request, Scheduler, Worker
from gpu_arbiter.core.model import Gpu

GiB = 1024
TTLS = (3.0, 9.0, 30.0)


@dataclass
class Asker:
    ttl_s: float
    last_seen: float
    watches: int = 0
    granted_at: float | None = None
    claimed: bool = False


steps = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from((4, 8, 16)), st.sampled_from(TTLS)),
        st.tuples(
            st.sampled_from(("watch", "unwatch", "seen", "claim", "release")), st.integers(0, 7)
        ),
        st.tuples(st.just("advance"), st.sampled_from((0.5, 1.0, 2.5, 4.0, 11.0))),
    ),
    max_size=60,
)


def act(sched: Scheduler, askers: dict[str, Asker], step: tuple[object, ...], now: float) -> None:
    kind = step[0]
    if kind == "submit":
        rid = f"r{len(askers)}"
        ttl_s = float(step[2])  # type: ignore[arg-type]
        sched.submit(Request.build(rid, vram_mb=int(step[1]) * GiB, ttl_s=ttl_s), now)  # type: ignore[call-overload]
        askers[rid] = Asker(ttl_s, now)
        return
    rid = f"r{step[1]}"
    asker = askers.get(rid)
    if asker is None:
        return
    pending = rid in sched.queue
    if kind == "watch" and pending:
        sched.watch(rid)
        asker.watches += 1
    elif kind == "unwatch" and asker.watches:
        sched.unwatch(rid, now)
        asker.watches -= 1
        asker.last_seen = now
    elif kind == "seen" and pending:
        sched.seen(rid, now)
        asker.last_seen = now
    elif kind == "claim" and rid in sched.leases:
        sched.claim(rid)
        asker.claimed = True
    elif kind == "release" and rid in sched.leases:
        sched.release(rid, now)


def check(sched: Scheduler, askers: dict[str, Asker], now: float) -> None:
    decisions = sched.decide(now)
    bound = sched.policy.claim_bound_s
    for lease in decisions.grants:
        asker = askers[lease.id]
        asker.granted_at = now
        asker.claimed = asker.watches > 0
        assert lease.claimed == asker.claimed
    for request in decisions.abandoned:
        asker = askers[request.id]
        assert asker.watches == 0 and now >= asker.last_seen + asker.ttl_s
    for lease in decisions.unclaimed:
        asker = askers[lease.id]
        assert asker.granted_at is not None and not asker.claimed
        assert now >= asker.granted_at + bound(asker.ttl_s)
        assert bound(asker.ttl_s) < asker.ttl_s
    for rid, asker in askers.items():
        if rid in sched.queue:  # not past its bound: it would have ended in this cycle
            assert asker.watches > 0 or now < asker.last_seen + asker.ttl_s
        lease = sched.leases.get(rid)
        if lease is not None and not lease.claimed:
            assert asker.granted_at is not None and now < asker.granted_at + bound(asker.ttl_s)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_askers_gone_end_within_their_bounds_and_never_earlier(
    script: list[tuple[object, ...]],
) -> None:
    sched = Scheduler(Policy(claim_s=2.0), presence=True)
    sched.put_worker(Worker("w1"), [Gpu(index=0, total_mb=24 * GiB, worker="w1")])
    askers: dict[str, Asker] = {}
    now = 0.0
    for step in script:
        if step[0] == "advance":
            now += float(step[1])  # type: ignore[arg-type]
        else:
            act(sched, askers, step, now)
        check(sched, askers, now)
