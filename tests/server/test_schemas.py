"""The API's own serializers: what they write is what the OpenAPI models document."""

from __future__ import annotations

from gpu_arbiter.server import schemas as s
from gpu_arbiter.store import OperationRecord, OperationStep


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
