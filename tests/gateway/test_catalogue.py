"""The cluster's catalogue: parsed whole or refused naming file, line and field; the
share of one worker, property-tested."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_arbiter.core import Constraints, Gpu
from gpu_arbiter.gateway.catalogue import (
    Catalogue,
    CatalogueError,
    Entry,
    describe,
    line_of,
    parse_catalogue,
    share,
)
from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.servers.config import ModelConfig

GOOD = """\
# the cluster's models
[models.chat]
command = "llama-server -m /models/qwen.gguf -c 8192 --port {port}"
vram = "6G"
hosts = ["box-1", "box-3"]
labels = { zone = "a" }
aliases = ["gpt-4o-mini"]

[models."qwen2.5"]
command = ["vllm", "serve", "Qwen/Qwen2.5-7B", "--port", "{port}"]
vram = "20G"
gpu_model = "*A100*"
min_compute_capability = "8.0"

[models.local]
command = ["env", "OLLAMA_HOST=127.0.0.1:{port}", "ollama", "serve"]
vendor = "nvidia"
[models.local.ollama_models]
"llama3.2:3b" = "3G"
"""


def refused(text: str, file: str = "catalogue.toml") -> CatalogueError:
    with pytest.raises(CatalogueError) as caught:
        parse_catalogue(text, file)
    return caught.value


def test_a_catalogue_is_parsed_with_where_each_model_may_run() -> None:
    catalogue = parse_catalogue(GOOD)
    assert sorted(catalogue.entries) == ["chat", "llama3.2:3b", "qwen2.5"]
    chat = catalogue.entries["chat"]
    assert chat.model.vram == 6144 and chat.model.aliases == ("gpt-4o-mini",)
    assert chat.hosts == ("box-1", "box-3")
    assert chat.constraints.labels == (("zone", "a"),)
    qwen = catalogue.entries["qwen2.5"].constraints
    assert qwen.gpu_model == "*A100*" and qwen.min_compute_capability == (8, 0)
    ollama = catalogue.entries["llama3.2:3b"]
    assert ollama.model.ollama_serve == "local" and ollama.constraints.vendor == "nvidia"
    described = describe(catalogue)
    assert described["chat"]["hosts"] == ["box-1", "box-3"]
    assert described["qwen2.5"]["min_compute_capability"] == "8.0"


def test_the_model_tables_are_read_as_a_gateways_own_are() -> None:
    """One parser of model tables: a catalogue's model is what models.toml makes of it."""
    table = '[models.chat]\ncommand = "llama-server -m /m.gguf --port {port}"\nvram = "6G"\n'
    own = parse_config(__import__("tomllib").loads(table)).models["chat"]
    assert parse_catalogue(table + 'hosts = ["box-1"]\n').entries["chat"].model == own


def test_an_empty_catalogue_has_no_models() -> None:
    assert parse_catalogue("# nothing yet\n").entries == {}


