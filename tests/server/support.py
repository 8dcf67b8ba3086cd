"""Shared by the server's unit tests: who holds each gateway name, in a dict (the
controller's ``GatewayNames`` stores them; ``test_gateway_names.py`` uses that one)."""

from __future__ import annotations

from gpu_arbiter.core import NotFound
from gpu_arbiter.store import GatewayNameRecord


class HeldNames:
    """The :class:`~gpu_arbiter.server.gateways.Names` of a registry, in memory."""

    def __init__(self) -> None:
        self.held: dict[str, GatewayNameRecord] = {}

    def get(self, name: str) -> GatewayNameRecord | None:
        return self.held.get(name)

    def __len__(self) -> int:
        return len(self.held)

    def take(self, name: str, owner: str, worker: str | None) -> GatewayNameRecord:
        self.held[name] = GatewayNameRecord(name, owner, worker)
        return self.held[name]

    def forget(self, name: str) -> GatewayNameRecord:
        if name not in self.held:
            raise NotFound(f"no token holds the gateway name {name!r}")
        return self.held.pop(name)
