"""The gateway's lease: the controller's JSON made a value in one place."""

from __future__ import annotations

import dataclasses

import pytest

from gpu_arbiter.gateway.servers.lease import Lease

PENDING = {
    "id": "L7", "state": "pending", "gpus": [], "worker": None, "token": None,
    "vram_mb": 8192, "priority": 500, "metadata": {"model": "chat", "replica": 2},
    "ttl_s": 30.0, "submitted_at": 12.5, "ended_at": None, "end_reason": None,
    "revoke_reason": None, "preempted_for": None, "idle": False, "holder": "gateway chat #2",
    "position": 3, "reason": {"code": "insufficient_vram", "message": "0/1 GPUs fit"},
}  # fmt: skip


def test_a_pending_lease_reads_its_wait_and_has_no_place_yet() -> None:
    lease = Lease.of(PENDING)
    assert (lease.id, lease.state, lease.worker, lease.gpus) == ("L7", "pending", None, ())
    assert lease.pending and not lease.held and lease.token is None
    assert lease.pending_text() == "position 3: 0/1 GPUs fit"
    assert lease.metadata["replica"] == 2 and lease.submitted_at == 12.5


def test_a_granted_lease_has_its_worker_gpus_and_token() -> None:
    found = {**PENDING, "state": "active", "worker": "box", "gpus": ["box:0", "box:1"]}
    found.update(token=41, position=None, reason=None, idle=True)
    lease = Lease.of(found)
    assert lease.held and not lease.pending and lease.idle
    assert (lease.worker, lease.gpus, lease.token, lease.vram_mb) == (
        "box", ("box:0", "box:1"), 41, 8192,
    )  # fmt: skip
    assert lease.reason == {} and lease.pending_text() == "waiting"


def test_a_lease_is_a_value_not_the_json_it_came_from() -> None:
    found = {**PENDING, "metadata": {"model": "chat"}}
    lease = Lease.of(found)
    found["metadata"]["model"] = "other"  # the JSON changed afterwards: the lease did not
    assert lease.metadata["model"] == "chat"
    with pytest.raises(dataclasses.FrozenInstanceError):
        lease.state = "active"  # type: ignore[misc]
    with pytest.raises(TypeError):
        lease.metadata["model"] = "other"  # type: ignore[index]


def test_an_answer_without_an_id_or_state_is_no_lease() -> None:
    with pytest.raises(KeyError, match="state"):
        Lease.of({"id": "L1"})
