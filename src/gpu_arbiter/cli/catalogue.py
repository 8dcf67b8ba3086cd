"""``gpu-arbiter catalogue``: the cluster's catalogue at the controller, declared once.

    catalogue apply FILE        sends FILE's text to the controller (an admin's): the new
                                revision, or "unchanged"; a refused catalogue is one line,
                                FILE:LINE: FIELD: REASON
    catalogue show              the current revision's models and where each may run
                                (--text: its text; --revision N: that revision)
    catalogue history           every revision, newest first
    catalogue diff FILE         the current revision against FILE: a unified diff, then
                                the models FILE would add, remove and change

Arguments -> the client (``GET``/``PUT /v1/catalogue``...) -> rendering; the controller
checks and stores. ``show --revision`` and ``diff`` read a catalogue's text with the
gateway's own parser (``gateway/catalogue.py``), as the controller does.

Exit codes: 0 done (``diff``: no difference); 1 the controller refused, or (``diff``)
FILE differs from the current revision, as diff(1); 2 bad arguments, a file that cannot
be read (``diff``: or read as a catalogue); 69 no controller answered.
"""

from __future__ import annotations

import difflib
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.table import Table

from ..client import ApiError, ArbiterClient
from ..gateway.catalogue import CatalogueError, describe, parse_catalogue
from .ops import (
    EXIT_API_ERROR,
    Controller,
    Output,
    OutputOpt,
    Token,
    call_controller,
    option,
    stdout_console,
)

__all__ = ["catalogue_app", "changed_models", "models_table"]

Json = dict[str, Any]
EXIT_DIFFERS = 1
EXIT_TROUBLE = 2

catalogue_app = typer.Typer(
    help="The cluster's catalogue: the models declared once, at the controller.",
    no_args_is_help=True,
)
FileArg = Annotated[
    Path,
    typer.Argument(metavar="FILE", help="A catalogue: [models.NAME] tables, TOML."),
]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        why = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        _fail(f"cannot read {path}: {why}", EXIT_TROUBLE)


def _fail(message: str, code: int) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


@catalogue_app.command("apply")
def apply(
    file: FileArg,
    controller: Controller = None,
    token: Token = None,
    output: OutputOpt = Output.human,
) -> None:
    """Apply FILE as the cluster's catalogue (an admin's): a new revision, or unchanged."""
    text = _read(file)

    async def send(client: ArbiterClient) -> Json:
        try:
            return await client.apply_catalogue(text, str(file))
        except ApiError as error:
            if error.status == 422 and "field" in error.details:
                return {"refused": str(error), **error.details}
            raise

    answer = call_controller(controller, token, send)
    if output is Output.json:
        print(_dumps(answer))
    elif "refused" not in answer:
        sha = str(answer["sha256"])[:12]
        if answer["outcome"] == "unchanged":
            print(f"unchanged: revision {answer['revision']} already holds {file} ({sha})")
        else:
            print(f"catalogue revision {answer['revision']} applied from {file} ({sha})")
    if "refused" in answer:
        if output is not Output.json:
            print(f"error: {answer['refused']}", file=sys.stderr)
        raise typer.Exit(EXIT_API_ERROR)


@catalogue_app.command("show")
def show(
    revision: Annotated[
        int | None, option("This revision (default: the current one).", "--revision", min=1)
    ] = None,
    text: Annotated[bool, option("Print the catalogue's text as it was applied.")] = False,
    controller: Controller = None,
    token: Token = None,
    output: OutputOpt = Output.human,
) -> None:
    """The catalogue's models and where each may run (or its text)."""

    async def fetch(client: ArbiterClient) -> Json | None:
        if revision is None:
            return await client.catalogue()
        return await client.catalogue_revision(revision)

    found = call_controller(controller, token, fetch)
    if found is None:
        _fail("no catalogue was ever applied: gpu-arbiter catalogue apply FILE", EXIT_API_ERROR)
    if "models" not in found:  # a revision's answer has its text only: read it here
        found["models"] = _models_of(str(found["text"]), str(found["file"]))
    if output is Output.json:
        print(_dumps(found))
    elif text:
        sys.stdout.write(str(found["text"]))
    else:
        console = stdout_console()
        console.print(_heading(found))
        console.print(models_table(found["models"] or {}))


