"""The gateway's Prometheus metrics, on its own registry (``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["GatewayMetrics"]

_SECONDS = (0.005, 0.05, 0.25, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "gpu_arbiter_gateway_requests", "Requests answered, by model and status",
            ["model", "status"], registry=r,
        )  # fmt: skip
        self.queue_seconds = Histogram(
            "gpu_arbiter_gateway_queue_seconds", "Time a request waited for a replica",
            ["model"], buckets=_SECONDS, registry=r,
        )  # fmt: skip
        self.cold_starts = Counter(
            "gpu_arbiter_gateway_cold_starts", "Replicas started (a lease asked for)",
            ["model"], registry=r,
        )  # fmt: skip
        self.load_seconds = Histogram(
            "gpu_arbiter_gateway_load_seconds", "From grant to ready, per start",
            ["model"], buckets=_SECONDS, registry=r,
        )  # fmt: skip
        self.stops = Counter(
            "gpu_arbiter_gateway_stops",
            "Replicas stopped, by reason: keep_alive, reclaimed, preempted, revoked, failed, "
            "shutdown, unloaded",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "gpu_arbiter_gateway_in_flight", "Requests in flight", ["model"], registry=r
        )
        self.body_bytes_held = Gauge(
            "gpu_arbiter_gateway_body_bytes_held",
            "Bytes of request bodies held in memory now (at most max_buffered_bytes)",
            registry=r,
        )
        self.sleeps = Counter(
            "gpu_arbiter_gateway_sleeps", "Replicas put to sleep (sleep_after)", ["model"],
            registry=r,
        )  # fmt: skip
        self.wakes = Counter(
            "gpu_arbiter_gateway_wakes", "Sleeping replicas woken by a request", ["model"],
            registry=r,
        )  # fmt: skip
        self.wake_seconds = Histogram(
            "gpu_arbiter_gateway_wake_seconds",
            "From a request for a sleeping replica to awake (the memory back, the wake)",
            ["model"], buckets=_SECONDS, registry=r,
        )  # fmt: skip
        self.routes = Counter(
            "gpu_arbiter_gateway_routes",
            "Requests routed by this front door, by outcome: local (its own replica), peer "
            "(forwarded to another gateway), load (a cold load for the cluster), none (no "
            "host could take it), retried (a peer refused the connection: routed again)",
            ["model", "outcome"], registry=r,
        )  # fmt: skip
