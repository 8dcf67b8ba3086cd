"""Collation with a bound through a real gateway: two models of one gateway that cannot
both fit on the one GPU of a real agent (fake probe), each served by llama.cpp's real
server on a tiny model, A driven by the ``openai`` SDK as a steady stream of requests.
While B waits for a lease, A's requests that keep coming are served first; an equal
priority waits only about ``swap_after``, a lower one for as long as A is busy.

Times come from one clock: the controller stamps leases with the wall clock
(``time.time``) of this same host and the tests stamp their requests with it too, so
"answered while B's lease was pending" is an order, not a speed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from .conftest import events, wait_for
from .gateways import GatewayProcess, metric
from .test_gateway import Setup, setup
from .test_gateway_llama import llama_entry, sdk

__all__ = ["sdk", "setup"]

pytestmark = pytest.mark.timeout(240)

SWAP_AFTER_S = 3.0
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


@dataclass(frozen=True, slots=True)
class Answer:
    """One request of a stream: when it was sent and answered (wall clock), and what went
    wrong, if anything."""

    sent_at: float
    answered_at: float
    error: str | None


class Stream:
    """Requests for one model on ``lanes`` threads, each sending its next request as soon
    as its last was answered, until stopped (several lanes, so that one lane's turnaround
    leaves the model with others in flight; the tests that need it busy without a gap
    also hold one request in flight: :class:`HeldBack`)."""

    def __init__(self, client: openai.OpenAI, model: str, lanes: int = 3) -> None:
        self.client = client
        self.model = model
        self._answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._lane, daemon=True) for _ in range(lanes)]

    def __enter__(self) -> Stream:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(150)
            assert not thread.is_alive(), f"a request for {self.model} never ended"

    def answers(self) -> list[Answer]:
        with self._lock:
            return list(self._answers)

    def count(self) -> int:
        with self._lock:
            return len(self._answers)

    def _lane(self) -> None:
        while not self._stop.is_set():
            sent_at, error = time.time(), None
            try:
                answer = self.client.chat.completions.create(
                    model=self.model, messages=HELLO, max_tokens=32
                )
                if not answer.choices or answer.choices[0].message.content is None:
                    error = f"an empty answer: {answer}"
            except openai.OpenAIError as failed:
                error = f"{type(failed).__name__}: {failed}"
            with self._lock:
                self._answers.append(Answer(sent_at, time.time(), error))


class Background:
    """``call()`` on a thread of its own; ``result()`` joins it and returns what it
    returned (or raises what it raised)."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._call = call
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._call()
        except BaseException as error:  # raised again by result()
            self._error = error

    def result(self, timeout_s: float = 150) -> Any:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the request never ended"
        if self._error is not None:
            raise self._error
        return self._value


def ask_raw(client: openai.OpenAI, model: str) -> Background:
    """One request for ``model`` in the background; its raw answer keeps the headers."""
    return Background(
        lambda: client.chat.completions.with_raw_response.create(
            model=model, messages=HELLO, max_tokens=8
        )
    )


class HeldBack:
    """A request for ``model`` through the gateway's ``/models/NAME/`` prefix whose body
    the client sends in two parts, the second only once let go. The gateway relays such
    a body as it comes, so the request holds its slot (in flight) for as long as the test
    wants, however fast or slow the machine: the model is busy until then."""

    def __init__(self, gateway: GatewayProcess, model: str) -> None:
        self._go = threading.Event()
        body = json.dumps({"model": model, "messages": HELLO, "max_tokens": 8}).encode()
        half = len(body) // 2

        def parts() -> Iterator[bytes]:
            yield body[:half]
            self._go.wait(150)
            yield body[half:]

        url = f"{gateway.url}/models/{model}/v1/chat/completions"
        headers = {"content-type": "application/json", "content-length": str(len(body))}
        self._call = Background(
            lambda: httpx.post(url, content=parts(), headers=headers, timeout=150)
        )

    def let_go(self) -> httpx.Response:
        self._go.set()
        answer: httpx.Response = self._call.result()
        return answer


