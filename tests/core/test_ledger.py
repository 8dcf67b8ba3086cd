"""The availability rule of I2 and the load count of I3, on the ledger alone."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_arbiter.core import GpuId, GpuProbe, Lease, LeaseState
from gpu_arbiter.core.ledger import Ledger
from tests.core.support import gpu, req

G0 = GpuId("w1", 0)
CAPACITY = 24576 - 256


def _ledger() -> Ledger:
    ledger = Ledger()
    ledger.put_gpu(gpu(0, 24576, headroom_mb=256))
    return ledger


def _lease(lease_id: str, mb: int, *, loading: bool = True) -> Lease:
    return Lease(
        request=req(lease_id, mb),
        gpus=(G0,),
        token=1,
        state=LeaseState.LOADING if loading else LeaseState.ACTIVE,
        granted_at=0.0,
        expires_at=30.0,
        load_deadline=300.0,
        loading=loading,
    )


def test_without_probe_only_commitments_count() -> None:
    ledger = _ledger()
    assert ledger.free_mb(G0) == CAPACITY
    ledger.commit(_lease("a", 4000))
    ledger.commit(_lease("b", 6000, loading=False))
    assert ledger.committed_mb(G0) == 10000
    assert ledger.free_mb(G0) == CAPACITY - 10000
    assert ledger.loading(G0) == 1
    assert set(ledger.lease_ids(G0)) == {"a", "b"}
    assert ledger.observed_mb(G0) == 0


def test_coarse_probe_counts_the_larger_of_committed_and_observed() -> None:
    ledger = _ledger()
    ledger.commit(_lease("a", 8000))
    ledger.set_probe(G0, GpuProbe(used_mb=3000))  # not grown to its reservation yet
    assert ledger.free_mb(G0) == CAPACITY - 8000
    ledger.set_probe(G0, GpuProbe(used_mb=12000))  # strangers (or the holder) use more
    assert ledger.free_mb(G0) == CAPACITY - 12000
    assert ledger.observed_mb(G0) == 12000
    assert ledger.committed_mb(G0) == 8000


def test_exact_rule_counts_each_lease_and_strangers() -> None:
    ledger = _ledger()
    ledger.commit(_lease("a", 8000))
    ledger.commit(_lease("b", 4000, loading=False))
    # a has used 3000 of 8000; b uses 5000 (1000 over); strangers use 2000
    ledger.set_probe(G0, GpuProbe(used_mb=3000 + 5000 + 2000, lease_used_mb={"a": 3000, "b": 5000}))
    occupied = max(8000, 3000) + max(4000, 5000) + 2000
    assert ledger.free_mb(G0) == CAPACITY - occupied
    # the coarse rule would have hidden the strangers behind a's unused reservation
    assert ledger.free_mb(G0) < CAPACITY - max(12000, 10000)


def test_exact_rule_counts_usage_of_ended_leases_as_external_until_probed_again() -> None:
    ledger = _ledger()
    lease = _lease("a", 8000, loading=False)
    ledger.commit(lease)
    ledger.set_probe(G0, GpuProbe(used_mb=8000, lease_used_mb={"a": 8000}))
    ledger.uncommit(lease)
    assert ledger.committed_mb(G0) == 0
    assert ledger.free_mb(G0) == CAPACITY - 8000  # the probe still shows it
    ledger.set_probe(G0, GpuProbe(used_mb=0, lease_used_mb={}))
    assert ledger.free_mb(G0) == CAPACITY


def test_coarse_probe_still_shows_released_memory_until_the_next_reading() -> None:
    ledger = _ledger()
    lease = _lease("a", 8000, loading=False)
    ledger.commit(lease)
    ledger.set_probe(G0, GpuProbe(used_mb=8000))
    ledger.uncommit(lease)
    assert ledger.free_mb(G0) == CAPACITY - 8000
    ledger.set_probe(G0, GpuProbe(used_mb=100))
    assert ledger.free_mb(G0) == CAPACITY - 100


def test_uncommit_releases_exactly_once() -> None:
    ledger = _ledger()
    a = _lease("a", 4000)
    ledger.commit(a)
    ledger.commit(_lease("b", 2000, loading=False))
    ledger.uncommit(a)
    ledger.uncommit(a)
    assert ledger.committed_mb(G0) == 2000
    assert ledger.loading(G0) == 0
    assert ledger.lease_ids(G0) == ("b",)


def test_uncommit_after_a_shrink_releases_what_the_lease_still_holds() -> None:
    ledger = _ledger()
    a = _lease("a", 4000, loading=False)
    ledger.commit(a)
    ledger.shrink(a, 1000)
    ledger.uncommit(a)  # the lease as granted: what it reserved is what is released
    assert ledger.committed_mb(G0) == 0
    assert ledger.free_mb(G0) == CAPACITY
    assert ledger.by_free == [(CAPACITY, G0)]


def test_finish_loading_opens_the_load_gate() -> None:
    ledger = _ledger()
    a = _lease("a", 4000)
    ledger.commit(a)
    assert ledger.loading(G0) == 1
    ledger.finish_loading(a)
    assert ledger.loading(G0) == 0
    assert ledger.committed_mb(G0) == 4000


def test_free_after_predicts_the_memory_of_victims() -> None:
    ledger = _ledger()
    ledger.commit(_lease("a", 8000, loading=False))
    ledger.commit(_lease("b", 4000, loading=False))
    assert ledger.free_after(G0, {"a"}) == CAPACITY - 4000
    ledger.set_probe(G0, GpuProbe(used_mb=15000))
    assert ledger.free_after(G0, {"a"}) == CAPACITY - (15000 - 8000)
    ledger.set_probe(G0, GpuProbe(used_mb=15000, lease_used_mb={"a": 9000, "b": 4000}))
    assert ledger.free_after(G0, {"a"}) == CAPACITY - (4000 + 2000)


def test_stale_probe_and_figures() -> None:
    ledger = _ledger()
    ledger.commit(_lease("a", 1000))
    ledger.set_probe(G0, GpuProbe(used_mb=500))
    ledger.set_probe(G0, None)
    figures = ledger.figures(G0)
    assert figures.stale
    assert figures.used_mb == 500  # the last reading is kept
    assert figures.committed_mb == 1000
    assert figures.free_mb == CAPACITY - 1000
    assert figures.loading == 1
    ledger.set_probe(G0, GpuProbe(used_mb=1000))
    assert not ledger.stale(G0)


def test_resizing_a_gpu_keeps_its_commitments() -> None:
    ledger = _ledger()
    ledger.commit(_lease("a", 1000))
    ledger.put_gpu(gpu(0, 48 * 1024))
    assert ledger.free_mb(G0) == 48 * 1024 - 1000
    assert ledger.by_free == [(48 * 1024 - 1000, G0)]
    ledger.put_gpu(gpu(0, 48 * 1024, headroom_mb=1024))  # the headroom counts at once
    assert ledger.free_mb(G0) == 47 * 1024 - 1000
    assert ledger.figures(G0).free_mb == 47 * 1024 - 1000
    assert ledger.by_free == [(47 * 1024 - 1000, G0)]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([1000, 2000, 4000, 8000]), min_size=1, max_size=5),
    st.sets(st.integers(0, 4)),
    st.lists(st.sampled_from([500, 3000]), max_size=2),
    st.sampled_from(["none", "coarse", "per_lease"]),
    st.integers(0, 6000),
)
def test_free_planned_is_what_uncommitting_and_committing_would_leave(
    sizes: list[int], ended: set[int], added: list[int], probe: str, strangers: int
) -> None:
    """A plan reads the ledger as its own endings and grants leave it without changing it:
    the figure is the one an uncommit and a commit give on a copy, for every kind of probe
    (an ended lease's memory still counts for as long as the reading shows it, I2)."""
    ledger = _ledger()
    leases = [_lease(f"l{i}", mb, loading=False) for i, mb in enumerate(sizes)]
    for lease in leases:
        ledger.commit(lease)
    used = sum(sizes) + strangers
    if probe == "coarse":
        ledger.set_probe(G0, GpuProbe(used_mb=used))
    elif probe == "per_lease":
        ledger.set_probe(
            G0, GpuProbe(used_mb=used, lease_used_mb={lease.id: lease.vram_mb for lease in leases})
        )
    gone = {f"l{i}" for i in ended if i < len(leases)}
    predicted = ledger.free_planned(G0, gone, sum(added))
    after = copy.deepcopy(ledger)
    for lease in leases:
        if lease.id in gone:
            after.uncommit(lease)
    for i, mb in enumerate(added):
        after.commit(_lease(f"new{i}", mb))
    assert predicted == after.free_mb(G0)
    assert ledger.free_after(G0, gone) == ledger.free_planned(G0, (), 0, gone)
