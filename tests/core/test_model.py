from __future__ import annotations

import copy
import inspect
import math
import pickle
from dataclasses import FrozenInstanceError, fields, replace
from typing import Any

import pytest

from gpu_arbiter.core import (
    Constraints,
    Gpu,
    GpuId,
    InvalidInput,
    Lease,
    LeaseState,
    Policy,
    Request,
    Worker,
    check_metadata,
    compute_capability,
    validate_worker_name,
)
from gpu_arbiter.core.model import evolve


def _field_of(fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(InvalidInput) as caught:
        fn(*args, **kwargs)
    return caught.value.field


# ---------------------------------------------------------------- GPU ids and names


def test_gpu_id_parses_exactly_on_the_colon() -> None:
    assert GpuId.parse("box-1:0") == GpuId("box-1", 0)
    assert GpuId.parse("BOX-1:12") == GpuId("box-1", 12)
    assert str(GpuId("box-1", 3)) == "box-1:3"


def test_gpu_id_never_matches_by_prefix() -> None:
    assert GpuId.parse("foo:0") != GpuId.parse("foo-bar:0")
    assert GpuId.parse("foo-bar:0").worker == "foo-bar"


@pytest.mark.parametrize("bad", ["foo", "foo:", ":0", "foo:0:1", "foo:-1", "foo:x", "Foo Bar:0"])
def test_gpu_id_rejects_malformed_text(bad: str) -> None:
    assert _field_of(GpuId.parse, bad) in ("gpu", "worker")


def test_worker_names_are_case_folded_and_checked() -> None:
    assert validate_worker_name("Box-1.lab_2") == "box-1.lab_2"
    for bad in ("", "-box", "box:1", "a" * 64, "box 1"):
        assert _field_of(validate_worker_name, bad) == "worker"
    assert Worker("BOX").name == "box"


@pytest.mark.parametrize(
    ("arch", "cc"),
    [
        ("sm_86", (8, 6)),
        ("sm_80", (8, 0)),
        ("sm_90", (9, 0)),
        ("sm_100", (10, 0)),
        ("sm_120", (12, 0)),
    ],
)
def test_compute_capability_from_arch(arch: str, cc: tuple[int, int]) -> None:
    assert compute_capability(arch) == cc


@pytest.mark.parametrize("arch", ["gfx1100", "sm_8", "sm_", "", "sm_x6"])
def test_compute_capability_is_none_for_other_archs(arch: str) -> None:
    assert compute_capability(arch) is None


# ---------------------------------------------------------------- GPU


def test_gpu_capacity_is_total_minus_headroom() -> None:
    gpu = Gpu(index=1, total_mb=24576, headroom_mb=256, worker="Box-1", vendor="NVIDIA")
    assert gpu.capacity_mb == 24320
    assert gpu.id == GpuId("box-1", 1)
    assert gpu.vendor == "nvidia"


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"index": -1}, "gpu.index"),
        ({"index": True}, "gpu.index"),
        ({"total_mb": 0}, "gpu.total_mb"),
        ({"total_mb": 1.5}, "gpu.total_mb"),
        ({"headroom_mb": -1}, "gpu.headroom_mb"),
        ({"headroom_mb": 24576}, "gpu.headroom_mb"),
        ({"arch": "SM 86"}, "gpu.arch"),
        ({"worker": "no:colons"}, "gpu.worker"),
    ],
)
def test_gpu_validation_names_the_field(fields: dict[str, Any], name: str) -> None:
    base: dict[str, Any] = {"index": 0, "total_mb": 24576}
    assert _field_of(Gpu, **{**base, **fields}) == name


# ---------------------------------------------------------------- Request


def test_request_defaults() -> None:
    request = Request.build("r", vram_mb="8G")
    assert request.vram_mb == 8192
    assert request.gpus == 1
    assert request.priority == 500
    assert request.preemptible is True
    assert request.ttl_s == 30.0
    assert request.max_wait_s is None
    assert request.load_timeout_s == 300.0