def stream_lines(gateway: GatewayProcess, model: str, lines: list[str]) -> Background:
    """One streamed request for ``model`` in the background, read with httpx (the SDK
    skips SSE comments): each line appended to ``lines`` as it comes."""
    body = {"model": model, "messages": HELLO, "max_tokens": 8, "stream": True}

    def read() -> int:
        url = gateway.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=150) as answer:
            for line in answer.iter_lines():
                lines.append(line)
            return answer.status_code

    return Background(read)


def leases_of(setup: Setup, model: str) -> list[dict[str, Any]]:
    """Every lease of ``model``'s replicas the controller knows, ended ones included, in
    the order they were asked for."""
    found = [
        lease for lease in setup.admin.get("/v1/leases").json()
        if lease["holder"].startswith(f"gateway {model} ")
    ]  # fmt: skip
    return sorted(found, key=lambda lease: lease["submitted_at"])


def first_lease(setup: Setup, model: str) -> dict[str, Any] | None:
    found = leases_of(setup, model)
    return found[0] if found else None


def granted_lease(setup: Setup, model: str) -> dict[str, Any]:
    """Waits for ``model``'s first lease to be granted; returns it."""

    def granted() -> dict[str, Any] | None:
        lease = first_lease(setup, model)
        return lease if lease is not None and lease["granted_at"] is not None else None

    found: dict[str, Any] = wait_for(granted, 150, f"{model}'s lease granted")
    return found


def lease_events(setup: Setup, *leases: dict[str, Any]) -> list[tuple[str, str]]:
    """The controller's events about these leases, in order: (kind, lease id)."""
    ids = {lease["id"] for lease in leases}
    return [(e["kind"], e["lease_id"]) for e in events(setup.admin) if e.get("lease_id") in ids]


def after(found: list[tuple[str, str]], event: tuple[str, str]) -> list[tuple[str, str]]:
    """The events that came after ``event``."""
    return found[found.index(event) + 1 :]


@dataclass
class Models:
    """A gateway of models A and B on the one GPU of a real agent, with A loaded."""

    setup: Setup
    gateway: GatewayProcess
    client: openai.OpenAI
    a_lease: dict[str, Any]

    def stops(self, model: str, reason: str) -> float | None:
        return metric(
            httpx.get(self.gateway.url + "/metrics").text,
            "gpu_arbiter_gateway_stops_total", model=model, reason=reason,
        )  # fmt: skip

    def hold(self, model: str) -> HeldBack:
        """A request for ``model`` held in flight (see :class:`HeldBack`)."""
        held = HeldBack(self.gateway, model)
        state = self.gateway.model_state
        wait_for(lambda: state(model)["in_flight"] >= 1, 60, f"a request for {model} in flight")
        return held


@pytest.fixture
def models(setup: Setup, sdk: Any, llama_server: Path, tiny_models: Path) -> Callable[..., Models]:
    """``models(a_keys, b_keys)``: A (tiny-chat) and B (tiny-big), 14 GiB each on one
    24 GiB GPU, so that one fits at a time; ``swap_after`` 3 s, ``idle_after`` 1 s."""

    def make(a_keys: dict[str, Any] | None = None, b_keys: dict[str, Any] | None = None) -> Models:
        keys = {"vram": "14G", "idle_after": "1s", "swap_after": f"{SWAP_AFTER_S:g}s"}
        keys |= {"grace": "30s", "keep_alive": "5m", "queue_timeout": "200s"}
        a, _ = llama_entry(
            "a", llama_server, tiny_models / "tiny-chat.gguf", **keys | (a_keys or {})
        )
        b, _ = llama_entry(
            "b", llama_server, tiny_models / "tiny-big.gguf", **keys | (b_keys or {})
        )
        setup.agent("1x24G:sm_86")
        gateway = setup.gateway(a + b)
        client: openai.OpenAI = sdk(gateway)
        assert client.chat.completions.create(model="a", messages=HELLO, max_tokens=4)
        return Models(setup, gateway, client, granted_lease(setup, "a"))

    return make


