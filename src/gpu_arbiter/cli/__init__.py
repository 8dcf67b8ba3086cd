"""The ``gpu-arbiter`` command: arguments -> library or client -> rendering. No decisions here."""

from __future__ import annotations

import typer

from .agent import agent
from .demo import demo
from .gateway import gateway
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
)
app.command()(demo)
app.command()(simulate)
app.command()(serve)
app.command()(agent)
app.command()(run)
app.command()(gateway)
app.add_typer(token_app, name="token")
for _name, _command in COMMANDS.items():
    app.command(_name)(_command)
app.command()(top)


@app.callback()
def _root() -> None:
    """The single authority for GPU memory: leases of VRAM, granted safely."""


def main() -> None:
    app()
