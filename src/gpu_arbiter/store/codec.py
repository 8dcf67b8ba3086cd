"""Records <-> JSON documents (plain dicts), the one encoding every store keeps.

The store's documents, not the API's: the API builds its own JSON (``lease_out``,
``constraints_out``, ``event_out`` in the server's schemas), so that what is kept and
what is shown can change apart.

:func:`dumps` writes a document as strict JSON text: a value JSON cannot hold
(NaN, a lone surrogate, a non-text key) raises ``ValueError``/``TypeError`` here,
before anything is written, and the controller's commit rule undoes the change.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

from ..core import Constraints, Gpu, GpuId, Lease, LeaseState, Request, WorkerStatus
from .records import Event, LeaseRecord, OperationRecord, OperationStep, WorkerRecord

__all__ = [
    "DOCUMENT_FORMAT",
    "constraints_to_doc",
    "dumps",
    "event_from_doc",
    "event_to_doc",
    "lease_from_doc",
    "lease_to_doc",
    "operation_from_doc",
    "operation_to_doc",
    "worker_from_doc",
    "worker_to_doc",
]


def dumps(doc: dict[str, Any]) -> str:
    """``doc`` as compact, strict JSON text, UTF-8 encodable."""
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    text.encode()  # a lone surrogate fails here, not when a reader decodes it
    return text


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def constraints_to_doc(c: Constraints) -> dict[str, Any]:
    return {
        "vendor": c.vendor,
        "min_compute_capability": list(c.min_compute_capability)
        if c.min_compute_capability
        else None,
        "gpu_arch": list(c.gpu_arch),
        "gpu_model": c.gpu_model,
        "worker": c.worker,
        "labels": dict(c.labels),
        "gpu_ids": [str(g) for g in c.gpu_ids],
        "never_preempt": list(c.never_preempt),
        "workers": list(c.workers),
        "prefer_workers": list(c.prefer_workers),
    }


_ANYWHERE = Constraints()


def _constraints_from_doc(doc: dict[str, Any]) -> Constraints:
    if not any(doc.values()):  # most requests: every field at its (falsy) default
        return _ANYWHERE
    cc = doc.get("min_compute_capability")
    return Constraints(
        vendor=doc.get("vendor"),
        min_compute_capability=(int(cc[0]), int(cc[1])) if cc else None,
        gpu_arch=tuple(doc.get("gpu_arch") or ()),
        gpu_model=doc.get("gpu_model"),
        worker=doc.get("worker"),
        labels=tuple(sorted((doc.get("labels") or {}).items())),
        gpu_ids=tuple(_gpu_id(text) for text in doc.get("gpu_ids") or ()),  # absent: older
        never_preempt=tuple(str(text) for text in doc.get("never_preempt") or ()),
        workers=tuple(str(text) for text in doc.get("workers") or ()),  # absent: older
        prefer_workers=tuple(str(text) for text in doc.get("prefer_workers") or ()),
    )


DOCUMENT_FORMAT = 1
"""The format of the documents this code writes; it reads this one and every earlier one.

- 0: a lease's document has every field.
- 1: a lease's document leaves out each field whose value is the one its reader assumes
  when the field is absent: most fields of most leases (a lease's document is about half
  as long, and a restart decodes it in about 40 % less time). A document of format 0
  reads the same.

A store records the format it was written in and refuses to open one written in a newer
format than :data:`DOCUMENT_FORMAT` (code older than format 1 does not check: it fails
on a document of format 1)."""

# The defaults are the format's, written here once (the writer leaves them out, the reader
# puts them back), not the dataclasses': a later default of Request or Lease must not
# change what a stored document means.

_REQUEST_DEFAULTS: dict[str, Any] = {
    "gpus": 1,
    "priority": 500,
    "preemptible": True,
    "constraints": {},
    "holder": "",
    "metadata": {},
    "ttl_s": 30.0,
    "max_wait_s": None,
    "load_timeout_s": 300.0,
    "idempotency_key": None,
    "seq": 0,
    "submitted_at": 0.0,
}
_GRANT_DEFAULTS: dict[str, Any] = {
    "expires_at": None,  # no expiry (math.inf)
    "idle": False,
    "last_used_at": 0.0,
    "loading": True,
    "revoke_reason": None,
    "preempted_for": None,
    "ended_at": None,
    "revoked_at": None,
    "supervised": False,
    "shrunk_to_mb": None,
    "claimed": True,  # absent in documents older than the field: taken up (the safe side)
}
_LEASE_DEFAULTS: dict[str, Any] = {
    "owner": None,
    "lease": None,
    "ended_at": None,
    "end_reason": None,
}
_CONSTRAINT_DEFAULTS: dict[str, Any] = {
    "vendor": None,
    "min_compute_capability": None,
    "gpu_arch": [],
    "gpu_model": None,
    "worker": None,
    "labels": {},
    "gpu_ids": [],
    "never_preempt": [],
    "workers": [],
    "prefer_workers": [],
}


def _without_defaults(doc: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``doc`` without the fields whose value is their default (of the same type: a
    ``1`` is not left out for a default ``True``)."""
    return {
        key: value
        for key, value in doc.items()
        if key not in defaults
        or value != (default := defaults[key])
        or type(value) is not type(default)
    }