@pytest.mark.parametrize(
    ("text", "line", "field", "reason"),
    [
        pytest.param(GOOD.replace('"20G"', '"6X"'), 11, "models.qwen2.5.vram", "is not a size",
                     id="bad-size"),
        pytest.param(GOOD.replace('vram = "6G"', 'colour = "red"'), 4, "models.chat.colour",
                     "unknown key", id="unknown-key"),
        pytest.param('[gateway]\nport = 8080\n\n[models.a]\ncommand = "x {port}"\n', 1,
                     "gateway", "not in a catalogue", id="gateway-table"),
        pytest.param(GOOD.replace('vram = "20G"', 'vram = "20G"\naliases = ["gpt-4o-mini"]'),
                     12, "models.qwen2.5.aliases", "already names chat", id="duplicate-alias"),
        pytest.param(GOOD.replace('"box-1", "box-3"', '"box-1", "Box 3"'), 5,
                     "models.chat.hosts", "is not a worker name", id="bad-host"),
        pytest.param(GOOD.replace('"box-1", "box-3"', '"box-1", "BOX-1"'), 5,
                     "models.chat.hosts", "names box-1 twice", id="host-twice"),
        pytest.param(GOOD.replace('["box-1", "box-3"]', '"box-1"'), 5, "models.chat.hosts",
                     "must be a list", id="hosts-not-a-list"),
        pytest.param(GOOD.replace('["box-1", "box-3"]', "[]"), 5, "models.chat.hosts",
                     "names no worker", id="hosts-empty"),
        pytest.param(GOOD.replace('"8.0"', '"eight"'), 13,
                     "models.qwen2.5.min_compute_capability", "is not MAJOR.MINOR",
                     id="bad-capability"),
        pytest.param(GOOD.replace('{ zone = "a" }', "{ zone = 1 }"), 6, "models.chat.labels",
                     "must be a table of text", id="bad-labels"),
        pytest.param(GOOD.replace('command = "llama-server', 'cmd = "llama-server'), 3,
                     "models.chat.cmd", "unknown key", id="missing-command-and-unknown"),
        pytest.param(GOOD.replace('"3G"', '"auto"'), 19,
                     'models.local.ollama_models."llama3.2:3b"', "must be a size",
                     id="ollama-size"),
        pytest.param("[models.a]\ncommand = 'x {port}'\ncommand = 'y'\n", 3, "toml",
                     "Cannot overwrite a value", id="toml-syntax"),
    ],
)  # fmt: skip
def test_an_error_names_the_file_the_line_and_the_field(
    text: str, line: int, field: str, reason: str
) -> None:
    error = refused(text, "site/catalogue.toml")
    assert (error.file, error.line, error.field) == ("site/catalogue.toml", line, field)
    assert reason in error.reason
    assert str(error).startswith(f"site/catalogue.toml:{line}: {field}: ")
    assert error.details["line"] == line and error.details["field"] == field


def test_a_missing_key_is_placed_at_its_tables_header() -> None:
    error = refused('# x\n\n[models.a]\nvram = "1G"\n')
    assert (error.line, error.field) == (3, "models.a.command")


def test_a_key_inside_a_multiline_string_is_not_taken_for_one() -> None:
    text = '[models.a]\nenv = { A = """\nvram = 1\n""" }\ncommand = "x {port}"\nvram = "9Q"\n'
    assert refused(text).line == 6


def test_line_of_follows_dotted_keys_and_inline_tables() -> None:
    text = '[models]\nchat.vram = "1G"\nb = { vram = "2G" }\n[models.c.replicas]\nmax = 3\n'
    assert line_of(text, ("models", "chat", "vram")) == 2
    assert line_of(text, ("models", "b", "vram")) == 3
    assert line_of(text, ("models", "c", "replicas", "max")) == 5
    assert line_of(text, ("nowhere",)) is None


# ---------------------------------------------------------------- share


def _gpu(worker: str, index: int, total_gib: int, arch: str = "sm_86", model: str = "") -> Gpu:
    return Gpu(index=index, total_mb=total_gib * 1024, arch=arch, worker=worker, model=model)


def test_share_follows_hosts_labels_gpus_and_sizes() -> None:
    catalogue = parse_catalogue(GOOD)
    a100 = [_gpu("box-1", i, 40, "sm_80", "NVIDIA A100-SXM4-40GB") for i in range(2)]
    assert set(share(catalogue, "box-1", {"zone": "a"}, a100)) == {
        "chat", "qwen2.5", "llama3.2:3b",
    }  # fmt: skip
    assert set(share(catalogue, "box-2", {"zone": "a"}, a100)) == {"qwen2.5", "llama3.2:3b"}
    assert "chat" not in share(catalogue, "box-1", {"zone": "b"}, a100)
    small = [_gpu("box-1", 0, 4, "sm_75", "Tesla T4")]
    assert set(share(catalogue, "box-1", {"zone": "a"}, small)) == {"llama3.2:3b"}
    assert share(catalogue, "box-1", {}, []) == {}


