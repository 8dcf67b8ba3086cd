"""The ``gpu-arbiter`` command: arguments -> library or client -> rendering. No decisions here.

A command's module is imported only when that command is looked up (:class:`Commands`):
``gpu-arbiter serve`` imports the server, never the agent, the gateway or the simulator;
``gpu-arbiter status`` imports the client, never the server. A lazy group rather than
imports inside every command's body: the modules keep their imports at the top, where
typer resolves a command's annotations, and what a command costs is one table away.
``gpu-arbiter --help`` looks up every command, to show its line.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core
import typer.main

SETTINGS: dict[str, Any] = {
    "pretty_exceptions_enable": False,
    "rich_markup_mode": None,  # plain help: a flag shows no value placeholder
}
"""How typer builds the commands: the root's and, one by one, each command's."""

_OPERATORS: tuple[str, ...] = ("status", "queue", "leases", "events", "drain", "cancel-drain")
_OPERATORS += ("update", "operation", "remove", "pause", "resume", "release")  # ops.COMMANDS
_MODELS = ("models", "unload", "pin", "unpin")  # models.MODEL_COMMANDS

DEFINED_IN: dict[str, tuple[str, str]] = {
    "demo": ("demo", "demo"),
    "simulate": ("simulate", "simulate"),
    "serve": ("serve", "serve"),
    "agent": ("agent", "agent"),
    "run": ("run", "run"),
    "gateway": ("gateway", "gateway"),
    "logs": ("logs", "logs"),
    **{name: ("ops", "COMMANDS") for name in _OPERATORS},
    **{name: ("models", "MODEL_COMMANDS") for name in _MODELS},
    "gateways": ("models", "gateways_app"),
    "catalogue": ("catalogue", "catalogue_app"),
    "top": ("top", "top"),
    "token": ("serve", "token_app"),
    "tls": ("tls", "tls_app"),
}
"""Each command, in the order ``--help`` lists them: its module, and the function (or
the typer app of a command group, or a table of functions by command) it is there."""


class Commands(typer.core.TyperGroup):
    """The root group: every command's name, and each command built from its module
    (:data:`DEFINED_IN`) at its first lookup (:class:`BuiltOnLookup`)."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands = BuiltOnLookup()


class BuiltOnLookup(MutableMapping[str, Any]):
    """The root's commands by name, as typer's groups keep them (listed for ``--help``
    and for "did you mean"), each built when it is first looked up. Fixed: the commands
    are those of :data:`DEFINED_IN`."""

    def __init__(self) -> None:
        self._built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            if name not in DEFINED_IN:
                raise KeyError(name)
            self._built[name] = _build(name)
        return self._built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        raise TypeError(f"the root's commands are fixed (add {name!r} to DEFINED_IN)")

    def __delitem__(self, name: str) -> None:
        raise TypeError(f"the root's commands are fixed ({name!r} is one)")

    def __iter__(self) -> Iterator[str]:
        return iter(DEFINED_IN)

    def __len__(self) -> int:
        return len(DEFINED_IN)


def _build(name: str) -> Any:
    """``name``'s click command, built by typer as it builds a registered command."""
    module, attribute = DEFINED_IN[name]
    found = getattr(importlib.import_module(f".{module}", __name__), attribute)
    one = typer.Typer(**SETTINGS)
    if isinstance(found, typer.Typer):
        one.add_typer(found, name=name)
    else:
        one.command(name)(found[name] if isinstance(found, dict) else found)
    command = typer.main.get_group(one).commands[name]
    _name_values(command)
    return command


app = typer.Typer(
    name="gpu-arbiter",
    help="The single authority for GPU memory: leases of VRAM, granted safely.",
    no_args_is_help=True,
    cls=Commands,
    **SETTINGS,
)


def _print_version(given: bool) -> None:
    if given:
        from .. import __version__

        typer.echo(f"gpu-arbiter {__version__}")
        raise typer.Exit()


TLS_HELP = (
    "The cluster's CA: https controllers are verified against it (default: the system's).",
    "A client certificate, for a controller that asks for one (mutual TLS).",
    "The client certificate's key.",
)


def _tls_file(flag: str, envvar: str, text: str) -> Any:
    """A root option naming a PEM file; given, it stands for its variable (``envvar``)
    for the command after it, and any process that command starts."""
    return typer.Option(
        flag, envvar=envvar, help=text, exists=True, dir_okay=False, metavar="FILE",
        show_default=False,
    )  # fmt: skip


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_print_version, is_eager=True
        ),
    ] = False,
    ca: Annotated[Path | None, _tls_file("--ca", "GPU_ARBITER_CA", TLS_HELP[0])] = None,
    client_cert: Annotated[
        Path | None, _tls_file("--client-cert", "GPU_ARBITER_CLIENT_CERT", TLS_HELP[1])
    ] = None,
    client_key: Annotated[
        Path | None, _tls_file("--client-key", "GPU_ARBITER_CLIENT_KEY", TLS_HELP[2])
    ] = None,
) -> None:
    """The single authority for GPU memory: leases of VRAM, granted safely."""
    given = {"GPU_ARBITER_CA": ca, "GPU_ARBITER_CLIENT_CERT": client_cert}
    given["GPU_ARBITER_CLIENT_KEY"] = client_key
    for variable, path in given.items():  # every command's client reads them (tls.py)
        if path is not None:
            os.environ[variable] = str(path.absolute())


METAVARS = {
    "controller": "URL[,URL]",
    "ready_url": "URL",
    "advertise_url": "URL",
    "vram": "SIZE",
    "token": "TOKEN",
    "state_dir": "DIR",
    "config": "FILE",
    **dict.fromkeys(("tls_cert", "tls_key", "tls_client_ca"), "FILE"),
    "version_file": "FILE",
    "simulate": "SPEC",
    "port": "PORT",
    "host": "ADDRESS",
    "gateway": "URL[,URL]",
    "key": "KEY",
}
"""What an option's value is, in its --help line, where its name does not say it."""


def _metavar(param: Any) -> str:
    name = param.name or ""
    described = param.type_descriptor
    if name in METAVARS:
        return METAVARS[name]
    if described.is_choice:
        return "|".join(str(getattr(c, "value", c)) for c in described.choices or ())
    if described.annotation is float:
        return "S"  # every float option is a number of seconds
    if described.annotation is int:
        return "MIB" if name.endswith("_mb") else "N"
    return name.upper()


def _name_values(command: Any) -> None:
    """Every option that takes a value shows a word for it (``--vram SIZE``, ``--ttl S``),
    not its Python type; a plain flag shows none."""
    for param in command.params:
        is_option = param.param_type_name == "option"
        if is_option and param.metavar is None and not getattr(param, "is_flag", False):
            param.metavar = _metavar(param)
    if not isinstance(command, Commands):  # the root's are named as they are built
        for sub in getattr(command, "commands", {}).values():
            _name_values(sub)


_SERVICES = frozenset({"serve", "agent", "run", "gateway"})
"""Commands that run on: a closed pipe must not end them (their logs say so instead)."""


def main() -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Ignored by whoever started us (a launcher, a shell's background job): SIG_IGN is
        # inherited across exec, so Ctrl-C would stop no command, nor any child one starts
        # (run's command, the gateway's model servers, the agent's update command). A
        # handler, unlike SIG_IGN, is reset to the default in every child at its exec.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not _SERVICES.intersection(sys.argv[1:2]):
        # A report piped into `head` ends quietly when the reader has had enough, as Unix
        # tools do, instead of a traceback from the next write (Python ignores SIGPIPE).
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    command = typer.main.get_command(app)
    _name_values(command)
    command()
