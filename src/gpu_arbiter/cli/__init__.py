"""The ``gpu-arbiter`` command: arguments -> library or client -> rendering. No decisions here."""

from __future__ import annotations

import signal
import sys
from typing import Annotated, Any

import typer
import typer.main

from .agent import agent
from .demo import demo
from .gateway import gateway
from .logs import logs
from .models import MODEL_COMMANDS
from .ops import COMMANDS
from .run import run
from .serve import serve, token_app
from .simulate import simulate
from .top import top

app = typer.Typer(
    name="gpu-arbiter",
    help="The single authority for GPU memory: leases of VRAM, granted safely.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: a flag shows no value placeholder
)
app.command()(demo)
app.command()(simulate)
app.command()(serve)
app.command()(agent)
app.command()(run)
app.command()(gateway)
app.command()(logs)
app.add_typer(token_app, name="token")
for _name, _command in COMMANDS.items():
    app.command(_name)(_command)
for _name, _command in MODEL_COMMANDS.items():
    app.command(_name)(_command)
app.command()(top)


def _print_version(given: bool) -> None:
    if given:
        from .. import __version__

        typer.echo(f"gpu-arbiter {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_print_version, is_eager=True
        ),
    ] = False,
) -> None:
    """The single authority for GPU memory: leases of VRAM, granted safely."""


METAVARS = {
    "controller": "URL[,URL]",
    "ready_url": "URL",
    "advertise_url": "URL",
    "vram": "SIZE",
    "token": "TOKEN",
    "state_dir": "DIR",
    "config": "FILE",
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
    for sub in getattr(command, "commands", {}).values():
        _name_values(sub)


_SERVICES = frozenset({"serve", "agent", "run", "gateway"})
"""Commands that run on: a closed pipe must not end them (their logs say so instead)."""


def main() -> None:
    if not _SERVICES.intersection(sys.argv[1:2]):
        # A report piped into `head` ends quietly when the reader has had enough, as Unix
        # tools do, instead of a traceback from the next write (Python ignores SIGPIPE).
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    command = typer.main.get_command(app)
    _name_values(command)
    command()