def test_share_of_an_auto_model_uses_the_hosts_estimate_else_assumes_it_fits() -> None:
    catalogue = parse_catalogue('[models.a]\ncommand = "llama-server -m /m.gguf --port {port}"\n')
    gpus = [_gpu("box-1", 0, 8)]
    assert set(share(catalogue, "box-1", {}, gpus)) == {"a"}
    assert share(catalogue, "box-1", {}, gpus, {"a": 9 * 1024}) == {}
    assert set(share(catalogue, "box-1", {}, gpus, {"a": 7 * 1024})) == {"a"}


_NAMES = st.sampled_from(["box-1", "box-2", "box-3"])
_LABELS = st.dictionaries(st.sampled_from(["zone", "rack"]), st.sampled_from(["a", "b"]))
_GPUS = st.lists(
    st.tuples(st.integers(1, 80), st.sampled_from(["sm_75", "sm_80", "sm_90", ""])), max_size=4
)


@st.composite
def _entries(draw: st.DrawFn) -> Catalogue:
    entries = {}
    for i in range(draw(st.integers(0, 5))):
        vram = draw(st.none() | st.integers(1, 80 * 1024))
        model = ModelConfig(f"m{i}", ("x", "{port}"), vram, gpus=draw(st.integers(1, 3)))
        hosts = tuple(sorted(draw(st.sets(_NAMES, max_size=2))))
        constraints = Constraints.build(
            labels=draw(st.none() | _LABELS),
            min_compute_capability=draw(st.none() | st.sampled_from(["7.5", "8.0", "9.0"])),
        )
        entries[model.name] = Entry(model, hosts, constraints)
    return Catalogue(entries)


def _worker_gpus(worker: str, specs: list[tuple[int, str]]) -> list[Gpu]:
    return [_gpu(worker, i, gib, arch) for i, (gib, arch) in enumerate(specs)]


@settings(max_examples=200, deadline=None)
@given(_entries(), _NAMES, _LABELS, _GPUS, st.tuples(st.integers(1, 80), st.just("sm_90")))
def test_share_properties(
    catalogue: Catalogue,
    worker: str,
    labels: dict[str, str],
    specs: list[tuple[int, str]],
    more: tuple[int, str],
) -> None:
    gpus = _worker_gpus(worker, specs)
    shared = share(catalogue, worker, labels, gpus)
    # only the catalogue's own models, unchanged
    assert all(catalogue.entries[name].model is model for name, model in shared.items())
    for name in shared:
        entry = catalogue.entries[name]
        assert not entry.hosts or worker in entry.hosts  # hosts are a filter
        assert len(gpus) >= entry.model.gpus  # enough GPUs
        assert all(labels.get(k) == v for k, v in entry.constraints.labels)
    # more GPUs, or more labels, never take a model away
    assert shared.keys() <= share(catalogue, worker, labels, [*gpus, _gpu(worker, 9, *more)]).keys()
    assert shared.keys() <= share(catalogue, worker, {"extra": "x", **labels}, gpus).keys()
    # a model pinned to this host alone, with no constraint, small enough, is shared
    free = Entry(ModelConfig("free", ("x", "{port}"), 1, gpus=1), (worker,))
    with_free = Catalogue({**catalogue.entries, "free": free})
    assert ("free" in share(with_free, worker, labels, gpus)) == bool(gpus)
    # an estimate only ever narrows an auto model's share
    auto = {n for n, e in catalogue.entries.items() if e.model.vram is None}
    estimated = share(catalogue, worker, labels, gpus, dict.fromkeys(auto, 80 * 1024 + 1))
    assert estimated.keys() == shared.keys() - auto


def test_share_names_the_catalogues_models_of_each_worker_exactly_once() -> None:
    entry = Entry(ModelConfig("a", ("x", "{port}"), 1024), ("box-1",))
    catalogue = Catalogue({"a": entry, "b": replace(entry, hosts=())})
    assert list(share(catalogue, "BOX-1", {}, [_gpu("box-1", 0, 8)])) == ["a", "b"]