def test_preemptible_defaults_to_below_interactive() -> None:
    assert Request.build("a", vram_mb=1, priority=799).preemptible is True
    assert Request.build("b", vram_mb=1, priority="interactive").preemptible is False
    assert Request.build("c", vram_mb=1, priority="critical").preemptible is False
    assert Request.build("d", vram_mb=1, priority="critical", preemptible=True).preemptible


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"vram_mb": 0}, "vram_mb"),
        ({"vram_mb": "lots"}, "vram_mb"),
        ({"gpus": 0}, "gpus"),
        ({"gpus": 65}, "gpus"),
        ({"gpus": True}, "gpus"),
        ({"priority": 1001}, "priority"),
        ({"priority": "urgent"}, "priority"),
        ({"preemptible": "yes"}, "preemptible"),
        ({"holder": "x" * 257}, "holder"),
        ({"metadata": {f"k{i}": i for i in range(33)}}, "metadata"),
        ({"metadata": {"k": "x" * 5000}}, "metadata"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"ttl_s": -1}, "ttl_s"),
        ({"ttl_s": float("inf")}, "ttl_s"),
        ({"ttl_s": "30"}, "ttl_s"),
        ({"max_wait_s": -1}, "max_wait_s"),
        ({"max_wait_s": float("nan")}, "max_wait_s"),
        ({"load_timeout_s": None}, "load_timeout_s"),
        ({"load_timeout_s": 0}, "load_timeout_s"),
        ({"idempotency_key": ""}, "idempotency_key"),
    ],
)
def test_request_validation_names_the_field(fields: dict[str, Any], name: str) -> None:
    base: dict[str, Any] = {"vram_mb": 1024}
    assert _field_of(Request.build, "r", **{**base, **fields}) == name


def test_request_accepts_edge_values() -> None:
    assert Request.build("r", vram_mb=1, max_wait_s=0).max_wait_s == 0.0
    assert Request.build("r", vram_mb=1, ttl_s=None).ttl_s is None
    assert Request.build("r", vram_mb=1, gpus=64).gpus == 64


@pytest.mark.parametrize(
    ("valid", "invalid", "name"),
    [
        ({"vram_mb": 1}, {"vram_mb": True}, "vram_mb"),
        ({"priority": 1}, {"priority": True}, "priority"),
        ({"preemptible": True}, {"preemptible": 1}, "preemptible"),
        ({"ttl_s": 1}, {"ttl_s": True}, "ttl_s"),
        ({"max_wait_s": 0}, {"max_wait_s": False}, "max_wait_s"),
        ({"load_timeout_s": 1.0}, {"load_timeout_s": True}, "load_timeout_s"),
    ],
)
def test_a_value_equal_to_one_checked_before_is_still_checked_by_its_type(
    valid: dict[str, Any], invalid: dict[str, Any], name: str
) -> None:
    """The checks of the scalar fields are remembered per set of values: ``True == 1``
    and ``hash(True) == hash(1)``, yet a boolean is no size, priority or time."""
    for _ in range(2):
        assert Request.build("r", **{"vram_mb": 1024, **valid})
        assert _field_of(Request.build, "r", **{"vram_mb": 1024, **invalid}) == name


def test_an_unhashable_value_is_refused_naming_its_field() -> None:
    assert _field_of(Request.build, "r", vram_mb=[1024]) == "vram_mb"
    assert _field_of(Request.build, "r", vram_mb=1024, priority={"p": 1}) == "priority"


def test_requests_and_leases_are_built_as_their_fields_say() -> None:
    """Their ``__init__`` assigns the slots of a twin class: same signature, defaults,
    factories, and an instance of exactly their class, frozen, once built."""
    first, second = Request("a", 1), Request(id="b", vram_mb=2, gpus=3)
    assert type(first) is Request and type(evolve(first, seq=2)) is Request
    assert (first.gpus, first.priority, first.ttl_s, first.seq) == (1, 500, 30.0, 0)
    assert second.gpus == 3
    assert first.metadata == {} and first.metadata is not second.metadata
    assert first == Request("a", 1) and first != second
    assert replace(first, vram_mb=5) == Request("a", 5)
    with pytest.raises(TypeError):
        Request("a")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Request("a", 1, nonsense=1)  # type: ignore[call-arg]
    with pytest.raises(FrozenInstanceError):
        first.vram_mb = 2  # type: ignore[misc]
    lease = Lease(first, (GpuId("w", 0),), 1, LeaseState.LOADING, 0.0, 30.0, 300.0)
    assert type(lease) is Lease and type(replace(lease, token=2)) is Lease
    assert (lease.idle, lease.loading, lease.revoked_at, lease.vram_mb) == (False, True, None, 1)
    assert evolve(lease, idle=True) == replace(lease, idle=True)
    assert str(inspect.signature(Request)).startswith("(id: 'str', vram_mb: 'int', gpus")


