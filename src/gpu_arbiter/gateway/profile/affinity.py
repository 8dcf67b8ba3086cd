"""Prefix affinity: a request whose conversation began as an earlier one did goes where
that one went, while it has a free slot (its engine may still hold that prefix's
cache); the ``prefix_affinity`` scorer (``rules.py``) reads where, and the picker's
rendezvous hash (``pick.py``) spreads new prefixes over equal candidates the same way
at every gateway.

A request's **prefix** is a digest of its model and of the start of what it asks: a
chat's messages up to and including its first user message (the system prompt and
the first question: every later turn of that conversation starts with them), else its
``prompt`` or ``input``; at most ``chars`` characters of it. A body that is not JSON,
names none of these, or is larger than :data:`MAX_PARSED_BYTES` has no prefix (it is
routed as without affinity).

:class:`Memory` keeps where each prefix went last, the newest :data:`REMEMBERED`.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_CHARS", "MAX_PARSED_BYTES", "REMEMBERED", "Affinity", "Memory"]

DEFAULT_CHARS = 1024
MAX_PARSED_BYTES = 256 * 1024
"""A larger body is not parsed for its prefix (parsing it would hold the event loop)."""
REMEMBERED = 4096


@dataclass(frozen=True, slots=True)
class Affinity:
    """Prefix affinity on: ``chars`` of a request's start name its prefix."""

    chars: int = DEFAULT_CHARS

    def prefix(self, model: str, body: bytes | bytearray | None) -> str:
        """The prefix of a request for ``model`` with this JSON ``body`` ("": none)."""
        if not body or len(body) > MAX_PARSED_BYTES:
            return ""
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return ""
        text = opening(data)[: self.chars] if isinstance(data, Mapping) else ""
        if not text:
            return ""
        digest = hashlib.blake2b(f"{model}\0{text}".encode(), digest_size=12)
        return digest.hexdigest()


def opening(data: Mapping[str, Any]) -> str:
    """What a request's prefix is taken from: a chat's messages up to its first user
    message, else its ``prompt`` or ``input`` (the first, when a list)."""
    messages = data.get("messages")
    if isinstance(messages, list):
        said: list[str] = []
        for message in messages:
            if not isinstance(message, Mapping):
                break
            role, content = message.get("role"), message.get("content")
            text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
            said.append(f"{role}\0{text}")
            if role == "user":
                break
        return "\n".join(said)
    for key in ("prompt", "input"):
        given = data.get(key)
        if isinstance(given, list) and given:
            given = given[0]
        if isinstance(given, str):
            return given
    return ""


class Memory:
    """Where each prefix went last (a candidate's name), the newest ``size``."""

    def __init__(self, size: int = REMEMBERED) -> None:
        self.size = size
        self._went: OrderedDict[str, str] = OrderedDict()

    def get(self, prefix: str) -> str:
        return self._went.get(prefix, "") if prefix else ""

    def put(self, prefix: str, name: str) -> None:
        if not prefix:
            return
        self._went[prefix] = name
        self._went.move_to_end(prefix)
        if len(self._went) > self.size:
            self._went.popitem(last=False)

    def __len__(self) -> int:
        return len(self._went)
