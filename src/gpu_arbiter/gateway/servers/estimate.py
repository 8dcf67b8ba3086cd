"""``vram = "auto"``: the memory a model server needs, estimated from its model file.

    estimate per GPU = (weights + KV cache) on the GPU / GPUs + overhead

- **weights**: the sum of the tensors' sizes. GGUF: read from its header with the
  ``gguf`` package (llama.cpp's own reader); safetensors: from the JSON header at
  the start of each file (8 bytes little-endian length, then the JSON; every
  tensor's ``data_offsets``), summed over the shards of a model directory.
- **KV cache**: ``2 (K and V) * layers * cells * kv_heads * head_dim * 2 bytes``
  (fp16). Layers, heads and widths come from the GGUF metadata, or from the
  ``config.json`` beside safetensors files. The cells are the context the server
  sizes its cache for, as each server reads its own flags (below).
- **overhead**: 512 MiB per GPU (CUDA context and the server's compute buffers) plus
  5% of its share of weights and KV cache (allocator fragmentation, activations).

The command says which server it starts: the program's name (``llama-server``,
``vllm serve``, ``ollama``) or the module of ``python -m`` (``llama_cpp.server``,
``vllm.entrypoints.openai.api_server``, ``sglang.launch_server``); the same
:class:`Engine` tells the gateway how to drive it (``engines.py``). Each reads its
flags its own way (the last of a repeated flag counts, ``--flag=value`` too):

- llama.cpp's ``llama-server``: ``-m``/``--model``; ``-c``/``--ctx-size`` with
  ``-np``/``--parallel`` and ``-kvu``/``-no-kvu``; ``-ngl``/``--n-gpu-layers``
  (default: all layers on the GPU).
- llama-cpp-python: ``--model``; ``--n_ctx`` (default 2048, 0: the model's);
  ``--n_gpu_layers`` (default 0: the model runs on the CPU; -1: all on the GPU).
- vLLM: ``vllm serve MODEL`` or ``--model``; ``--max-model-len``;
  ``-tp``/``--tensor-parallel-size`` x ``-pp``/``--pipeline-parallel-size`` GPUs.
- SGLang: ``--model-path``; ``--context-length``; ``--tp-size`` x ``--pp-size`` GPUs.
- any other: ``-m``/``--model``; ``-c``, ``--ctx-size`` or ``--max-model-len``.

Each falls back to the first argument ending in ``.gguf`` or ``.safetensors`` for the
model, and to the context the model was trained for. The config's ``model_file`` and
``ctx`` keys override what the command says (``ctx`` stands for the context flag).

llama.cpp's cache (its ``llama_context`` and ``common/fit.cpp`` at commit 0c1e570,
checked against its server): ``-c`` is the total for all slots, rounded up to 256
cells. With ``-np N`` the cache is split into N streams (unless ``-kvu``) of that
total / N cells each, each rounded up to 256; with no ``-np`` (auto: 4 slots) one
cache is shared by all. Without ``-c`` (or ``-c 0``) the context is the model's, and
with ``-np N`` each slot gets all of it (``--fit``, on by default; with ``--fit off``
the model's context is split in N).

With ``-ngl N`` (llama.cpp) or ``--n_gpu_layers N`` (llama-cpp-python) below the
layer count, only that share of the weights and cache is on the GPU; with 0 it all
stays in CPU memory, and the estimate says so. Tensor (and pipeline) parallel
servers split weights and cache across their GPUs: the estimate is per GPU, and
their count is the lease's ``gpus`` when that key is not set. vLLM and SGLang take
most of a GPU whatever the model needs unless told otherwise: the estimate says so
when their flag for it is missing.

After a model has loaded once, the gateway asks for the measured peak instead, when
that is higher.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePath
from typing import Any

from ...core import InvalidInput

__all__ = [
    "Engine",
    "Estimate",
    "ServerArgs",
    "engine_of",
    "estimate_vram",
    "gpus_of",
    "model_file_of",
    "server_args",
]

MIB = 1024 * 1024
OVERHEAD_MB = 512
OVERHEAD_SHARE = 0.05
KV_BYTES = 2  # fp16 K and V
_MAX_HEADER = 100 * MIB
_LLAMA_CELLS = 256  # llama.cpp rounds each cache stream up to this many cells
_LLAMA_AUTO_SLOTS = 4  # llama.cpp's -np -1 (auto)
_LLAMA_CPP_PYTHON_CTX = 2048  # its --n_ctx default
_PYTHON = re.compile(r"python[0-9.]*")
_MODEL_SUFFIXES = (".gguf", ".safetensors")


class Engine(StrEnum):
    """The model server a command starts, as far as its memory flags go."""

    LLAMA_CPP = "llama.cpp server"
    LLAMA_CPP_PYTHON = "llama-cpp-python"
    VLLM = "vLLM"
    SGLANG = "SGLang"
    COMFYUI = "ComfyUI"  # named by the config's engine key: its command is python main.py
    OLLAMA = "Ollama"
    GENERIC = "a generic server"


@dataclass(frozen=True, slots=True)
class _Flags:
    model: tuple[str, ...]
    ctx: tuple[str, ...]
    gpu_layers: tuple[str, ...] = ()
    slots: tuple[str, ...] = ()
    tensor_parallel: tuple[str, ...] = ()
    pipeline_parallel: tuple[str, ...] = ()


_FLAGS = {
    Engine.LLAMA_CPP: _Flags(
        model=("-m", "--model"),
        ctx=("-c", "--ctx-size"),
        gpu_layers=("-ngl", "--gpu-layers", "--n-gpu-layers"),
        slots=("-np", "--parallel"),
    ),
    Engine.LLAMA_CPP_PYTHON: _Flags(
        model=("--model",), ctx=("--n_ctx",), gpu_layers=("--n_gpu_layers",)
    ),
    Engine.VLLM: _Flags(
        model=("--model",),
        ctx=("--max-model-len", "--max_model_len"),
        tensor_parallel=("-tp", "--tensor-parallel-size", "--tensor_parallel_size"),
        pipeline_parallel=("-pp", "--pipeline-parallel-size", "--pipeline_parallel_size"),
    ),
    Engine.SGLANG: _Flags(
        model=("--model-path", "--model"),
        ctx=("--context-length",),
        tensor_parallel=("--tp-size", "--tensor-parallel-size"),
        pipeline_parallel=("--pp-size", "--pipeline-parallel-size"),
    ),
    Engine.COMFYUI: _Flags(model=(), ctx=()),
    Engine.OLLAMA: _Flags(model=(), ctx=()),  # its models come by name, in requests
    Engine.GENERIC: _Flags(model=("-m", "--model"), ctx=("-c", "--ctx-size", "--max-model-len")),
}
_PROGRAMS = {
    "llama-server": Engine.LLAMA_CPP,
    "llama_cpp.server": Engine.LLAMA_CPP_PYTHON,
    "vllm.entrypoints.openai.api_server": Engine.VLLM,
    "sglang.launch_server": Engine.SGLANG,
    "ollama": Engine.OLLAMA,
}
# What each server takes of a GPU whatever it needs, unless a flag says otherwise.
_GREEDY = {
    Engine.VLLM: (
        ("--gpu-memory-utilization", "--gpu_memory_utilization", "--kv-cache-memory-bytes"),
        "vLLM takes 90% of each GPU's memory whatever it needs: set "
        "--gpu-memory-utilization to the lease's share of the GPU",
    ),
    Engine.SGLANG: (
        ("--mem-fraction-static",),
        "SGLang takes most of each GPU's memory whatever it needs: set "
        "--mem-fraction-static to the lease's share of the GPU",
    ),
}


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """What a model server's command says about the memory it takes; ``read`` says
    where each value came from (``ctx 512 from --n_ctx``)."""

    engine: Engine
    args: tuple[str, ...]  # the server's own arguments (after the program or module)
    model: str | None = None
    ctx: int | None = None  # the context flag's value; None (or 0): the model's
    slots: int | None = None  # llama.cpp's -np; None or -1: auto
    unified_kv: bool | None = None  # llama.cpp's -kvu / -no-kvu
    gpu_layers: int | None = None  # -1: all of them; None: the server's default
    gpus: int | None = None  # tensor x pipeline parallel; None: not said
    read: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Estimate:
    """A model server's memory per GPU, in MiB, and how it was worked out."""

    file: str
    weights_mb: int  # on each GPU
    kv_cache_mb: int  # on each GPU
    overhead_mb: int
    ctx: int | None  # the KV cache's cells, all slots together
    layers: int | None
    gpus: int = 1
    engine: Engine = Engine.GENERIC
    read: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # what the number does not say (weights left on the CPU)

    @property
    def total_mb(self) -> int:
        return self.weights_mb + self.kv_cache_mb + self.overhead_mb

    def describe(self) -> str:
        kv = f"KV cache {self.kv_cache_mb} MiB"
        if self.ctx is not None and self.layers is not None:
            kv += f" (ctx {self.ctx}, {self.layers} layers)"
        each = f" per GPU of {self.gpus}" if self.gpus > 1 else ""
        read = f"; read as {self.engine}: {', '.join(self.read)}" if self.read else ""
        return (
            f"{self.total_mb} MiB{each} = weights {self.weights_mb} MiB + {kv} + overhead "
            f"{self.overhead_mb} MiB ({self.file}{read})"
        )


