"""Whether a model's program can be run: its command's first word on the PATH it starts
with (the model's ``env`` PATH, else the gateway's), or, given as a path, an executable
file there; a command run through ``env`` is checked for ``env`` and for the program
``env`` runs (:func:`past_env`). A gateway warns at its start (the program may be
installed later) and refuses a reload that would start a model whose program is not
there (``live.py``)."""

from __future__ import annotations

import os
import shutil

from .servers.config import ModelConfig

__all__ = ["missing_program", "past_env"]


def missing_program(model: ModelConfig) -> str | None:
    """Why ``model``'s command cannot be run, or None when it can."""
    words: tuple[str, ...] | None = tuple(model.command)
    search = model.env.get("PATH", os.environ.get("PATH", os.defpath))
    while words:
        why = _not_found(words[0], search)
        if why is None:
            words, search = past_env(words, search)
            why = None if words != () else "env is given no program to run"
        if why is not None:
            return why
    return None


def _not_found(program: str, search: str) -> str | None:
    if shutil.which(program, path=search) is not None:
        return None
    if os.sep in program:
        return f"{program} is not an executable file"
    return f"{program} is not on PATH: install it, or give its full path"


_ENV_FLAGS = frozenset({"-i", "--ignore-environment", "-", "-0", "--null", "-v", "--debug"})
_ENV_VALUED = frozenset({"-u", "--unset", "-C", "--chdir", "-S", "--split-string"})


def past_env(words: tuple[str, ...], search: str) -> tuple[tuple[str, ...] | None, str]:
    """What a command starting with ``env`` runs, and the PATH it is found on: past
    env's options (``-i``, ``-u NAME``, ``-C DIR``, ``-S STRING``, ``--``) and its
    ``NAME=VALUE`` words (a ``PATH=`` there is the PATH searched; ``-i`` or ``-u PATH``
    leave the system's default). ``()`` when env runs nothing; None when the command is
    not env's, or has an option of env's not read here (nothing more is checked)."""
    if os.path.basename(words[0]) != "env":
        return None, search
    rest, chdir = list(words[1:]), ""
    while rest and rest[0].startswith("-") and rest[0] != "--":
        read = _env_option(rest)
        if read is None:
            return None, search
        option, value = read
        if option in ("-i", "--ignore-environment", "-"):
            search = os.defpath
        elif option in ("-u", "--unset"):
            search = os.defpath if value == "PATH" else search
        elif option in ("-C", "--chdir"):
            chdir = value
        elif option in ("-S", "--split-string"):
            if any(mark in value for mark in "'\"\\$#"):  # env's quoting is not read here
                return None, search
            rest[:0] = value.split()
    if rest and rest[0] == "--":
        rest.pop(0)
    while rest and "=" in rest[0]:
        name, _, value = rest.pop(0).partition("=")
        search = value if name == "PATH" else search
    if rest and chdir and os.sep in rest[0]:
        rest[0] = os.path.join(chdir, rest[0])
    return tuple(rest), search


def _env_option(rest: list[str]) -> tuple[str, str] | None:
    """The option at the head of ``rest`` and its value (taken off ``rest``), or None
    for one not read here (several short ones in one word among them)."""
    word = rest.pop(0)
    if word.startswith("--"):
        option, _, value = word.partition("=")
    else:
        option, value = word[:2], word[2:]
    if option in _ENV_VALUED:
        if not value and rest:
            value = rest.pop(0)
        return (option, value) if value else None
    return (option, "") if option in _ENV_FLAGS and not value else None
