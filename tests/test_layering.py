"""The core imports nothing outside the core; only the entry point imports server or cli;
the controller's modules and the gateway's packages import one way."""

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


def _module(path: Path) -> str:
    """The dotted name of the module at ``path`` (a package: its ``__init__.py``)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("gpu_arbiter", *parts[: -1 if parts[-1] == "__init__" else None]))


def _names(path: Path) -> set[str]:
    """What ``path`` imports, anywhere in it (``if TYPE_CHECKING`` blocks and function
    bodies too), as absolute names: ``import M`` is ``M`` and ``from M import N`` is
    ``M.N`` (``from .lease import Lease`` in ``gateway/servers/replica.py`` is
    ``gpu_arbiter.gateway.servers.lease.Lease``)."""
    package = tuple(_module(path).split("."))
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            above = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join((*above, *([node.module] if node.module else [])))
            found.update(f"{module}.{alias.name}" for alias in node.names)
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


GATEWAY = PACKAGE / "gateway"
GATEWAY_LAYERS = ("base", "profile", "servers", "files", "cluster", "requests")
"""The gateway's packages, lowest first: each imports only itself and those before it (a
model server's life knows nothing of the cluster, the cluster nothing of the request
path). The gateway's own modules (``config.py``, ``serve.py``: the whole gateway) may
import all of them, and none of them imports those."""


def _gateway_layer(name: str) -> int | None:
    """Where the gateway's module ``name`` sits: its package's place in
    :data:`GATEWAY_LAYERS`, the gateway's own modules above them all; None for a module
    outside the gateway."""
    parts = name.split(".")
    if parts[:2] != ["gpu_arbiter", "gateway"]:
        return None
    package = parts[2] if len(parts) > 2 else ""
    return GATEWAY_LAYERS.index(package) if package in GATEWAY_LAYERS else len(GATEWAY_LAYERS)


def test_the_gateway_packages_import_downward() -> None:
    for path in GATEWAY.rglob("*.py"):
        own = _gateway_layer(_module(path))
        assert own is not None
        for name in _names(path):
            layer = _gateway_layer(name)
            assert layer is None or layer <= own, (str(path.relative_to(GATEWAY)), name)


def test_the_gateway_has_no_import_circle() -> None:
    """No module of the gateway imports itself through others, not even for type checking
    (``config`` -> ``engines`` -> ``interfaces`` -> ``config`` was one)."""
    modules = {_module(path): path for path in GATEWAY.rglob("*.py")}

    def module_of(name: str) -> str:  # the module that ``name`` is, or is in
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    imports = {
        module: {module_of(name) for name in _names(path) if _gateway_layer(name) is not None}
        for module, path in modules.items()
    }
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path[path.index(module) :], module))
        if module not in done:
            for imported in sorted(imports[module]):
                visit(imported, (*path, module))
            done.add(module)

    for module in sorted(modules):
        visit(module, ())