@pytest.mark.parametrize("final", [Request, Lease])
def test_requests_and_leases_cannot_be_subclassed(final: type) -> None:
    with pytest.raises(TypeError, match="is final"):
        type("Sub", (final,), {})


@pytest.mark.parametrize(
    "value",
    [GpuId("box-1", 0), Constraints.build(vendor="nvidia", labels={"zone": "a"}), Constraints()],
)
def test_a_remembered_hash_is_never_that_of_another_value(value: Any) -> None:
    """GPU ids and constraints remember their hash; every copy (changed or not) computes
    its own, so equal values hash alike and a changed copy is found as what it now is."""
    table = {value: "original"}
    for copy_of in (copy.copy(value), pickle.loads(pickle.dumps(value)), replace(value)):
        assert copy_of == value and hash(copy_of) == hash(value)
        assert table[copy_of] == "original"
    first_field = fields(value)[0].name
    other = "w2" if isinstance(value, GpuId) else "amd"
    for changed in (evolve(value, **{first_field: other}), replace(value, **{first_field: other})):
        rebuilt = type(value)(**{f.name: getattr(changed, f.name) for f in fields(value)})
        assert changed == rebuilt and hash(changed) == hash(rebuilt)
        assert changed not in table


# ---------------------------------------------------------------- Constraints


def test_constraints_build_normalizes() -> None:
    c = Constraints.build(
        vendor="NVIDIA",
        min_compute_capability="8.6",
        gpu_arch=["sm_89", "sm_86", "sm_86"],
        gpu_model="*4090*",
        worker="Box-1",
        labels={"zone": "a", "disk": "ssd"},
    )
    assert c.vendor == "nvidia"
    assert c.min_compute_capability == (8, 6)
    assert c.gpu_arch == ("sm_86", "sm_89")
    assert c.worker == "box-1"
    assert c.labels == (("disk", "ssd"), ("zone", "a"))
    assert Constraints.build(min_compute_capability=10.0).min_compute_capability == (10, 0)
    assert Constraints.build(gpu_arch="sm_90").gpu_arch == ("sm_90",)
    assert Constraints.build() == Constraints()


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"min_compute_capability": "eight"}, "constraints.min_compute_capability"),
        ({"min_compute_capability": "8.6.1"}, "constraints.min_compute_capability"),
        ({"min_compute_capability": True}, "constraints.min_compute_capability"),
        ({"gpu_arch": ["sm 86"]}, "constraints.gpu_arch"),
        ({"gpu_arch": [86]}, "constraints.gpu_arch"),
        ({"vendor": ""}, "constraints.vendor"),
        ({"gpu_model": "x" * 300}, "constraints.gpu_model"),
        ({"worker": "a:b"}, "constraints.worker"),
        ({"labels": {"zone": 1}}, "constraints.labels"),
        ({"gpu_ids": "box:0"}, "constraints.gpu_ids"),
        ({"gpu_ids": []}, "constraints.gpu_ids"),
        ({"gpu_ids": ["box"]}, "constraints.gpu_ids"),
        ({"gpu_ids": ["box:0:1"]}, "constraints.gpu_ids"),
        ({"gpu_ids": ["box:-1"]}, "constraints.gpu_ids"),
        ({"gpu_ids": [0]}, "constraints.gpu_ids"),
        ({"gpu_ids": ["box:0", "BOX:0"]}, "constraints.gpu_ids"),
        ({"gpu_ids": ["a:0", "b:0"]}, "constraints.gpu_ids"),
        ({"gpu_ids": ["a:0"], "worker": "b"}, "constraints.gpu_ids"),
        ({"never_preempt": "lease-1"}, "constraints.never_preempt"),
        ({"never_preempt": [1]}, "constraints.never_preempt"),
        ({"never_preempt": ["a b"]}, "constraints.never_preempt"),
        ({"never_preempt": ["x" * 65]}, "constraints.never_preempt"),
        ({"never_preempt": [f"l{i}" for i in range(17)]}, "constraints.never_preempt"),
    ],
)
def test_constraints_validation_names_the_field(fields: dict[str, Any], name: str) -> None:
    assert _field_of(Constraints.build, **fields) == name


