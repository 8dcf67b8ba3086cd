"""A model's file as ``models.toml`` names it (``file = {...}`` in ``[models.NAME]``),
and the gateway's ``models_dir`` and ``disk_budget``, checked here.

::

    [gateway]
    models_dir = "/var/lib/models"     # default: models/ in the gateway's state dir
    disk_budget = "200G"               # model files beyond it that no replica uses are
                                       # removed, least recently used first

    [models.chat]
    file = { name = "qwen-0.5b.gguf", size = 4_100_000_000, sha256 = "...64 hex...",
             url = "https://example.com/qwen-0.5b.gguf" }   # url: optional
    command = "llama-server -m {file} --port {port}"         # {file}: its absolute path

Every error is an :class:`~gpu_arbiter.core.InvalidInput` naming the key
(``models.chat.file.sha256``) and the reason.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ...core import InvalidInput
from ..servers.config import ModelFile

__all__ = ["FILE_KEYS", "ModelFile", "parse_bytes", "parse_model_file", "placed_command"]

FILE_KEYS = frozenset({"name", "size", "sha256", "url"})
MAX_FILE_BYTES = 1 << 50  # a PiB: larger than any model file
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,254}")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:i?B)?", re.IGNORECASE)
_FACTOR = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_model_file(value: Any, where: str) -> ModelFile:
    """``file = { name, size, sha256, url }`` of ``[models.NAME]`` (``where``: its key)."""
    if not isinstance(value, Mapping):
        raise InvalidInput(where, "must be a table: { name, size, sha256, url }")
    unknown = sorted(set(value) - FILE_KEYS)
    if unknown:
        raise InvalidInput(f"{where}.{unknown[0]}", "unknown key; known: name, sha256, size, url")
    for key in ("name", "size", "sha256"):
        if key not in value:
            raise InvalidInput(f"{where}.{key}", "missing")
    return ModelFile(
        name=_file_name(value["name"], f"{where}.name"),
        size=_size(value["size"], f"{where}.size"),
        sha256=_sha256(value["sha256"], f"{where}.sha256"),
        url=None if "url" not in value else _url(value["url"], f"{where}.url"),
    )


def _file_name(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidInput(where, "must be a string: the file's name in models_dir")
    if "/" in value or "\\" in value:
        raise InvalidInput(where, f"{value!r} is a path: give a plain file name, no slashes")
    if value.endswith(".part") or not _FILE_NAME.fullmatch(value):
        raise InvalidInput(
            where, f"{value!r} is not a plain file name (letters, digits and . _ + -, "
            "not starting with a dot, 255 at most, not ending in .part)",
        )  # fmt: skip
    return value


def _size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(where, f"{value!r} is not a whole number of bytes")
    if not 0 < value <= MAX_FILE_BYTES:
        raise InvalidInput(where, f"must be more than 0 bytes (and at most 2**50), not {value}")
    return value


def _sha256(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _SHA256.fullmatch(value.lower()):
        raise InvalidInput(where, "must be 64 hex digits (the file's SHA-256)")
    return value.lower()


def _url(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidInput(where, "must be a string: an http or https URL")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInput(where, f"{value!r} is not an http:// or https:// URL")
    return value


def parse_bytes(value: Any, where: str) -> int:
    """A size on disk: a whole number of bytes, or ``"200G"`` (binary units: K, M, G, T,
    P, with an optional ``iB``/``B``); more than 0."""
    if isinstance(value, bool):
        raise InvalidInput(where, "must be a size such as 200G, not a boolean")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (found := _SIZE.fullmatch(value.strip())):
        size = int(float(found.group(1)) * _FACTOR[found.group(2).upper()])
    else:
        raise InvalidInput(where, f"{value!r} is not a size such as 200G or 500000000 (bytes)")
    if size <= 0:
        raise InvalidInput(where, "must be more than 0 bytes")
    return size


def placed_command(command: tuple[str, ...], path: Path) -> tuple[str, ...]:
    """``command`` with ``{file}`` replaced by the file's absolute path."""
    text = str(path.resolve())
    return tuple(part.replace("{file}", text) for part in command)