@catalogue_app.command("history")
def history(
    controller: Controller = None, token: Token = None, output: OutputOpt = Output.human
) -> None:
    """Every revision of the catalogue, newest first."""
    revisions = call_controller(controller, token, lambda client: client.catalogue_history())
    if output is Output.json:
        print(_dumps(revisions))
        return
    if not revisions:
        print("no catalogue was ever applied")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("REVISION", "APPLIED", "BY", "FILE", "SIZE", "SHA256"):
        table.add_column(column)
    for r in revisions:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(r["applied_at"])))
        table.add_row(
            str(r["revision"]), at, str(r["applied_by"]), str(r["file"]),
            f"{r['size_bytes']} B", str(r["sha256"])[:12],
        )  # fmt: skip
    stdout_console().print(table)


@catalogue_app.command("diff")
def diff(
    file: FileArg,
    controller: Controller = None,
    token: Token = None,
) -> None:
    """FILE against the current revision: a unified diff, then the models it would add,
    remove and change. Exit 0: the same; 1: they differ."""
    new_text = _read(file)
    try:
        new = describe(parse_catalogue(new_text, str(file)))
    except CatalogueError as error:
        _fail(str(error), EXIT_TROUBLE)
    current = call_controller(controller, token, lambda client: client.catalogue())
    old_text = "" if current is None else str(current["text"])
    old = {} if current is None else (current.get("models") or {})
    label = "no catalogue" if current is None else f"revision {current['revision']}"
    if old_text == new_text:
        print(f"{file} is the current catalogue ({label})")
        return
    lines = difflib.unified_diff(
        old_text.splitlines(keepends=True), new_text.splitlines(keepends=True),
        fromfile=label, tofile=str(file),
    )  # fmt: skip
    sys.stdout.writelines(line if line.endswith("\n") else line + "\n" for line in lines)
    added, removed, changed = changed_models(old, new)
    print()
    for word, names in (("added", added), ("removed", removed), ("changed", changed)):
        print(f"models {word}: {', '.join(names) or 'none'}")
    raise typer.Exit(EXIT_DIFFERS)


# ---------------------------------------------------------------- rendering


def changed_models(
    old: dict[str, Json], new: dict[str, Json]
) -> tuple[list[str], list[str], list[str]]:
    """The models ``new`` adds, removes and changes (by name, sorted), of two
    catalogues' models as ``describe`` gives them."""
    added = sorted(new.keys() - old.keys())
    removed = sorted(old.keys() - new.keys())
    changed = sorted(name for name in old.keys() & new.keys() if old[name] != new[name])
    return added, removed, changed


def models_table(models: dict[str, Json]) -> Table:
    """One row a model: its size, GPUs, priority, and where it may run."""
    table = Table(box=None, pad_edge=False)
    for column in ("MODEL", "VRAM", "GPUS", "PRIORITY", "WHERE"):
        table.add_column(column)
    for name, model in sorted(models.items()):
        table.add_row(
            name, str(model["vram"]), str(model["gpus"]), str(model["priority"]), _where(model)
        )
    return table


def _where(model: Json) -> str:
    """Where a model may run, in words: ``box-1, box-3; zone=a; gpu_model *A100*``."""
    parts = [", ".join(model["hosts"]) if model["hosts"] else "any host"]
    parts += [f"{k}={v}" for k, v in sorted(model["labels"].items())]
    for key in ("vendor", "gpu_model", "min_compute_capability"):
        if model.get(key):
            parts.append(f"{key} {model[key]}")
    if model.get("gpu_arch"):
        parts.append("gpu_arch " + "|".join(model["gpu_arch"]))
    return "; ".join(parts)


def _heading(found: Json) -> str:
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(found["applied_at"])))
    return (
        f"catalogue revision {found['revision']} (from {found['file']}, applied {at} by "
        f"{found['applied_by']}, sha256 {str(found['sha256'])[:12]})"
    )


def _models_of(text: str, file: str) -> dict[str, Json] | None:
    try:
        return describe(parse_catalogue(text, file))
    except CatalogueError:
        return None


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True)
