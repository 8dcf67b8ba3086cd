"""The log setup of serve and agent: formats, and the redaction no line escapes."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from gpu_arbiter.logs import REDACTED, Redactor, say, setup_logging

TOKEN = "gat_Zm9vYmFyYmF6cXV4LXNlY3JldC10b2tlbi12YWx1ZQ"


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """The root logger writes to a string while the test runs, then is put back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield io.StringIO()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def lines(stream: io.StringIO) -> list[dict[str, str]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"Authorization: Bearer {TOKEN}", f"Authorization: Bearer {REDACTED}"),
        ("authorization: bearer not-shaped-like-ours", f"authorization: bearer {REDACTED}"),
        (f"GET /v1/leases/{TOKEN}?x=1", f"GET /v1/leases/{REDACTED}?x=1"),
        (f'{{"token": "{TOKEN}"}}', f'{{"token": "{REDACTED}"}}'),
        ("custom-secret-42 in a message", f"{REDACTED} in a message"),
        ("nothing to hide here", "nothing to hide here"),
    ],
)
def test_redactor_hides_credentials(text: str, expected: str) -> None:
    assert Redactor(("custom-secret-42",)).redact(text) == expected


def test_json_lines_carry_the_fields_and_no_token(stream: io.StringIO) -> None:
    redactor = setup_logging("json", "info", stream=stream)
    redactor.hide("plain-secret")
    logging.getLogger("uvicorn.error").info("header %s and %s", f"Bearer {TOKEN}", "plain-secret")
    try:
        raise RuntimeError(f"failed with {TOKEN}")
    except RuntimeError:
        logging.getLogger("gpu_arbiter.controller").exception("cycle failed")
    first, second = lines(stream)
    assert set(first) == {"ts", "level", "logger", "message"}
    assert first["ts"].endswith("Z")
    assert (first["level"], first["logger"]) == ("INFO", "uvicorn.error")
    assert first["message"] == f"header Bearer {REDACTED} and {REDACTED}"
    assert second["level"] == "ERROR"
    assert "RuntimeError: failed with ***" in second["exception"]
    assert TOKEN not in stream.getvalue()
    assert "plain-secret" not in stream.getvalue()


def test_text_format_and_notices(stream: io.StringIO) -> None:
    setup_logging("text", "warning", stream=stream)
    logging.getLogger("gpu_arbiter.agent").info("below the level: not shown")
    logging.getLogger("gpu_arbiter.agent").warning("controller refused %s", TOKEN)
    say("admin token in /var/lib/gpu-arbiter/admin.token")  # shown at every level
    assert stream.getvalue().splitlines() == [
        f"WARNING gpu_arbiter.agent controller refused {REDACTED}",
        "admin token in /var/lib/gpu-arbiter/admin.token",
    ]


def test_bad_format_or_level_is_refused_by_name(stream: io.StringIO) -> None:
    with pytest.raises(ValueError, match="log format"):
        setup_logging("xml", "info", stream=stream)
    with pytest.raises(ValueError, match="log level"):
        setup_logging("json", "loud", stream=stream)
