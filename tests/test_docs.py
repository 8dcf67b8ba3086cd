"""The documentation holds together: every relative link and anchor in README.md,
docs/*.md, bench/README.md and deploy/README.md resolves, and every command block
marked runnable runs as printed.

A block is marked by an HTML comment, ``<!-- runnable -->``, on the line just before
its ```` ```sh ```` (or ```` ```bash ````) fence. It runs with ``bash -e -o pipefail``
in an empty temporary directory that is also its ``HOME``, with the virtual
environment's ``bin`` (where ``gpu-arbiter`` is) first on ``PATH`` and no
``GPU_ARBITER_*`` or ``XDG_*`` variable set, and must exit 0 within a minute. Mark only
blocks that need no running server, no network and no more than a few seconds.

Anchors follow GitHub's rules: the heading's text in lower case, backticks and every
punctuation character but ``-`` and ``_`` dropped, each space a ``-``; a heading met
again gets ``-1``, ``-2``, ... in its file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "bench" / "README.md",
        ROOT / "deploy" / "README.md",
    ]
)
MARKER = "<!-- runnable -->"

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+).*?\1")
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_NOT_IN_SLUG = re.compile(r"[^\w\- ]")


def _prose(text: str) -> list[tuple[int, str]]:
    """The lines of ``text`` outside fenced code blocks, numbered from 1."""
    lines: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        opened = _FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = heading.strip().lower().replace("`", "")
    return _NOT_IN_SLUG.sub("", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor the headings of the Markdown file at ``path`` make."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in _prose(path.read_text()):
        heading = _HEADING.match(line)
        if heading is None:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def broken_links(path: Path) -> list[str]:
    """Each relative link of ``path`` whose file or anchor does not exist, said as
    ``FILE:LINE: TARGET (why)``."""
    broken: list[str] = []
    for number, line in _prose(path.read_text()):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{_name(path)}:{number}: {target}"
            if not linked.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
                broken.append(f"{where} (no such anchor in {_name(linked)})")
    return broken


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    code: str

    def __str__(self) -> str:
        return f"{_name(self.path)}:{self.line}"


def runnable_blocks(path: Path) -> list[Block]:
    """The command blocks of ``path`` marked runnable: the marker on the line before a
    ```` ```sh ```` or ```` ```bash ```` fence."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    for index, line in enumerate(lines[:-1]):
        if line.strip() != MARKER:
            continue
        fence = lines[index + 1].strip()
        assert fence in ("```sh", "```bash"), (
            f"{_name(path)}:{index + 1}: {MARKER} is not followed by a ```sh or ```bash fence"
        )
        end = next(n for n in range(index + 2, len(lines)) if lines[n].strip() == "```")
        blocks.append(Block(path, index + 3, "\n".join(lines[index + 2 : end]) + "\n"))
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in runnable_blocks(path)]


def test_the_documents_are_there() -> None:
    names = {_name(path) for path in DOCUMENTS}
    assert {"README.md", "bench/README.md", "deploy/README.md"} <= names
    assert BLOCKS, f"no block is marked {MARKER}"


@pytest.mark.parametrize("path", DOCUMENTS, ids=_name)
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_anchors_follow_githubs_rules(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# The controller: `gpu-arbiter serve`\n"
        "## What `POST /v1/leases` answers\n"
        "```sh\n# not a heading\n```\n"
        "## Engines\n## Engines\n### Engines\n"
        "[ok](#engines-2) [broken](#not-a-heading) [gone](other.md)\n"
    )
    assert anchors(page) == {
        "the-controller-gpu-arbiter-serve",
        "what-post-v1leases-answers",
        "engines",
        "engines-1",
        "engines-2",
    }
    assert broken_links(page) == [
        "page.md:9: #not-a-heading (no such anchor in page.md)",
        "page.md:9: other.md (no such file)",
    ]


def _environment(home: Path) -> dict[str, str]:
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("GPU_ARBITER_", "XDG_"))
    }
    bin_dir = Path(sys.executable).parent
    environment.update(
        HOME=str(home), PATH=f"{bin_dir}{os.pathsep}{environment.get('PATH', os.defpath)}"
    )
    return environment


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_runnable_block_runs_as_printed(block: Block, tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.code],
        cwd=tmp_path,
        env=_environment(tmp_path),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, (
        f"{block} exited {done.returncode}\n{block.code}\n"
        f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-2000:]}"
    )
