"""A model set as a value: what a change does to each model (``diff``), the own file and
the catalogue merged (``merge``), and the listener settings a reload cannot change."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from hypothesis import assume, given
from hypothesis import strategies as st

from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.model_set import (
    IN_PLACE_KEYS,
    LEASE_KEYS,
    SERVER_KEYS,
    Conflict,
    diff,
    listener_changes,
    merge,
)
from gpu_arbiter.gateway.servers.config import ModelConfig, ModelFile

COMMAND = "server --port {port}"


def model(name: str, **keys: Any) -> ModelConfig:
    spec = {"command": COMMAND, "vram": "1G", **keys}
    return parse_config({"models": {name: spec}}).models[name]


CHANGES: dict[str, Any] = {
    "command": ("other", "--port", "{port}"),
    "model_file": "/m.gguf",
    "file": ModelFile("m.gguf", 1024, "0" * 64),
    "vram": 2048,
    "gpus": 2,
    "engine": "vllm",
    "env": {"A": "1"},
    "ctx": 4096,
    "ready": "/ready",
    "ollama_serve": "local",
    "priority": 800,
    "preemptible": False,
    "keep_alive_s": 5.0,
    "aliases": ("x",),
    "max_parallel": 8,
    "replicas": 3,
    "replicas_min": 2,
    "queue_timeout_s": 7.0,
    "load_timeout_s": 9.0,
    "grace_s": 1.0,
    "idle_after_s": 2.0,
    "ttl_s": 10.0,
    "pinned": True,
    "min_resident_s": 3.0,
    "swap_after_s": 4.0,
    "sleep_after_s": 1.0,
    "sleep_level": 2,
}
"""A different value for every key of a model but its name."""


def test_every_key_of_a_model_is_of_one_kind() -> None:
    keys = {f.name for f in fields(ModelConfig)} - {"name"}
    assert keys == set(CHANGES)
    assert keys == SERVER_KEYS | LEASE_KEYS | IN_PLACE_KEYS
    assert not SERVER_KEYS & LEASE_KEYS and not SERVER_KEYS & IN_PLACE_KEYS
    assert not LEASE_KEYS & IN_PLACE_KEYS


def test_what_the_server_runs_replaces_anything_else_is_in_place() -> None:
    old = {"chat": model("chat")}
    for key, value in CHANGES.items():
        changed = diff(old, {"chat": replace(old["chat"], **{key: value})})
        if key in SERVER_KEYS:
            assert changed.replaced == ("chat",), key
        else:
            assert changed.in_place == ("chat",), key  # priority too: the next lease's
        assert not changed.added and not changed.removed and not changed.unchanged


def test_added_removed_and_unchanged() -> None:
    old = {"a": model("a"), "b": model("b")}
    new = {"b": model("b"), "c": model("c")}
    changed = diff(old, new)
    assert (changed.added, changed.removed, changed.unchanged) == (("c",), ("a",), ("b",))
    assert changed.describe() == "added c; removed a"
    assert diff(old, old).empty and diff(old, old).describe() == "no model changed"
    assert diff({}, {}).empty


NAMES = st.sampled_from(["a", "b", "c", "d"])
KEYS = st.sampled_from(sorted(CHANGES))
ALIASES = st.sampled_from(["a", "b", "c", "d", "x", "y"])


@st.composite
def model_sets(draw: st.DrawFn) -> dict[str, ModelConfig]:
    found = {}
    for name in draw(st.sets(NAMES)):
        keys = draw(st.sets(KEYS, max_size=3))
        changes = {key: CHANGES[key] for key in keys}
        if "aliases" in keys:  # names of other models, or new ones
            changes["aliases"] = tuple(sorted(draw(st.sets(ALIASES, min_size=1)) - {name}))
        found[name] = replace(model(name), **changes)
    return found


def routes_once(models: dict[str, ModelConfig]) -> bool:
    """Whether each name or alias routes to one model (what a parsed file holds)."""
    names = [alias for name, found in models.items() for alias in {name, *found.aliases}]
    return len(names) == len(set(names))


@given(model_sets(), model_sets())
def test_each_name_is_in_exactly_one_part(
    old: dict[str, ModelConfig], new: dict[str, ModelConfig]
) -> None:
    changed = diff(old, new)
    parts = [changed.added, changed.removed, changed.replaced, changed.in_place]
    parts.append(changed.unchanged)
    names = [name for part in parts for name in part]
    assert sorted(names) == sorted(set(old) | set(new))
    assert all(list(part) == sorted(part) for part in parts)
    for name in changed.unchanged:
        assert old[name] == new[name]
    assert diff(new, new).empty
    back = diff(new, old)  # undone: the same models, added and removed swapped
    assert (back.added, back.removed) == (changed.removed, changed.added)
    assert (back.replaced, back.in_place) == (changed.replaced, changed.in_place)


def test_the_own_file_wins_a_name_or_an_alias_and_the_clash_is_kept() -> None:
    own = {"chat": model("chat", aliases=["gpt"]), "code": model("code")}
    catalogue = {
        "chat": model("chat", keep_alive="1m"),  # the name
        "gpt-4": model("gpt-4", aliases=["gpt"]),  # an alias of an own model
        "embed": model("embed"),
        "fast": model("fast", aliases=["code"]),  # an alias that is an own name
    }
    merged = merge(own, catalogue, "catalogue revision 3")
    assert sorted(merged.models) == ["chat", "code", "embed"]
    assert merged.models["chat"] is own["chat"]
    assert merged.conflicts == (
        Conflict("chat", "own file", "catalogue revision 3"),
        Conflict("fast", "own file", "catalogue revision 3"),
        Conflict("gpt-4", "own file", "catalogue revision 3"),
    )
    assert merged.conflicts[0].as_json() == {
        "model": "chat",
        "kept": "own file",
        "over": "catalogue revision 3",
    }
    assert merge(own, {}, "catalogue revision 1").conflicts == ()


@given(model_sets(), model_sets())
def test_a_merged_set_routes_each_name_to_one_model(
    own: dict[str, ModelConfig], catalogue: dict[str, ModelConfig]
) -> None:
    assume(routes_once(own))
    merged = merge(own, catalogue, "catalogue revision 1")
    for name, found in own.items():
        assert merged.models[name] is found
    seen: dict[str, str] = {}
    for name, found in merged.models.items():
        for alias in {name, *found.aliases}:
            assert seen.setdefault(alias, name) == name
    clashed = {c.model for c in merged.conflicts}
    assert clashed == {name for name in catalogue if merged.models.get(name) is not catalogue[name]}


def test_the_listener_settings_a_reload_cannot_change_are_named() -> None:
    old = parse_config({"gateway": {"port": 9000}, "models": {"a": {"command": COMMAND}}})
    same = parse_config({"gateway": {"port": 9000}})
    assert listener_changes(old, same) == ()  # the models are not the listener's
    new = parse_config(
        {"gateway": {"port": 9001, "api_keys": ["k-0123456789"], "prefix_affinity": True}}
    )
    assert listener_changes(old, new) == (
        "gateway.api_keys",
        "gateway.port",
        "gateway.prefix_affinity",
    )
