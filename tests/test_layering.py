"""The core imports nothing outside the core; only the entry point imports server or cli."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gpu_arbiter"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_core_is_self_contained() -> None:
    for path in (PACKAGE / "core").glob("*.py"):
        for name in _imports(path):
            assert not name.startswith(".."), (path.name, name)
            assert not name.startswith("gpu_arbiter"), (path.name, name)


def test_nothing_but_the_cli_imports_server_or_cli() -> None:
    for path in PACKAGE.rglob("*.py"):
        part = path.relative_to(PACKAGE).parts[0]
        if part in ("server", "cli", "__main__.py"):
            continue
        for name in _imports(path):
            assert "server" not in name.split("."), (path, name)
            assert "cli" not in name.split("."), (path, name)


CONTROLLER_MAY_IMPORT = {"..core", "..store", "..fanout"}


def test_controller_modules_import_only_the_core_the_store_and_each_other() -> None:
    """The controller never imports the service around it (server, cli, gateway,
    agent); its modules talk to each other only through the package's own modules."""
    for path in (PACKAGE / "controller").glob("*.py"):
        for name in _imports(path):
            if name.startswith(".."):
                assert name in CONTROLLER_MAY_IMPORT, (path.name, name)
            else:
                assert not name.startswith("gpu_arbiter"), (path.name, name)


def test_only_the_facade_wires_the_controller_together() -> None:
    """Roles and the timer are built and connected in one place, the facade."""
    for path in (PACKAGE / "controller").glob("*.py"):
        if path.name in ("facade.py", "__init__.py"):
            continue
        for name in _imports(path):
            assert name not in (".facade", ".roles"), (path.name, name)
