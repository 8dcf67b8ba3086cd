"""A cluster load still queued, in words: what a front door's waiting callers read in
their comment lines (``requests/waits.py``) and its ``GET /v1/models`` shows beside the
model's ``queued`` state; the same words ``gpu-arbiter queue -v`` prints for the lease.

From the pending lease as the controller last described it (its long-poll answers as
soon as the lease's reason moves: ``server/cluster.py``): its position, the host nearest
to taking it (the GPU's verdict: need, free, committed, observed), and the controller's
own sentence, which names what is in its way (the lease, its holder and priority) and
when that gives way."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ...client import verdict_text
from ..servers.lease import Lease

__all__ = ["nearest", "queued_words"]


def queued_words(lease: Lease, gateway_on: Callable[[str], str | None]) -> str:
    """'queued for the cluster, position 1; nearest host box-3 (gw-3): box-3:0
    insufficient_vram: need 6.0 GiB, free 2.0 GiB, committed 22.0 GiB, observed 22.0 GiB;
    0/3 GPUs fit: ...; waiting for busy lease L (holder 'train', normal) on box-3:0: not
    preemptible by normal (I5)'. ``gateway_on``: the gateway beside a worker, if known."""
    reason = lease.reason
    message = str(reason.get("message") or reason.get("code") or "waiting")
    place = "" if lease.position is None else f", position {lease.position}"
    found = nearest(reason)
    if found is None:
        return f"queued for the cluster{place}: {message}"
    worker = str(found.get("gpu") or "").partition(":")[0]
    gateway = gateway_on(worker)
    host = f"{worker} ({gateway})" if gateway else worker
    return f"queued for the cluster{place}; nearest host {host}: {verdict_text(found)}; {message}"


def nearest(reason: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The verdict of the GPU a pending request waits for: the one the lease in its way
    holds, else the first verdict (each outcome's GPU nearest to taking it, the nearest
    outcome first); None without verdicts."""
    verdicts = [v for v in reason.get("gpus") or () if isinstance(v, Mapping)]
    blocker = reason.get("blocker")
    held = set(blocker.get("gpus") or ()) if isinstance(blocker, Mapping) else set()
    return next((v for v in verdicts if v.get("gpu") in held), verdicts[0] if verdicts else None)
