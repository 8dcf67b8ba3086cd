"""Through the real gateway, controller and agent: a streaming request for a model whose
lease waits behind another model of the gateway names that model in its SSE comment
lines, and when it gives way: a busy one after ``swap_after``, an idle one when the
controller lets this priority reclaim it (``idle_reclaim_s``)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from .conftest import wait_for
from .gateways import chat, model_entry
from .test_gateway import Setup, setup

__all__ = ["setup"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(120)


def _comment_matching(lines: Iterator[str], pattern: str) -> re.Match[str]:
    """The first comment line that matches ``pattern`` (the pytest timeout bounds it)."""
    seen = []
    for line in lines:
        if line.startswith(":"):
            seen.append(line)
            found = re.search(pattern, line)
            if found is not None:
                return found
        elif line:
            raise AssertionError(f"data before the comment {pattern!r}: {line} after {seen}")
    raise AssertionError(f"no comment {pattern!r} in {seen}")


def test_a_busy_model_in_the_way_is_named_with_its_swap_after(setup: Setup) -> None:
    setup.agent()  # one 24 GiB GPU: one of the two 16 GiB models at a time
    models = model_entry("a", setup.record, mb=15000, vram="16G", swap_after="100s")
    models += model_entry("b", setup.record, mb=15000, vram="16G")
    gateway = setup.gateway(models)
    hold = setup.record / "hold"
    busy = chat("a", stream=True, tokens=4, hold=str(hold))
    with (
        gateway.client() as client,
        client.stream("POST", "/v1/chat/completions", json=busy) as a_stream,
    ):
        a_lines = a_stream.iter_lines()
        next(line for line in a_lines if line.startswith("data:"))  # a is busy
        body = chat("b", stream=True)
        with client.stream("POST", "/v1/chat/completions", json=body) as b_stream:
            found = _comment_matching(
                b_stream.iter_lines(),
                r"^: queued, 'a' is busy: swapped after (\d+s|2m) more \(swap_after\); "
                r"position 1: 0/1 GPUs fit: 1 insufficient_vram",
            )
            assert found.group(1) == "2m" or int(found.group(1)[:-1]) <= 100
        hold.write_text("go")
        assert [line for line in a_lines if line][-1] == "data: [DONE]"


def test_an_idle_model_in_the_way_is_named_with_its_reclaim_countdown(setup: Setup) -> None:
    setup.agent()
    models = model_entry("a", setup.record, mb=15000, vram="16G", keep_alive="5m")
    models += model_entry("b", setup.record, mb=15000, vram="16G", priority="batch")
    gateway = setup.gateway(models)
    with gateway.client() as client:
        assert client.post("/v1/chat/completions", json=chat("a")).status_code == 200
        wait_for(lambda: [x["idle"] for x in setup.held("a")] == [True], 30, "a marked idle")
        body = chat("b", stream=True)
        with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            found = _comment_matching(
                stream.iter_lines(),
                r"^: queued, waiting for idle 'a' \(normal\): reclaimable by batch in "
                r"(\d+)s \(idle_reclaim_s\); position 1: ",
            )
    assert 0 < int(found.group(1)) <= 60  # the controller's idle_reclaim_s, counting down
