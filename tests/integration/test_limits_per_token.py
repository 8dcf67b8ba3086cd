"""One client token cannot lock the others out: pending requests, event streams and
long-polls are limited per token (whatever holder names it uses), each refusal is a 429
naming the limit with Retry-After, and refusals are counted in /metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Server, wait_for


@pytest.fixture
def limited(start_server: Callable[..., Server]) -> Server:
    """One 1 GiB GPU (so that requests for more than it has free stay pending), and
    small per-token limits."""
    return start_server(
        "--simulate",
        "1x1G",
        "--max-pending-per-token",
        "3",
        "--max-streams-per-token",
        "2",
        "--max-long-polls-per-token",
        "1",
    )


@pytest.fixture
def two_clients(limited: Server) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    with limited.client(limited.token("client")) as a, limited.client(limited.token("client")) as b:
        yield a, b


def refused_for(answer: httpx.Response, limit: str, value: int) -> None:
    assert answer.status_code == 429, answer.text
    error = answer.json()["error"]
    assert error["code"] == "too_many_requests"
    assert error["details"] == {"limit": limit, "value": value, "current": value}
    assert int(answer.headers["retry-after"]) > 0


def refusals(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {
        sample.labels["limit"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gpu_arbiter_refusals_total"
    }


def test_pending_requests_are_limited_per_token_whatever_the_holder(
    two_clients: tuple[httpx.Client, httpx.Client],
) -> None:
    a, b = two_clients
    first = a.post("/v1/leases", json={"vram_mb": 600, "holder": "h0"})
    assert first.status_code == 201  # holds 600 of the 1024 MiB
    for i in range(1, 4):  # three more, each with its own holder name: all pending
        answer = a.post("/v1/leases", json={"vram_mb": 600, "holder": f"h{i}"})
        assert answer.status_code == 202, answer.text
    refused_for(
        a.post("/v1/leases", json={"vram_mb": 600, "holder": "h4"}), "max_pending_per_token", 3
    )
    assert b.post("/v1/leases", json={"vram_mb": 600, "holder": "h0"}).status_code == 202
    assert refusals(b)["max_pending_per_token"] == 1


def test_event_streams_are_limited_per_token(
    two_clients: tuple[httpx.Client, httpx.Client],
) -> None:
    a, b = two_clients
    with ExitStack() as open_streams:
        for _ in range(2):
            stream = open_streams.enter_context(a.stream("GET", "/v1/events"))
            assert stream.status_code == 200
        refused_for(a.get("/v1/events"), "max_streams_per_token", 2)
        with b.stream("GET", "/v1/events") as other:
            assert other.status_code == 200
    # the streams a closed are given back (the server sees them go)
    wait_for(lambda: _opens(a), 10, "a stream slot to be given back")
    assert refusals(b)["max_streams_per_token"] >= 1


def _opens(client: httpx.Client) -> bool:
    with client.stream("GET", "/v1/events") as stream:
        return stream.status_code == 200


def test_long_polls_are_limited_per_token(
    two_clients: tuple[httpx.Client, httpx.Client], limited: Server
) -> None:
    a, b = two_clients
    held = a.post("/v1/leases", json={"vram_mb": 600}).json()
    waiting = a.post("/v1/leases", json={"vram_mb": 600}).json()
    assert waiting["state"] == "pending"
    answers: list[httpx.Response] = []

    def long_poll() -> None:
        """Holds the token's one long-poll; it retries while the main thread's probe holds
        it (the probe and this poll may meet in either order)."""
        with limited.client(a.headers["authorization"].split()[1]) as same_token:
            deadline = time.monotonic() + 20
            while True:
                answer = same_token.get(f"/v1/leases/{waiting['id']}", params={"wait": 30})
                if answer.status_code != 429 or time.monotonic() > deadline:
                    break
            answers.append(answer)

    poller = threading.Thread(target=long_poll)
    poller.start()
    url = f"/v1/leases/{waiting['id']}"
    wait_for(lambda: a.get(url, params={"wait": 0.01}).status_code == 429, 10, "the first to wait")
    refused_for(a.get(url, params={"wait": 5}), "max_long_polls_per_token", 1)
    assert b.get(url, params={"wait": 0.05}).status_code == 200  # another token may
    assert a.get(url).status_code == 200  # a plain read is not a long-poll
    assert a.delete(f"/v1/leases/{held['id']}").status_code == 200
    poller.join(timeout=30)
    assert answers[0].status_code == 200
    assert answers[0].json()["state"] != "pending"
    assert refusals(b)["max_long_polls_per_token"] >= 2
