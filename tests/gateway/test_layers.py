"""The replica's modules (``gateway/servers/``) import one way: ``model.py`` ->
``replica.py`` -> ``asleep.py``, each lower one typed against what it uses of the one
above (``interfaces.py``'s ``ReplicaOwner`` and ``Sleeper``), never importing it, not even
for type checking. The gateway's packages and its import cycles: ``tests/test_layering.py``."""

from __future__ import annotations

import ast
from pathlib import Path

import gpu_arbiter.gateway.servers as servers

SERVERS = Path(servers.__file__).resolve().parent


def _imported(name: str) -> set[str]:
    """Every module ``gateway/servers/name.py`` imports, anywhere in it (``if
    TYPE_CHECKING`` blocks and function bodies too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse((SERVERS / f"{name}.py").read_text())):
        if isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_a_replica_does_not_import_its_model() -> None:
    imported = _imported("replica")
    assert ".model" not in imported and ".interfaces" in imported
    assert not any(name.endswith("servers.model") for name in imported)


def test_the_asleep_tier_does_not_import_its_replica() -> None:
    imported = _imported("asleep")
    assert not {".replica", ".model"} & imported and ".interfaces" in imported


def test_the_interfaces_import_neither() -> None:
    assert not {".replica", ".model", ".asleep"} & _imported("interfaces")