def request_to_doc(r: Request) -> dict[str, Any]:
    return _without_defaults(
        {
            "id": r.id,
            "vram_mb": r.vram_mb,
            "gpus": r.gpus,
            "priority": r.priority,
            "preemptible": r.preemptible,
            "constraints": _without_defaults(
                constraints_to_doc(r.constraints), _CONSTRAINT_DEFAULTS
            ),
            "holder": r.holder,
            "metadata": dict(r.metadata),
            "ttl_s": r.ttl_s,
            "max_wait_s": r.max_wait_s,
            "load_timeout_s": r.load_timeout_s,
            "idempotency_key": r.idempotency_key,
            "seq": r.seq,
            "submitted_at": r.submitted_at,
        },
        _REQUEST_DEFAULTS,
    )


def request_from_doc(doc: dict[str, Any]) -> Request:
    get, default = doc.get, _REQUEST_DEFAULTS
    return Request(
        id=doc["id"],
        vram_mb=doc["vram_mb"],
        gpus=get("gpus", default["gpus"]),
        priority=get("priority", default["priority"]),
        preemptible=get("preemptible", default["preemptible"]),
        constraints=_constraints_from_doc(get("constraints") or {}),
        holder=get("holder", default["holder"]),
        metadata=get("metadata") or {},  # a new dict each: the default is not shared
        ttl_s=get("ttl_s", default["ttl_s"]),
        max_wait_s=get("max_wait_s", default["max_wait_s"]),
        load_timeout_s=get("load_timeout_s", default["load_timeout_s"]),
        idempotency_key=get("idempotency_key", default["idempotency_key"]),
        seq=get("seq", default["seq"]),
        submitted_at=get("submitted_at", default["submitted_at"]),
    )


def _grant_to_doc(lease: Lease) -> dict[str, Any]:
    return _without_defaults(
        {
            "gpus": [str(g) for g in lease.gpus],
            "token": lease.token,
            "state": str(lease.state),
            "granted_at": lease.granted_at,
            "expires_at": _finite(lease.expires_at),
            "load_deadline": lease.load_deadline,
            "idle": lease.idle,
            "last_used_at": lease.last_used_at,
            "loading": lease.loading,
            "revoke_reason": lease.revoke_reason,
            "preempted_for": lease.preempted_for,
            "ended_at": lease.ended_at,
            "revoked_at": lease.revoked_at,
            "supervised": lease.supervised,
            "shrunk_to_mb": lease.shrunk_to_mb,
            "claimed": lease.claimed,
        },
        _GRANT_DEFAULTS,
    )


def _grant_from_doc(request: Request, doc: dict[str, Any]) -> Lease:
    get, default = doc.get, _GRANT_DEFAULTS
    expires = get("expires_at", default["expires_at"])
    return Lease(
        request=request,
        gpus=tuple(_gpu_id(text) for text in doc["gpus"]),
        token=doc["token"],
        state=_STATES[doc["state"]],
        granted_at=doc["granted_at"],
        expires_at=math.inf if expires is None else expires,
        load_deadline=doc["load_deadline"],
        idle=get("idle", default["idle"]),
        last_used_at=get("last_used_at", default["last_used_at"]),
        loading=get("loading", default["loading"]),
        revoke_reason=get("revoke_reason", default["revoke_reason"]),
        preempted_for=get("preempted_for", default["preempted_for"]),
        ended_at=get("ended_at", default["ended_at"]),
        revoked_at=get("revoked_at", default["revoked_at"]),
        supervised=get("supervised", default["supervised"]),
        shrunk_to_mb=get("shrunk_to_mb", default["shrunk_to_mb"]),
        claimed=get("claimed", default["claimed"]),
    )


