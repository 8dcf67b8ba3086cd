"""The API's own serializers: what they write is what the OpenAPI models document."""

from __future__ import annotations

import ast
from pathlib import Path

from gpu_arbiter.core import Constraints
from gpu_arbiter.server import schemas as s
from gpu_arbiter.store import Event, OperationRecord, OperationStep


def _update() -> OperationRecord:
    return OperationRecord(
        id="op-1",
        kind="update",
        worker="box-1",
        state="failed",
        created_at=100.0,
        steps=(
            OperationStep("drain", "started", 100.0, "graceful drain (was online)"),
            OperationStep("drain", "ok", 101.5, "no lease left"),
            OperationStep("update_command", "failed", 103.0, "exit 2"),
        ),
        reason="update_command failed: exit 2",
        from_version="1.0",
        deadline=3700.0,
    )


def test_an_operation_is_written_field_by_field_as_the_api_documents_it() -> None:
    out = s.operation_out(_update())
    assert out == {
        "id": "op-1",
        "kind": "update",
        "worker": "box-1",
        "state": "failed",
        "created_at": 100.0,
        "steps": [
            {
                "name": "drain",
                "outcome": "started",
                "at": 100.0,
                "detail": "graceful drain (was online)",
            },
            {"name": "drain", "outcome": "ok", "at": 101.5, "detail": "no lease left"},
            {"name": "update_command", "outcome": "failed", "at": 103.0, "detail": "exit 2"},
        ],
        "reason": "update_command failed: exit 2",
        "from_version": "1.0",
        "to_version": None,
        "deadline": 3700.0,
    }
    assert set(out) == set(s.OperationOut.model_fields)
    assert set(out["steps"][0]) == set(s.OperationStepOut.model_fields)
    assert s.OperationOut.model_validate(out).model_dump() == out


def test_constraints_are_written_field_by_field_with_the_capability_as_text() -> None:
    built = Constraints.build(
        vendor="nvidia",
        min_compute_capability="8.6",
        gpu_arch=["sm_89", "sm_86"],
        gpu_model="*4090*",
        worker="box-1",
        labels={"zone": "a", "rack": "3"},
        gpu_ids=["box-1:1"],
        never_preempt=["lease-1"],
        workers=["box-2", "box-1"],
        prefer_workers=["box-1"],
    )
    assert s.constraints_out(built) == {
        "vendor": "nvidia",
        "min_compute_capability": "8.6",
        "gpu_arch": ["sm_86", "sm_89"],
        "gpu_model": "*4090*",
        "worker": "box-1",
        "labels": {"rack": "3", "zone": "a"},
        "gpu_ids": ["box-1:1"],
        "never_preempt": ["lease-1"],
        "workers": ["box-1", "box-2"],
        "prefer_workers": ["box-1"],
    }
    anywhere = s.constraints_out(Constraints())
    assert anywhere["min_compute_capability"] is None
    assert anywhere["labels"] == {} and anywhere["gpu_ids"] == []
    assert list(anywhere) == list(s.constraints_out(built))  # every field, always


def test_an_event_is_written_field_by_field_and_shares_nothing_with_the_record() -> None:
    data = {"reason": "expired", "gpus": ["box-1:0"]}
    event = Event(7, 1_000.5, "lease.expired", "lease-1", "box-1", data)
    out = s.event_out(event)
    assert out == {
        "seq": 7,
        "at": 1_000.5,
        "kind": "lease.expired",
        "lease_id": "lease-1",
        "worker": "box-1",
        "data": {"reason": "expired", "gpus": ["box-1:0"]},
    }
    out["data"]["reason"] = "changed"
    assert event.data["reason"] == "expired"
    assert s.event_out(Event(8, 1.0, "arbiter.paused", None, None, {}))["lease_id"] is None


def test_the_api_builds_its_json_without_the_stores_encoding() -> None:
    tree = ast.parse(Path(s.__file__).read_text())
    imported = [
        node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    ]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if "codec" in m], imported