@dataclass
class Swap:
    """What a swap of A for B showed: the answers of A's stream, of A's request held in
    flight across the swap, B's raw answer, and both leases as the controller has them
    at the end."""

    answers: list[Answer]
    held: httpx.Response
    b_answer: Any
    a_lease: dict[str, Any]
    b_lease: dict[str, Any]


def swap_under_a_stream(found: Models) -> Swap:
    """A keeps a stream of requests going, and one request held in flight, while B's
    request comes; the held one is let go once A's lease is revoked (so it was in flight
    at the swap); ends once B has been served and A has been served again after it."""
    setup = found.setup
    held = found.hold("a")
    with Stream(found.client, "a") as stream:
        wait_for(lambda: stream.count() >= 6, 60, "A's stream under way")
        b = ask_raw(found.client, "b")
        wait_for(
            lambda: a_lease_of(found)["state"] == "revoking", 60,
            "A's lease revoked, kept while a request is in flight",
        )  # fmt: skip
        assert granted_at(setup, "b") is None  # B waits for A's server to be gone (I4)
        held_answer = held.let_go()
        b_lease = granted_lease(setup, "b")
        b_answer = b.result()
        since = stream.count()
        wait_for(lambda: stream.count() > since + 3, 150, "A served again after B")
    return Swap(stream.answers(), held_answer, b_answer, a_lease_of(found), b_lease)


def a_lease_of(found: Models) -> dict[str, Any]:
    """A's first lease as the controller has it now."""
    [lease] = [x for x in leases_of(found.setup, "a") if x["id"] == found.a_lease["id"]]
    return lease


def granted_at(setup: Setup, model: str) -> float | None:
    lease = first_lease(setup, model)
    assert lease is not None, f"no lease of {model}"
    granted: float | None = lease["granted_at"]
    return granted


def test_a_busy_model_is_served_first_then_swapped_once_the_other_waited_swap_after(
    models: Callable[..., Models],
) -> None:
    """A of the same priority as B, kept busy: A's requests are served while B waits,
    until B has waited ``swap_after``; then A's lease is marked idle although busy, the
    controller reclaims it for B, A's request in flight is answered in the grace, and B
    is granted once A's server is gone."""
    found = models()
    swap = swap_under_a_stream(found)
    b_lease, a_lease = swap.b_lease, swap.a_lease
    served = [
        answer for answer in swap.answers
        if b_lease["submitted_at"] < answer.sent_at and answer.answered_at < b_lease["granted_at"]
    ]  # fmt: skip
    assert served  # collation: A's requests that came while B waited were served first
    assert swap.b_answer.parse().choices[0].message.content is not None  # B served at all
    assert float(swap.b_answer.headers["x-queue-seconds"]) >= SWAP_AFTER_S  # the bound
    # the controller says "preempted" of every lease revoked for a request; its idle flag
    # tells a reclaim of a cache from a preemption of busy work
    assert a_lease["ended_at"] is not None and a_lease["revoke_reason"] == "preempted"
    assert a_lease["preempted_for"] == b_lease["id"]
    assert a_lease["idle"] is True  # taken as a cache: marked idle although busy (yielded)
    a_id, b_id = a_lease["id"], b_lease["id"]
    order = after(lease_events(found.setup, a_lease, b_lease), ("lease.requested", b_id))
    assert order[:3] == [("lease.idle", a_id), ("lease.revoked", a_id), ("lease.released", a_id)]
    assert order[3] == ("lease.granted", b_id)  # once A's server was gone (I4)
    assert swap.held.status_code == 200, swap.held.text  # in flight at the swap: the grace
    assert swap.held.json()["choices"][0]["message"]["content"] is not None
    assert [x.error for x in swap.answers if x.error] == []  # none failed, none cut
    assert "reclaimable while busy" in found.gateway.log.read_text()