# ---------------------------------------------------------------------- the command


def _program(command: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """The program's name and its own arguments: ``env A=1 X`` is X; ``python -m M``
    is M; ``python script.py`` is ``script.py``."""
    words = command
    if words and PurePath(words[0]).name == "env":
        words = words[1:]
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]
    if not words:
        return "", ()
    name, rest = PurePath(words[0]).name, words[1:]
    return _python_target(rest) if _PYTHON.fullmatch(name) else (name, rest)


def _python_target(args: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """What python runs: the module after ``-m``, else the script (past its options)."""
    i = 0
    while i < len(args):
        if args[i] == "-m":
            return (args[i + 1], args[i + 2 :]) if i + 1 < len(args) else ("python", ())
        if not args[i].startswith("-"):
            return PurePath(args[i]).name, args[i + 1 :]
        i += 2 if args[i] in ("-W", "-X") else 1  # the options that take a value
    return "python", ()


def _flag(args: tuple[str, ...], flags: tuple[str, ...]) -> tuple[str, str] | None:
    """The value of the last of ``flags`` in ``args`` and the flag that gave it."""
    found = None
    for i, word in enumerate(args):
        for flag in flags:
            if word == flag and i + 1 < len(args):
                found = (args[i + 1], flag)
            elif flag.startswith("--") and word.startswith(flag + "="):
                found = (word.split("=", 1)[1], flag)
    return found


def _number(found: tuple[str, str], what: str, field: str = "vram") -> int:
    text, flag = found
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise InvalidInput(field, f"{text!r} after {flag} in the command is not {what}") from None


def _switch(args: tuple[str, ...], on: tuple[str, ...], off: tuple[str, ...]) -> bool | None:
    state = None
    for word in args:
        if word in on:
            state = True
        elif word in off:
            state = False
    return state


def _engine(command: tuple[str, ...]) -> tuple[Engine, tuple[str, ...], str | None]:
    """The server, its arguments, and a model given as vLLM's ``serve MODEL``."""
    name, args = _program(command)
    if name == "vllm" and args[:1] == ("serve",):
        model = args[1] if len(args) > 1 and not args[1].startswith("-") else None
        return Engine.VLLM, args[2:] if model else args[1:], model
    return _PROGRAMS.get(name, Engine.GENERIC), args, None


def engine_of(command: tuple[str, ...]) -> Engine:
    """The server ``command`` starts, from its program or module alone (its flags unread)."""
    return _engine(command)[0]


def server_args(command: tuple[str, ...]) -> ServerArgs:
    """What ``command`` says of its model, context, slots, GPU layers and GPUs.
    :class:`InvalidInput` (field ``ctx`` for the context flag, else ``vram``) names a
    flag whose value is not a number."""
    engine, args, positional = _engine(command)
    flags = _FLAGS[engine]
    read: list[str] = []

    def number(names: tuple[str, ...], what: str, said: str, field: str = "vram") -> int | None:
        found = _flag(args, names)
        if found is None:
            return None
        value = _number(found, what, field)
        read.append(f"{said.format(value)} from {found[1]}")
        return value

    model = _flag(args, flags.model)
    if positional is not None:
        model = (positional, "serve")
        read.append("model from serve MODEL")
    elif model is not None:
        read.append(f"model file from {model[1]}")
    ctx = number(flags.ctx, "a context size", "ctx {}", "ctx")
    slots = number(flags.slots, "a number of slots", "{} slots")
    layers = _gpu_layers(args, flags, read)
    gpus = _parallel(args, flags, read)
    unified = None
    if engine is Engine.LLAMA_CPP:
        unified = _switch(args, ("-kvu", "--kv-unified"), ("-no-kvu", "--no-kv-unified"))
    return ServerArgs(
        engine, args, model[0] if model else None, ctx, slots, unified, layers, gpus, tuple(read)
    )


def _gpu_layers(args: tuple[str, ...], flags: _Flags, read: list[str]) -> int | None:
    """``-ngl N``: N; -1 for all of them (a negative N, ``all``, or ``auto``, which fits
    as many as the GPU holds); None when the command does not say."""
    found = _flag(args, flags.gpu_layers)
    if found is None:
        return None
    word = found[0].strip().lower()
    layers = -1 if word in ("all", "auto") else _number(found, "a number of layers")
    if layers < 0:
        read.append(f"all layers on the GPU from {found[1]} {found[0]}")
        return -1
    read.append(f"{layers} GPU layers from {found[1]}")
    return layers


def _parallel(args: tuple[str, ...], flags: _Flags, read: list[str]) -> int | None:
    """Tensor x pipeline parallel size: the GPUs the server runs on."""
    total = None
    for names in (flags.tensor_parallel, flags.pipeline_parallel):
        found = _flag(args, names)
        if found is None:
            continue
        size = _number(found, "a number of GPUs")
        if not 1 <= size <= 64:
            raise InvalidInput("vram", f"{found[1]} {size} in the command: 1 to 64 GPUs")
        total = (total or 1) * size
        read.append(f"{size} GPUs from {found[1]}")
    return total


def gpus_of(command: tuple[str, ...]) -> int | None:
    """The GPUs a tensor or pipeline parallel server's command asks for (None: not said)."""
    return server_args(command).gpus


def model_file_of(command: tuple[str, ...], model_file: str | None = None) -> str | None:
    if model_file is not None:
        return model_file
    found = server_args(command).model
    if found is not None:
        return found
    return next((p for p in command if p.endswith(_MODEL_SUFFIXES)), None)


# ---------------------------------------------------------------------- the estimate


@dataclass(frozen=True, slots=True)
class _Model:
    """What a model file says: weights, layers, KV bytes per cell, trained context."""

    weights: int
    layers: int | None
    kv_per_cell: int  # bytes of K and V of one cell, all layers
    trained_ctx: int | None


def estimate_vram(
    command: tuple[str, ...],
    *,
    model_file: str | None = None,
    ctx: int | None = None,
    gpus: int | None = None,
) -> Estimate:
    """The estimate for a model's command, per GPU of ``gpus`` (default: the command's
    tensor x pipeline parallel size, else 1). :class:`InvalidInput` (field ``vram``, or
    ``ctx`` for the context flag) when there is no model file to read, it cannot be
    read, or a flag's value is not a number."""
    found = server_args(command)
    read = list(found.read)
    path_text = model_file_of(command, model_file)
    if path_text is None:
        raise InvalidInput(
            "vram", '"auto" needs a model file: name it with model_file, -m or --model'
        )
    if model_file is not None:
        read = [r for r in read if not r.startswith("model")] + ["model file from model_file"]
    if ctx is not None:
        read = [r for r in read if not r.startswith("ctx")] + [f"ctx {ctx} from the ctx key"]
    model = _read_model(Path(path_text), found.engine)
    cells, why = _cells(found, ctx if ctx is not None else found.ctx, model.trained_ctx)
    read += [why] if why else []
    share, notes = _on_gpu(found, model.layers)
    count = gpus or found.gpus or 1
    weights = _mb(model.weights * share / count)
    kv = _mb(model.kv_per_cell * (cells or 0) * share / count)
    overhead = OVERHEAD_MB + round(OVERHEAD_SHARE * (weights + kv))
    greedy = _GREEDY.get(found.engine)
    if greedy is not None and _flag(found.args, greedy[0]) is None:
        notes.append(greedy[1])
    return Estimate(
        path_text, weights, kv, overhead, cells, model.layers, count, found.engine,
        tuple(read), tuple(notes),
    )  # fmt: skip


def _mb(size: float) -> int:
    return -(-int(size) // MIB)


def _cells(found: ServerArgs, ctx: int | None, trained: int | None) -> tuple[int | None, str]:
    """The KV cache's cells, all slots together, and a word on defaults used."""
    if found.engine is Engine.LLAMA_CPP:
        return _llama_cpp_cells(found, ctx, trained)
    if found.engine is Engine.LLAMA_CPP_PYTHON and ctx is None:
        return _LLAMA_CPP_PYTHON_CTX, f"ctx {_LLAMA_CPP_PYTHON_CTX}: llama-cpp-python's default"
    if not ctx:
        return trained, f"ctx {trained}: the model's own" if trained else ""
    return ctx, ""


def _llama_cpp_cells(
    found: ServerArgs, ctx: int | None, trained: int | None
) -> tuple[int | None, str]:
    """llama.cpp's cells: one cache for all slots, or one stream per slot (-np N)."""
    auto = found.slots is None or found.slots < 1
    slots = _LLAMA_AUTO_SLOTS if auto else found.slots or 1
    unified = auto if found.unified_kv is None else found.unified_kv
    why = ""
    if not ctx:
        if trained is None:
            return None, ""
        fit = _flag(found.args, ("-fit", "--fit"))
        whole = unified or (fit is not None and fit[0] == "off")
        ctx = trained if whole else trained * slots
        why = f"ctx {trained}: the model's own" + ("" if whole else f", for each of {slots} slots")
    total = _round_up(ctx, _LLAMA_CELLS)  # as llama_context pads it, then splits it
    if unified:
        return total, why
    each = _round_up(total // slots, _LLAMA_CELLS)
    return each * slots, why or f"{slots} slots of {each} cells"


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def _on_gpu(found: ServerArgs, layers: int | None) -> tuple[float, list[str]]:
    """The share of the weights and cache on the GPU, and what to say about the rest."""
    wanted, flag = found.gpu_layers, _FLAGS[found.engine].gpu_layers[:1]
    said = f"{flag[0]} {wanted}" if flag else ""
    if found.engine is Engine.LLAMA_CPP_PYTHON and wanted is None:
        wanted, said = 0, "no --n_gpu_layers (llama-cpp-python's default: 0)"
    if wanted is None or wanted < 0 or (layers is not None and wanted >= layers):
        return 1.0, []
    if wanted == 0:
        more = "; --n_gpu_layers -1 puts all on the GPU" if "default" in said else ""
        return 0.0, [
            f"{said}: no layer on the GPU: the weights and the KV cache stay in CPU memory "
            f"(the lease covers the server's GPU context only){more}"
        ]
    if layers is None:
        return 1.0, [f"{said}: the model's layer count is unknown: counted as all"]
    return wanted / layers, [
        f"{said}: {wanted} of {layers} layers on the GPU, the rest in CPU memory"
    ]


def _read_model(path: Path, engine: Engine) -> _Model:
    try:
        if path.is_dir() or path.suffix == ".safetensors":
            return _safetensors(path)
        if engine in (Engine.VLLM, Engine.SGLANG) and not path.exists():
            raise InvalidInput(
                "vram",
                f"{path} is not a local file or directory (a model hub name?): name the "
                "downloaded model's directory with model_file, or give vram",
            )
        return _gguf(path)
    except OSError as error:
        raise InvalidInput("vram", f"cannot read {path}: {error.strerror or error}") from None


def _kv_per_cell(layers: int | None, kv_heads: int | None, head_dim: int | None) -> int:
    if not (layers and kv_heads and head_dim):
        return 0
    return 2 * layers * kv_heads * head_dim * KV_BYTES


# ---------------------------------------------------------------------- GGUF


def _gguf(path: Path) -> _Model:
    from gguf import GGUFReader  # numpy comes with it: loaded only for "auto"

    if not path.is_file():
        raise InvalidInput("vram", f"model file {path} does not exist")
    try:
        reader = GGUFReader(path)
    except (ValueError, struct.error) as error:
        raise InvalidInput("vram", f"{path} is not a GGUF file: {error}") from None
    weights = sum(int(t.n_bytes) for t in reader.tensors)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = str(meta.get("general.architecture", ""))

    def number(key: str) -> int | None:
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, list):  # per-layer head counts: the largest
            value = max(value) if value else None
        return int(value) if isinstance(value, int | float) else None

    layers = number("block_count")
    heads = number("attention.head_count")
    kv_heads = number("attention.head_count_kv") or heads
    width = number("embedding_length")
    head_dim = number("attention.key_length") or (width // heads if width and heads else None)
    kv = _kv_per_cell(layers, kv_heads, head_dim)
    return _Model(weights, layers, kv, number("context_length"))


# ---------------------------------------------------------------------- safetensors


def safetensors_bytes(path: Path) -> int:
    """The bytes of the tensors in one safetensors file, from its header alone."""
    with path.open("rb") as file:
        head = file.read(8)
        if len(head) != 8:
            raise InvalidInput("vram", f"{path} is not a safetensors file: too short")
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_HEADER:
            raise InvalidInput("vram", f"{path} is not a safetensors file: header too long")
        try:
            header = json.loads(file.read(length))
        except (ValueError, UnicodeDecodeError):
            raise InvalidInput("vram", f"{path} is not a safetensors file: bad header") from None
    if not isinstance(header, dict):
        raise InvalidInput("vram", f"{path} is not a safetensors file: bad header")
    total = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise InvalidInput("vram", f"{path}: tensor {name!r} has no data_offsets")
        total += int(offsets[1]) - int(offsets[0])
    return total


def _safetensors(path: Path) -> _Model:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise InvalidInput("vram", f"{path} holds no .safetensors file")
    weights = sum(safetensors_bytes(file) for file in files)
    config = _hf_config(path if path.is_dir() else path.parent)
    layers = _int(config.get("num_hidden_layers"))
    heads = _int(config.get("num_attention_heads"))
    kv_heads = _int(config.get("num_key_value_heads")) or heads
    width = _int(config.get("hidden_size"))
    head_dim = _int(config.get("head_dim")) or (width // heads if width and heads else None)
    kv = _kv_per_cell(layers, kv_heads, head_dim)
    return _Model(weights, layers, kv, _int(config.get("max_position_embeddings")))


def _hf_config(directory: Path) -> dict[str, Any]:
    try:
        found = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if isinstance(found, dict) and isinstance(found.get("text_config"), dict):
        return {**found, **found["text_config"]}
    return found if isinstance(found, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
