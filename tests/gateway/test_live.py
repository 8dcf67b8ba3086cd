"""A running gateway's model set changed through its one entry point
(``LiveModels.apply``), on a virtual clock: a model added is served at once; one removed
finishes its requests in flight and refuses new ones (404 naming the change); a change
to what the server runs replaces the replicas one at a time, never leaving none that
serves; any other change keeps the same process; a set that fails a check changes
nothing; the catalogue is merged under the own file."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.gateway.base.metrics import GatewayMetrics
from gpu_arbiter.gateway.cluster.report import Reporter
from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.files.wiring import placed
from gpu_arbiter.gateway.live import LiveModels, Outcome
from gpu_arbiter.gateway.model_set import Conflict
from gpu_arbiter.gateway.requests.app import GatewayApp
from gpu_arbiter.gateway.servers.config import ModelConfig
from gpu_arbiter.gateway.servers.interfaces import Parts
from gpu_arbiter.gateway.servers.model import ModelServer, Refused
from gpu_arbiter.gateway.servers.replica import EndKind, Replica, ReplicaState

from .fakes import FakeAgent, FakeClock, FakeEngine, FakeHealth, FakeLauncher, FakeLeases, settle
from .test_app_routes import _call
from .test_report import FakeController

pytestmark = pytest.mark.timeout(30)

WHY = "by the reload of models.toml at 12:03:04"
Spec = dict[str, Any]


def spec(command: str = "server", **keys: Any) -> Spec:
    return {"command": [command, "--port", "{port}"], "vram": "1G", **keys}


def configs(models: dict[str, Spec]) -> dict[str, ModelConfig]:
    return dict(parse_config({"models": models}).models)


class Gateway:
    """A gateway's live model set over the fakes: its models' lives run until
    :meth:`close`."""

    def __init__(self, models: dict[str, Spec]) -> None:
        self.clock = FakeClock()
        self.leases = FakeLeases()
        self.launcher = FakeLauncher()
        self.agent = FakeAgent(self.launcher)
        self.health = FakeHealth(self.launcher)
        parts = Parts(
            self.clock, self.launcher, self.agent, self.leases, self.health,
            FakeEngine(self.agent),
        )  # fmt: skip
        metrics = GatewayMetrics()
        servers = {
            name: ModelServer(config, parts=parts, metrics=metrics, worker="box", vram_mb=1024)
            for name, config in configs(models).items()
        }
        self.unsized: dict[str, Exception] = {}  # a model whose size cannot be made
        self.missing: dict[str, str] = {}  # a model whose program is not there
        self.live = LiveModels(
            servers, parts=parts, metrics=metrics, worker="box", size_of=self.size_of,
            program_of=lambda model: self.missing.get(model.name),
        )  # fmt: skip
        self.told = 0
        self.live.changed = self.tell
        self.lives = asyncio.ensure_future(self.live.run())

    def tell(self) -> None:
        self.told += 1

    def size_of(self, model: ModelConfig) -> int:
        if model.name in self.unsized:
            raise self.unsized[model.name]
        return model.vram or 1024

    async def apply(self, models: dict[str, Spec]) -> Outcome:
        outcome = await self.live.apply(configs(models), WHY)
        await settle()
        return outcome

    def model(self, name: str) -> ModelServer:
        return self.live.models[self.live.routes[name]]

    async def request(self, name: str, hold_s: float = 0.0) -> Replica:
        replica, _ = await self.model(name).acquire()
        try:
            if hold_s:
                await self.clock.sleep(hold_s)
        finally:
            replica.leave()
        return replica

    def start(self, name: str, hold_s: float = 0.0) -> asyncio.Task[Replica]:
        return asyncio.ensure_future(self.request(name, hold_s))

    def pids(self, name: str) -> list[int | None]:
        return [r.pid for r in self.live.models[name].replicas]

    async def close(self) -> None:
        self.live.shutdown()
        for _ in range(100):
            if self.lives.done():
                self.lives.result()
                return
            await self.clock.advance(10)
        raise AssertionError("the models' lives did not end")


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    found = Gateway({"chat": spec(aliases=["gpt"])})
    yield found
    await found.close()


async def test_an_added_model_is_served_at_once_and_told(gateway: Gateway) -> None:
    outcome = await gateway.apply({"chat": spec(aliases=["gpt"]), "code": spec("coder")})
    assert outcome.diff.added == ("code",) and outcome.diff.describe() == "added code"
    assert gateway.told == 1
    assert gateway.live.routes == {"chat": "chat", "gpt": "chat", "code": "code"}
    replica = await gateway.request("code")
    assert replica.state is ReplicaState.WARM
    assert gateway.launcher.processes[-1].command[0] == "coder"
    assert gateway.live.models["code"].neighbours is gateway.live.models  # collation


async def test_a_removed_model_finishes_in_flight_and_refuses_new_ones(gateway: Gateway) -> None:
    in_flight = gateway.start("gpt", hold_s=5)
    await gateway.clock.advance(1)
    [replica] = gateway.live.models["chat"].replicas
    removed = gateway.live.models["chat"]
    outcome = await gateway.apply({"code": spec()})
    assert outcome.diff.removed == ("chat",) and outcome.diff.added == ("code",)
    assert "chat" not in gateway.live.models and "gpt" not in gateway.live.routes
    assert gateway.live.removed == {"chat": WHY, "gpt": WHY}
    assert replica.draining and not replica.accepting
    with pytest.raises(Refused) as refused:  # a request that still holds the model
        await removed.acquire()
    assert refused.value.status == 404
    assert refused.value.reason == f"model chat was removed {WHY}"
    await gateway.clock.advance(3)
    assert gateway.launcher.processes[0].signals == []  # its request still runs
    assert not in_flight.done()
    await gateway.clock.advance(1.5)
    assert (await in_flight) is replica  # finished, not cut
    assert replica.ending is not None and replica.ending.kind is EndKind.RETIRED
    assert replica.state is ReplicaState.ENDED and removed.replicas == []
    assert ("release", "L1") in gateway.leases.calls
    assert not gateway.lives.done()  # the gateway's other lives go on
    await gateway.apply({"code": spec(), "chat": spec()})  # back: served again
    assert gateway.live.removed == {"gpt": WHY}
    await gateway.request("chat")


async def test_a_removed_model_refuses_the_requests_waiting_for_it(gateway: Gateway) -> None:
    gateway.leases.grant = False  # its lease stays queued
    waiting = gateway.start("chat")
    await gateway.clock.advance(1)
    await gateway.apply({})
    with pytest.raises(Refused) as refused:
        await waiting
    assert refused.value.status == 404 and WHY in refused.value.reason
    assert gateway.leases.verbs() == ["create", "release"]  # the queued lease given back


async def test_a_change_of_what_the_server_runs_replaces_one_replica_at_a_time() -> None:
    gateway = Gateway({"chat": spec(replicas=2, max_parallel=1, keep_alive="10m")})
    first, second = gateway.start("chat", hold_s=30), gateway.start("chat", hold_s=30)
    await gateway.clock.advance(1)
    model = gateway.live.models["chat"]
    older = list(model.replicas)
    assert [r.state for r in older] == [ReplicaState.BUSY, ReplicaState.BUSY]
    serving: list[int] = []  # at each change of its replicas
    notify = model.notify

    def counted() -> None:
        serving.append(sum(1 for r in model.replicas if r.accepting))
        notify()

    model.notify = counted  # type: ignore[method-assign]
    outcome = await gateway.apply({"chat": spec("server2", replicas=2, max_parallel=1)})
    assert outcome.diff.replaced == ("chat",)
    await gateway.clock.advance(5)
    drains = [r.get("draining", False) for r in model.describe()["replicas"]]
    assert drains == [True, False, False]  # the first older one, its requests in flight
    late = gateway.start("chat", hold_s=1)  # goes to the new generation's replica
    await gateway.clock.advance(55)
    assert len(serving) > 10 and min(serving) == 2  # it had two: never fewer that serve
    assert (await first) is older[0] and (await second) is older[1]  # finished, not cut
    assert (await late).generation == 1
    assert all(r.ending is not None and r.ending.kind is EndKind.RETIRED for r in older)
    assert [r.generation for r in model.replicas] == [1, 1]
    assert [p.command[0] for p in gateway.launcher.processes] == ["server"] * 2 + ["server2"] * 2
    starts = [p for p in gateway.launcher.processes if p.command[0] == "server2"]
    assert all(p.signals == [] for p in starts)
    await gateway.close()


async def test_replacing_starts_the_new_replica_before_the_old_one_stops(gateway: Gateway) -> None:
    await gateway.request("chat")
    [old] = gateway.live.models["chat"].replicas
    moments: list[tuple[int, bool]] = []
    gateway.launcher.on_start = lambda process: moments.append((process.pid, old.live))
    await gateway.apply({"chat": spec(aliases=["gpt"], env={"MODE": "fast"})})
    await gateway.clock.advance(5)
    assert moments == [(101, True)]  # the old one still there when the new one started
    [new] = gateway.live.models["chat"].replicas
    assert new.pid == 101 and new.generation == 1 and not old.live
    assert gateway.launcher.processes[-1].env["MODE"] == "fast"  # type: ignore[attr-defined]


async def test_a_second_change_while_replacing_ends_on_the_last_config(gateway: Gateway) -> None:
    await gateway.request("chat")
    model = gateway.live.models["chat"]
    gateway.health.loaded = False  # a new server loads until told
    await gateway.apply({"chat": spec("second", aliases=["gpt"])})
    await gateway.apply({"chat": spec("third", aliases=["gpt"])})
    assert model.replicas[0].accepting  # the first still serves meanwhile
    assert [r.generation for r in model.replicas] == [0, 1, 2]
    gateway.health.loaded = True
    await gateway.clock.advance(5)
    [replica] = model.replicas
    assert replica.accepting and replica.generation == 2
    assert gateway.launcher.processes[replica.pid - 100].command[0] == "third"
    assert (await gateway.request("chat")) is replica


async def test_a_replacement_that_fails_leaves_the_old_replica_serving(gateway: Gateway) -> None:
    await gateway.request("chat")
    [old] = gateway.live.models["chat"].replicas
    gateway.launcher.missing = True  # the new config's server cannot start
    await gateway.apply({"chat": spec("gone", aliases=["gpt"])})
    await gateway.clock.advance(5)
    assert old.accepting and gateway.live.models["chat"].replicas == [old]
    assert (await gateway.request("chat")) is old


async def test_other_changes_apply_in_place_to_the_same_process(gateway: Gateway) -> None:
    await gateway.request("chat")
    [replica] = gateway.live.models["chat"].replicas
    pid = replica.pid
    changed = spec(
        aliases=["gpt", "gpt-4"], keep_alive="5s", max_parallel=2, priority="interactive"
    )
    outcome = await gateway.apply({"chat": changed})
    assert outcome.diff.in_place == ("chat",) and outcome.diff.replaced == ()
    assert gateway.live.routes["gpt-4"] == "chat"
    assert gateway.pids("chat") == [pid] and gateway.launcher.processes[0].signals == []
    model = gateway.live.models["chat"]
    assert model.config.keep_alive_s == 5 and replica.upstream.keep == 2
    # the lease held keeps the priority it was granted at; the next lease takes the new one
    assert replica.priority == 500 and model.lease_request(2)["priority"] == 800
    assert gateway.leases.verbs().count("create") == 1
    await gateway.clock.advance(6)  # the new keep_alive, from the last request
    assert replica.ending is not None and replica.ending.kind is EndKind.KEEP_ALIVE


async def test_a_pin_in_the_new_config_pins_the_model(gateway: Gateway) -> None:
    await gateway.request("chat")
    await gateway.clock.advance(1)
    assert gateway.leases.verbs()[-1] == "idle"
    await gateway.apply({"chat": spec(aliases=["gpt"], pinned=True)})
    assert gateway.live.models["chat"].pinned and gateway.leases.verbs()[-1] == "busy"


CLASH = {**configs({"a": spec(aliases=["gpt"])}), **configs({"chat": spec(aliases=["gpt"])})}
"""Two models that one name routes to (no file parses so: another source might)."""


@pytest.mark.parametrize(
    ("models", "unsized", "field", "reason"),
    [
        (CLASH, None, "models.chat.aliases", "'gpt' already names a"),
        (configs({"embed": spec()}), None, "models.embed.command", "ghost is not on PATH"),
        (
            configs({"embed": spec(vram="auto")}), OSError("no such file"), "models.embed.vram",
            "cannot be estimated: OSError: no such file",
        ),
        (
            configs({"embed": spec(ctx=8)}), InvalidInput("models.embed.ctx", "too small"),
            "models.embed.ctx", "too small",
        ),
    ],
)  # fmt: skip
async def test_a_set_that_fails_a_check_changes_nothing(
    gateway: Gateway,
    models: dict[str, ModelConfig],
    unsized: Exception | None,
    field: str,
    reason: str,
) -> None:
    await gateway.request("chat")
    if unsized is None:
        gateway.missing["embed"] = "ghost is not on PATH"
    else:
        gateway.unsized["embed"] = unsized
    before = (dict(gateway.live.models), dict(gateway.live.routes), gateway.pids("chat"))
    with pytest.raises(InvalidInput, match=reason) as refused:
        await gateway.live.apply(models, WHY)  # chat removed too: not applied either
    assert refused.value.field == field
    await gateway.clock.advance(1)
    after = (dict(gateway.live.models), dict(gateway.live.routes), gateway.pids("chat"))
    assert after == before and gateway.live.removed == {} and gateway.told == 0
    assert len(gateway.launcher.processes) == 1 and gateway.launcher.processes[0].signals == []


async def test_a_part_that_raises_fails_that_model_and_says_why(gateway: Gateway) -> None:
    def broken(process: Any) -> None:
        if process.command[0] == "broken":
            raise RuntimeError("no driver for this GPU")

    gateway.launcher.on_start = broken
    await gateway.apply({"chat": spec(aliases=["gpt"]), "new": spec("broken")})
    with pytest.raises(Refused) as refused:
        await gateway.request("new")
    assert refused.value.status == 502
    assert "RuntimeError: no driver for this GPU" in refused.value.reason
    assert gateway.live.models["new"].replicas == []  # its lease released, nothing runs
    assert gateway.leases.leases["L1"]["state"] == "released"
    await gateway.request("chat")  # the others serve on
    outcome = await gateway.apply({"chat": spec(aliases=["gpt"])})  # and it can go
    assert outcome.diff.removed == ("new",)


async def test_a_change_that_raises_is_named_and_the_rest_is_made(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    await gateway.request("chat")
    chat = gateway.live.models["chat"]

    def update(config: ModelConfig) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(chat, "update", update)
    outcome = await gateway.apply({"chat": spec(keep_alive="1m"), "code": spec()})
    assert outcome.failed == {"chat": "RuntimeError: a bug"}
    assert (
        outcome.describe()
        == "added code; in place: chat; chat: its change failed (RuntimeError: a bug)"
    )
    # routed as the config it runs (the old one): its alias "gpt" still
    assert gateway.live.routes == {"chat": "chat", "gpt": "chat", "code": "code"}
    assert gateway.live.models["chat"] is chat and chat.replicas[0].accepting
    await gateway.request("code")
    await gateway.request("chat")


async def test_an_ollama_entry_changes_only_at_a_restart() -> None:
    ollama = {"command": ["ollama", "serve", "{port}"], "ollama_models": {"qwen": "3G"}}
    gateway = Gateway({"local": ollama})
    with pytest.raises(InvalidInput, match="only at a restart") as refused:
        await gateway.apply({"local": {**ollama, "ollama_models": {"qwen": "4G"}}})
    assert refused.value.field == "models.local"
    assert (await gateway.apply({"local": ollama, "chat": spec()})).diff.added == ("chat",)
    await gateway.close()


async def test_the_catalogue_is_merged_under_the_own_file(gateway: Gateway) -> None:
    catalogue = configs({"chat": spec("other"), "embed": spec("embedder")})
    outcome = await gateway.live.set_catalogue(catalogue, revision=3)
    assert outcome.diff.added == ("embed",) and outcome.diff.replaced == ()
    assert gateway.live.conflicts == (Conflict("chat", "own file", "catalogue revision 3"),)
    assert outcome.as_json()["conflicts"] == [
        {"model": "chat", "kept": "own file", "over": "catalogue revision 3"}
    ]
    assert gateway.live.models["chat"].config.command[0] == "server"
    await gateway.request("embed")
    outcome = await gateway.live.set_catalogue({}, revision=4)
    assert outcome.diff.removed == ("embed",) and gateway.live.conflicts == ()
    assert gateway.live.removed["embed"] == "by catalogue revision 4"
    own = configs({"code": spec()})  # the own file drops chat: the catalogue's is not kept
    outcome = await gateway.live.set_own(own, "the reload of models.toml at 12:04:00")
    assert (outcome.diff.added, outcome.diff.removed) == (("code",), ("chat",))
    assert gateway.live.removed["chat"] == "by the reload of models.toml at 12:04:00"


async def test_a_catalogue_model_the_own_file_drops_is_served_from_the_catalogue() -> None:
    gateway = Gateway({"chat": spec()})
    await gateway.live.set_catalogue(configs({"chat": spec("other")}), revision=1)
    assert gateway.live.conflicts != ()
    outcome = await gateway.live.set_own({}, "the reload of models.toml at 12:05:00")
    assert outcome.diff.replaced == ("chat",) and gateway.live.conflicts == ()
    await gateway.request("chat")
    assert gateway.launcher.processes[-1].command[0] == "other"
    await gateway.close()


async def test_a_gateway_of_no_model_takes_its_first_from_a_change() -> None:
    gateway = Gateway({})
    assert gateway.live.routes == {} and gateway.live.grace_s() == 10.0
    await gateway.apply({"chat": spec()})
    await gateway.request("chat")
    await gateway.close()


async def test_nothing_is_applied_once_the_gateway_stops(gateway: Gateway) -> None:
    gateway.live.shutdown()
    with pytest.raises(InvalidInput, match="stopping"):
        await gateway.apply({"chat": spec(), "code": spec()})
    assert "code" not in gateway.live.models


async def test_a_request_for_a_removed_model_is_a_404_naming_the_change(gateway: Gateway) -> None:
    app = GatewayApp(gateway.live.models, gateway.live.routes, GatewayMetrics())
    app.removed = gateway.live.removed
    await gateway.apply({"code": spec()})
    body = b'{"model": "gpt"}'
    status, answer = await _call(app, "POST", "/v1/chat/completions", body)
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    assert answer["error"]["message"] == f"model gpt was removed {WHY}; known: code"
    await gateway.apply({})
    status, answer = await _call(app, "POST", "/v1/chat/completions", b'{"model": "x"}')
    assert (status, answer["error"]["message"]) == (
        404, "no model is served here yet: 'x' is not known",
    )  # fmt: skip


async def test_admin_reload_answers_what_changed_or_422_naming_the_field() -> None:
    app = GatewayApp({}, {}, GatewayMetrics())
    status, answer = await _call(app, "POST", "/admin/reload")
    assert status == 404 and "no config file" in answer["error"]["message"]
    outcomes: list[Any] = [
        {"added": ["chat"], "removed": [], "replaced": [], "in_place": []},
        InvalidInput("models.chat.vram", "'7X' is not a size"),
    ]

    async def reload() -> dict[str, Any]:
        found = outcomes.pop(0)
        if isinstance(found, Exception):
            raise found
        return dict(found)

    app.reload = reload
    status, answer = await _call(app, "POST", "/admin/reload")
    assert (status, answer["added"]) == (200, ["chat"])
    status, answer = await _call(app, "POST", "/admin/reload")
    assert status == 422
    assert answer["error"] == {
        "message": "models.chat.vram: '7X' is not a size; nothing changed",
        "type": "invalid_request_error", "code": "invalid_config", "param": "models.chat.vram",
    }  # fmt: skip


async def test_the_reporter_reports_a_new_set_at_once_with_its_conflicts(
    gateway: Gateway,
) -> None:
    controller = FakeController()
    reporter = Reporter(
        controller,  # type: ignore[arg-type]  # the routes it calls
        name="gw-1", url="http://127.0.0.1:8080", host="box", worker="box",
        models=gateway.live.models, administer=lambda *_: asyncio.sleep(0),
        conflicts=lambda: [c.as_json() for c in gateway.live.conflicts], report_s=3600,
        left_out=lambda: [{"model": m, "why": w} for m, w in gateway.live.left_out.items()],
    )  # fmt: skip
    gateway.live.changed = reporter.models_changed
    running = asyncio.ensure_future(reporter.run())
    try:
        first = await controller.next_report()
        assert [m["id"] for m in first["models"]] == ["chat"] and "conflicts" not in first
        assert "left_out" not in first
        catalogue = configs({"chat": spec("other"), "embed": spec()})
        left_out = {"big": "no model file here", "chat": "its own is served"}
        await gateway.live.set_catalogue(catalogue, revision=2, left_out=left_out)
        second = await controller.next_report()  # not after report_s: at once
        assert [m["id"] for m in second["models"]] == ["chat", "embed"]
        assert second["conflicts"] == [
            {"model": "chat", "kept": "own file", "over": "catalogue revision 2"}
        ]
        assert second["left_out"] == [{"model": "big", "why": "no model file here"}]
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def test_changes_from_both_sources_at_once_are_made_one_after_the_other(
    gateway: Gateway,
) -> None:
    await gateway.request("chat")
    own = configs({"chat": spec(aliases=["gpt"], pinned=True), "code": spec()})  # a pin awaits
    catalogue = configs({"embed": spec()})
    await asyncio.gather(
        gateway.live.set_own(own, "the reload of models.toml at 12:06:00"),
        gateway.live.set_catalogue(catalogue, revision=5),
    )
    assert sorted(gateway.live.models) == ["chat", "code", "embed"]  # neither lost
    assert gateway.live.models["chat"].pinned


async def test_an_added_model_of_a_file_is_placed_and_kept_by_the_file_step(
    gateway: Gateway, tmp_path: Path
) -> None:
    """A model naming its ``file`` (``{file}`` in its command) added while the gateway
    runs gets the file's path in ``models_dir`` and the gateway's file step, as one
    there at the start does; the same set again changes nothing (placing twice is
    placing once)."""
    keeper = object()
    gateway.live.files = keeper  # type: ignore[assignment]
    gateway.live.place = lambda found: placed(found, tmp_path)
    file = {"name": "m.gguf", "size": 1024, "sha256": "0" * 64}
    models = {"chat": spec(aliases=["gpt"]), "code": spec("coder", file=file)}
    models["code"]["command"] = ["coder", "-m", "{file}", "--port", "{port}"]
    outcome = await gateway.apply(models)
    assert outcome.diff.added == ("code",)
    code = gateway.live.models["code"]
    assert code.config.command[:3] == ("coder", "-m", str(tmp_path / "m.gguf"))
    assert code.files is keeper
    again = await gateway.apply(models)
    assert again.diff.empty
