"""``gpu-arbiter logs MODEL``: a model server's output, as the gateway keeps it.

Each model's servers write to ``STATE/gateway/logs/MODEL.log`` (rotated to ``.1``; see
``gateway/servers/process.py``); this prints its last lines, from the rotated file too when
``--lines`` reaches back that far, and with ``--follow`` what is written after them
(through rotations) until Ctrl-C. Exit codes: 0; 1 when the model has no log (the
message names the models that have one); 130 interrupted while following.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Annotated, BinaryIO

import typer

from ..gateway.servers.interfaces import log_path
from ..paths import STATE_DIR_ENV, default_state_dir

EXIT_NO_LOG = 1
EXIT_INTERRUPTED = 130
FOLLOW_POLL_S = 0.25


def logs(
    model: Annotated[
        str, typer.Argument(metavar="MODEL", help="The model, as the models file names it.")
    ],
    lines: Annotated[
        int, typer.Option("--lines", "-n", min=0, help="How many of the last lines (default 50).")
    ] = 50,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Then print what is written, until Ctrl-C.")
    ] = False,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            envvar=STATE_DIR_ENV,
            show_default=False,
            help="The gateway's state directory (default $XDG_STATE_HOME/gpu-arbiter).",
        ),
    ] = None,
) -> None:
    """Print a model server's output (stdout and stderr), as the gateway keeps it."""
    directory = (state_dir or default_state_dir()).expanduser()
    folder = log_path(directory, "any").parent  # every model's log is in it
    known = sorted(p.name[: -len(".log")] for p in folder.glob("*.log"))
    if model not in known:  # only those: a name is never taken for a path
        others = f"models with logs: {', '.join(known)}" if known else f"none in {folder}"
        typer.echo(f"gpu-arbiter logs: no log of model {model} ({others})", err=True)
        raise typer.Exit(EXIT_NO_LOG)
    path = log_path(directory, model)
    with path.open("rb") as file:  # what follows is read on from where this ends
        _write(b"".join(last_lines(file, path, lines)))
        if follow:
            try:
                _follow(path, file)
            except KeyboardInterrupt:
                raise typer.Exit(EXIT_INTERRUPTED) from None


def last_lines(file: BinaryIO, path: Path, count: int) -> list[bytes]:
    """The last ``count`` lines of the log (``file``, open on ``path``, read to its
    end), the rotated file's before its own."""
    found = file.read().splitlines(keepends=True)
    if len(found) < count:
        with contextlib.suppress(FileNotFoundError):
            rotated = path.with_name(path.name + ".1").read_bytes()
            found = rotated.splitlines(keepends=True) + found
    return found[-count:] if count else []


def _follow(path: Path, file: BinaryIO) -> None:
    """Prints what is appended to ``file`` from where it is; when the file is rotated,
    the rest of the old one, then the new one from its start."""
    try:
        while True:
            data = file.read()
            if data:
                _write(data)
                continue
            try:
                rotated = os.stat(path).st_ino != os.fstat(file.fileno()).st_ino
            except FileNotFoundError:
                rotated = False  # between the rename and the new file
            if rotated:
                _write(file.read())
                file.close()
                file = path.open("rb")
                continue
            time.sleep(FOLLOW_POLL_S)
    finally:
        file.close()


def _write(data: bytes) -> None:
    """As the server wrote it (a character cut between two reads stays whole)."""
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
