"""Logging of the long-running commands (``serve``, ``agent``): one setup, two formats.

    text   ``LEVEL logger message`` (the default: a terminal, journald)
    json   one object per line: ``ts`` (UTC, ISO 8601), ``level``, ``logger``,
           ``message`` and, when there is one, ``exception``

Every record, uvicorn's included, goes through one handler on the root logger,
and a :class:`Redactor` on that handler rewrites it before it is formatted: a
bearer credential (``Bearer ...``), anything shaped like a token of this service
(``gat_...``) and every secret the process knows (``Redactor.hide``) become
``***`` in the message, its arguments and the exception text. So no log line can
carry a token, whoever logged it.

Notices for the operator (where the admin token file is, which probe the agent
uses) go through :func:`say`: a bare line in the text format, an object in JSON.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime
from typing import TextIO

__all__ = [
    "LOG_FORMATS",
    "LOG_LEVELS",
    "REDACTED",
    "JsonFormatter",
    "Redactor",
    "TextFormatter",
    "say",
    "setup_logging",
]

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
REDACTED = "***"
NOTICE = "gpu_arbiter.notice"

_CREDENTIAL = re.compile(r"(?i)\b(bearer\s+)[^\s\"',;]+|\bgat_[A-Za-z0-9_\-]+")


class Redactor(logging.Filter):
    """Replaces credentials in a record by ``***``; never drops a record."""

    def __init__(self, secrets: tuple[str, ...] = ()) -> None:
        super().__init__()
        self._secrets: set[str] = set()
        for secret in secrets:
            self.hide(secret)

    def hide(self, secret: str | None) -> None:
        """``secret`` (a token this process holds) never appears in a log line."""
        if secret and secret.strip():
            self._secrets.add(secret.strip())

    def redact(self, text: str) -> str:
        for secret in sorted(self._secrets, key=len, reverse=True):
            text = text.replace(secret, REDACTED)
        return _CREDENTIAL.sub(lambda m: (m.group(1) or "") + REDACTED, text)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: keep the raw parts, redacted
            message = f"{record.msg} {record.args}"
        record.msg, record.args = self.redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True


class TextFormatter(logging.Formatter):
    """``LEVEL logger message``; a notice is its bare message."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if record.name == NOTICE:
            return record.getMessage()
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message (+ exception, stack)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        entry: dict[str, str] = {
            "ts": ts.replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(
    log_format: str = "text", level: str = "info", *, stream: TextIO | None = None
) -> Redactor:
    """Sends every logger (uvicorn's too) to one handler on ``stream`` (stderr) in
    ``log_format``; returns the handler's redactor, to hide the secrets found later."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    redactor = Redactor()
    handler.addFilter(redactor)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger(NOTICE).setLevel(logging.INFO)  # shown at every --log-level
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
    return redactor


def say(text: str) -> None:
    """A notice for the operator, through the logging setup once there is one."""
    if not logging.getLogger().handlers:
        print(text, file=sys.stderr, flush=True)
        return
    logging.getLogger(NOTICE).info(text)