def test_never_preempt_is_kept_sorted_once_and_described() -> None:
    c = Constraints.build(never_preempt=["lease-b", "lease-a", "lease-b"])
    assert c.never_preempt == ("lease-a", "lease-b")
    assert "never_preempt=lease-a|lease-b" in c.describe()
    assert Constraints.build().never_preempt == ()


def test_gpu_ids_are_parsed_exactly_and_set_the_gpu_count() -> None:
    c = Constraints.build(gpu_ids=["Box-1:1", "box-1:0"], worker="box-1")
    assert c.gpu_ids == (GpuId("box-1", 0), GpuId("box-1", 1))
    assert "gpu_ids=box-1:0|box-1:1" in c.describe()
    assert Request.build("r", vram_mb=1, constraints=c).gpus == 2
    assert Request.build("r", vram_mb=1, gpus=2, constraints=c).gpus == 2
    assert Request.build("r", vram_mb=1).gpus == 1
    with pytest.raises(InvalidInput) as caught:
        Request.build("r", vram_mb=1, gpus=1, constraints=c)
    assert caught.value.field == "gpus"
    assert "constraints.gpu_ids (2)" in caught.value.reason


# ---------------------------------------------------------------- Policy and lease states


def test_policy_defaults() -> None:
    policy = Policy()
    assert policy.max_concurrent_loads == 1
    assert policy.placement == "binpack"
    assert policy.aging_cap == 799
    assert policy.preempt_exempt_s == 0
    assert policy.grace_s == 10
    assert policy.preempt_patience_s == 0


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"max_concurrent_loads": 0}, "max_concurrent_loads"),
        ({"placement": "random"}, "placement"),
        ({"aging_interval_s": 0}, "aging_interval_s"),
        ({"aging_step": -1}, "aging_step"),
        ({"aging_cap": 800}, "aging_cap"),
        ({"aging_cap": -1}, "aging_cap"),
        ({"preempt_exempt_s": -1}, "preempt_exempt_s"),
        ({"grace_s": -1}, "grace_s"),
        ({"idle_reclaim_s": -1}, "idle_reclaim_s"),
        ({"idle_reclaim_s": float("nan")}, "idle_reclaim_s"),
        ({"starvation_s": -0.5}, "starvation_s"),
        ({"starvation_s": "600"}, "starvation_s"),
        ({"preempt_patience_s": -1}, "preempt_patience_s"),
        ({"preempt_patience_s": True}, "preempt_patience_s"),
    ],
)
def test_policy_validation_names_the_field(fields: dict[str, Any], name: str) -> None:
    assert _field_of(Policy, **fields) == name


def test_lease_states_that_hold_memory() -> None:
    held = {s for s in LeaseState if s.holds_memory}
    assert held == {LeaseState.LOADING, LeaseState.ACTIVE, LeaseState.REVOKING}
    final = {s for s in LeaseState if s.is_final}
    assert LeaseState.PENDING not in final
    assert held.isdisjoint(final)
    assert len(held | final) == len(LeaseState) - 1


@pytest.mark.parametrize(
    ("metadata", "field"),
    [
        ({"x": math.nan}, "metadata.x"),
        ({"x": [1, -math.inf]}, "metadata.x[1]"),
        (
            {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}},
            "metadata.a.b.c.d.e.f.g.h",
        ),
        ({"s": "\ud800"}, "metadata.s"),
        ({"b": b"bytes"}, "metadata.b"),
        ({"k": {1: 2}}, "metadata.k"),
        ({"big": "x" * 5000}, "metadata"),
        ({f"k{i}": i for i in range(33)}, "metadata"),
    ],
)
def test_metadata_is_a_small_strict_json_object(metadata: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        Request.build("r", vram_mb=1, metadata=metadata)
    assert caught.value.field == field


def test_deep_metadata_is_refused_without_a_recursion_error() -> None:
    deep: dict[str, object] = {}
    for _ in range(100_000):
        deep = {"a": deep}
    with pytest.raises(InvalidInput, match="nested deeper than 8 levels"):
        check_metadata(deep)


@pytest.mark.parametrize("field", ["holder", "idempotency_key"])
@pytest.mark.parametrize("text", ["a\x00b", "a\nb", "\x1b[31m", "a\x7f", "\ud800"])
def test_holders_and_keys_have_no_control_characters(field: str, text: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        Request.build("r", vram_mb=1, **{field: text})
    assert caught.value.field == field