def test_the_gateway_counts_a_swap_as_a_reclaim_not_a_preemption(
    models: Callable[..., Models],
) -> None:
    found = models()
    swap = swap_under_a_stream(found)
    assert swap.a_lease["idle"] is True  # the controller took it as a cache
    assert found.stops("a", "preempted") is None
    assert found.stops("a", "reclaimed") == 1


def test_a_quiet_model_is_reclaimed_at_once_without_waiting_for_swap_after(
    models: Callable[..., Models],
) -> None:
    """A idle (marked so after ``idle_after``): B takes the GPU through the ordinary
    reclaim. The controller's order shows it: A was marked idle before B asked, and
    nothing about A happened between B's ask and A's revocation (no yield)."""
    found = models()
    setup = found.setup
    a_lease = wait_for(
        lambda: (lease := first_lease(setup, "a")) is not None and lease["idle"] and lease,
        60, "A's lease idle",
    )  # fmt: skip
    answer = ask_raw(found.client, "b").result()
    assert answer.parse().choices[0].message.content is not None
    b_lease = granted_lease(setup, "b")
    a_id, b_id = a_lease["id"], b_lease["id"]
    found_events = lease_events(setup, a_lease, b_lease)
    assert found_events.index(("lease.idle", a_id)) < found_events.index(("lease.requested", b_id))
    assert after(found_events, ("lease.requested", b_id))[:3] == [
        ("lease.revoked", a_id), ("lease.released", a_id), ("lease.granted", b_id),
    ]  # fmt: skip
    assert "reclaimable while busy" not in found.gateway.log.read_text()
    assert found.stops("a", "reclaimed") == 1


def test_a_lower_priority_waits_past_swap_after_until_the_busy_model_is_quiet(
    models: Callable[..., Models],
) -> None:
    """A of higher priority (interactive) than B (normal): the bound holds only for an
    equal or higher priority, so B waits while A is busy, past ``swap_after``, its stream
    kept alive by SSE comments; once A's requests stop, A is quiet ``keep_alive``, stops,
    and B is served."""
    found = models({"priority": "interactive", "keep_alive": "2s"})
    setup = found.setup
    lines: list[str] = []
    held = found.hold("a")  # A busy until let go, however slow its stream's turnaround
    with Stream(found.client, "a") as stream:
        wait_for(lambda: stream.count() >= 6, 60, "A's stream under way")
        b = stream_lines(found.gateway, "b", lines)

        def waited_past_swap_after() -> bool:
            lease = first_lease(setup, "b")
            if lease is None:
                return False
            assert lease["granted_at"] is None, "B granted while A was busy"
            return bool(time.time() - lease["submitted_at"] > 2 * SWAP_AFTER_S)

        wait_for(waited_past_swap_after, 60, "B waiting past swap_after")
        before = stream.count()
        wait_for(lambda: stream.count() > before, 60, "A still served")
        b_lease = first_lease(setup, "b")
        assert b_lease is not None and b_lease["granted_at"] is None
        a_id = found.a_lease["id"]
        meanwhile = after(
            lease_events(setup, found.a_lease, b_lease), ("lease.requested", b_lease["id"])
        )
        assert ("lease.idle", a_id) not in meanwhile  # A never yielded to a lower priority
        assert held.let_go().status_code == 200
    assert [x.error for x in stream.answers() if x.error] == []
    assert b.result() == 200
    assert any(line.startswith(": queued") for line in lines), lines
    assert any(line.startswith(": ready after") for line in lines), lines
    assert "data: [DONE]" in lines, lines[-5:]
    a_lease, b_lease = first_lease(setup, "a"), first_lease(setup, "b")
    assert a_lease is not None and b_lease is not None
    assert a_lease["revoke_reason"] is None  # never yielded, never reclaimed: released
    assert after(lease_events(setup, a_lease, b_lease), ("lease.released", a_lease["id"]))[:2] == [
        ("lease.granted", b_lease["id"]), ("lease.ready", b_lease["id"]),
    ]  # fmt: skip
    assert found.stops("a", "keep_alive") == 1
