"""Runs a GPU tool (nvidia-smi, rocm-smi) as an asyncio subprocess: never blocks the loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from dataclasses import dataclass

__all__ = ["ToolError", "ToolResult", "find_tool", "run_tool"]


class ToolError(Exception):
    """The tool could not be run or did not finish; the message is one line for people."""


@dataclass(frozen=True, slots=True)
class ToolResult:
    returncode: int
    stdout: str
    stderr: str

    def status(self) -> str:
        """``status 9: <first line of its complaint>``."""
        return f"status {self.returncode}: {self.first_line()}"

    def first_line(self) -> str:
        """The first non-empty line of stderr, else of stdout: the tool's own complaint."""
        for text in (self.stderr, self.stdout):
            for line in text.splitlines():
                if line.strip():
                    return line.strip()
        return ""


def find_tool(binary: str, path: str | None = None) -> str | None:
    """The absolute path of ``binary`` on ``path`` (default: ``$PATH``), or ``None``."""
    found = shutil.which(binary, path=path if path is not None else os.environ.get("PATH"))
    return os.path.abspath(found) if found else None


async def run_tool(argv: list[str], timeout_s: float) -> ToolResult:
    """Runs ``argv`` to completion; a missing binary, an OS error or a timeout is a
    :class:`ToolError`. The child is killed if it times out or the caller is cancelled."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError:
        raise ToolError(f"{argv[0]}: not found") from None
    except OSError as err:
        raise ToolError(f"{argv[0]}: cannot run: {err.strerror or err}") from None
    try:
        out, err_out = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        raise ToolError(f"{argv[0]}: no answer within {timeout_s:g} s") from None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return ToolResult(
        proc.returncode,
        out.decode("utf-8", errors="replace"),
        err_out.decode("utf-8", errors="replace"),
    )