_STATES = {str(state): state for state in LeaseState}


@functools.lru_cache(maxsize=4096)
def _gpu_id(text: str) -> GpuId:
    """One GpuId per text (a store holds thousands of leases on a few GPUs)."""
    worker, index = text.split(":")
    return GpuId(worker, int(index))


def lease_to_doc(record: LeaseRecord) -> dict[str, Any]:
    return _without_defaults(
        {
            "request": request_to_doc(record.request),
            "state": str(record.state),
            "owner": record.owner,
            "lease": None if record.lease is None else _grant_to_doc(record.lease),
            "ended_at": record.ended_at,
            "end_reason": record.end_reason,
        },
        _LEASE_DEFAULTS,
    )


def lease_from_doc(doc: dict[str, Any]) -> LeaseRecord:
    request = request_from_doc(doc["request"])
    get, default = doc.get, _LEASE_DEFAULTS
    grant = get("lease", default["lease"])
    return LeaseRecord(
        request=request,
        state=_STATES[doc["state"]],
        owner=get("owner", default["owner"]),
        lease=None if grant is None else _grant_from_doc(request, grant),
        ended_at=get("ended_at", default["ended_at"]),
        end_reason=get("end_reason", default["end_reason"]),
    )


def _gpu_to_doc(gpu: Gpu) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "total_mb": gpu.total_mb,
        "arch": gpu.arch,
        "vendor": gpu.vendor,
        "model": gpu.model,
        "uuid": gpu.uuid,
        "headroom_mb": gpu.headroom_mb,
    }


def worker_to_doc(record: WorkerRecord) -> dict[str, Any]:
    return {
        "name": record.name,
        "status": str(record.status),
        "gpus": [_gpu_to_doc(g) for g in record.gpus],
        "labels": dict(record.labels),
        "url": record.url,
        "agent_version": record.agent_version,
        "registered_at": record.registered_at,
        "drain_deadline": record.drain_deadline,
        "status_after_offline": str(record.status_after_offline),
        "simulated": record.simulated,
        "simulated_gpus": record.simulated_gpus,
    }


def worker_from_doc(doc: dict[str, Any]) -> WorkerRecord:
    name = doc["name"]
    return WorkerRecord(
        name=name,
        status=WorkerStatus(doc["status"]),
        gpus=tuple(Gpu(worker=name, **g) for g in doc["gpus"]),
        labels=doc["labels"],
        url=doc["url"],
        agent_version=doc["agent_version"],
        registered_at=doc["registered_at"],
        drain_deadline=doc["drain_deadline"],
        status_after_offline=WorkerStatus(doc["status_after_offline"]),
        simulated=doc["simulated"],
        simulated_gpus=doc.get("simulated_gpus", False),  # absent from older stores
    )


def event_to_doc(event: Event) -> dict[str, Any]:
    return {
        "seq": event.seq,
        "at": event.at,
        "kind": event.kind,
        "lease_id": event.lease_id,
        "worker": event.worker,
        "data": dict(event.data),
    }


def event_from_doc(doc: dict[str, Any]) -> Event:
    return Event(
        seq=doc["seq"],
        at=doc["at"],
        kind=doc["kind"],
        lease_id=doc["lease_id"],
        worker=doc["worker"],
        data=doc["data"],
    )


def operation_to_doc(op: OperationRecord) -> dict[str, Any]:
    return {
        "id": op.id,
        "kind": op.kind,
        "worker": op.worker,
        "state": op.state,
        "created_at": op.created_at,
        "steps": [
            {"name": s.name, "outcome": s.outcome, "at": s.at, "detail": s.detail} for s in op.steps
        ],
        "reason": op.reason,
        "from_version": op.from_version,
        "to_version": op.to_version,
        "deadline": op.deadline,
    }


def operation_from_doc(doc: dict[str, Any]) -> OperationRecord:
    return OperationRecord(
        id=doc["id"],
        kind=doc["kind"],
        worker=doc["worker"],
        state=doc["state"],
        created_at=doc["created_at"],
        steps=tuple(OperationStep(**step) for step in doc.get("steps", [])),
        reason=doc.get("reason"),
        from_version=doc.get("from_version", ""),
        to_version=doc.get("to_version"),
        deadline=doc.get("deadline"),
    )
