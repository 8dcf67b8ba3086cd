"""``vram = "auto"``: the memory a model server needs, estimated from its model file.

    estimate = weights + KV cache + overhead

- **weights**: the sum of the tensors' sizes. GGUF: read from its header with the
  ``gguf`` package (llama.cpp's own reader); safetensors: from the JSON header at
  the start of each file (8 bytes little-endian length, then the JSON; every
  tensor's ``data_offsets``), summed over the shards of a model directory.
- **KV cache**: ``2 (K and V) * layers * ctx * kv_heads * head_dim * 2 bytes``
  (fp16). Layers, heads and widths come from the GGUF metadata, or from the
  ``config.json`` beside safetensors files. ``ctx`` is the server's ``-c`` /
  ``--ctx-size`` / ``--max-model-len`` argument, else the model's ``ctx`` key,
  else the context length the model was trained for.
- **overhead**: 512 MiB (CUDA context and the server's compute buffers) plus 5%
  of weights and KV cache (allocator fragmentation, activations).

The model file is the ``model_file`` key, else the argument after ``-m`` /
``--model`` in the command, else the first argument ending in ``.gguf`` or
``.safetensors``. After a model has loaded once, the gateway asks for the measured
peak instead, when that is higher.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import InvalidInput

__all__ = ["Estimate", "estimate_vram", "model_file_of"]

MIB = 1024 * 1024
OVERHEAD_MB = 512
OVERHEAD_SHARE = 0.05
KV_BYTES = 2  # fp16 K and V
_MAX_HEADER = 100 * MIB
_CTX_FLAGS = ("-c", "--ctx-size", "--max-model-len")
_MODEL_FLAGS = ("-m", "--model")


@dataclass(frozen=True, slots=True)
class Estimate:
    file: str
    weights_mb: int
    kv_cache_mb: int
    overhead_mb: int
    ctx: int | None
    layers: int | None

    @property
    def total_mb(self) -> int:
        return self.weights_mb + self.kv_cache_mb + self.overhead_mb

    def describe(self) -> str:
        kv = f"KV cache {self.kv_cache_mb} MiB"
        if self.ctx is not None and self.layers is not None:
            kv += f" (ctx {self.ctx}, {self.layers} layers)"
        return (
            f"{self.total_mb} MiB = weights {self.weights_mb} MiB + {kv} + overhead "
            f"{self.overhead_mb} MiB ({self.file})"
        )


def _flag_value(command: tuple[str, ...], flags: tuple[str, ...]) -> str | None:
    for i, part in enumerate(command):
        for flag in flags:
            if part == flag and i + 1 < len(command):
                return command[i + 1]
            if flag.startswith("--") and part.startswith(flag + "="):
                return part.split("=", 1)[1]
    return None


def model_file_of(command: tuple[str, ...], model_file: str | None = None) -> str | None:
    if model_file is not None:
        return model_file
    found = _flag_value(command, _MODEL_FLAGS)
    if found is not None:
        return found
    return next((p for p in command if p.endswith((".gguf", ".safetensors"))), None)


def estimate_vram(
    command: tuple[str, ...], *, model_file: str | None = None, ctx: int | None = None
) -> Estimate:
    """The estimate for a model's command; :class:`InvalidInput` (field ``vram``) when
    there is no model file to read or it cannot be read."""
    path_text = model_file_of(command, model_file)
    if path_text is None:
        raise InvalidInput(
            "vram", '"auto" needs a model file: name it with model_file, -m or --model'
        )
    ctx_text = _flag_value(command, _CTX_FLAGS)
    if ctx_text is not None:
        if not ctx_text.isdigit():
            raise InvalidInput("ctx", f"{ctx_text!r} in the command is not a context size")
        ctx = int(ctx_text) or ctx
    path = Path(path_text)
    try:
        if path.is_dir() or path.suffix == ".safetensors":
            return _safetensors(path, ctx)
        return _gguf(path, ctx)
    except OSError as error:
        raise InvalidInput("vram", f"cannot read {path}: {error.strerror or error}") from None


def _finish(file: Path, weights: int, kv: int, ctx: int | None, layers: int | None) -> Estimate:
    weights_mb, kv_mb = -(-weights // MIB), -(-kv // MIB)
    overhead = OVERHEAD_MB + round(OVERHEAD_SHARE * (weights_mb + kv_mb))
    return Estimate(str(file), weights_mb, kv_mb, overhead, ctx, layers)


def _kv_bytes(
    layers: int | None, ctx: int | None, kv_heads: int | None, head_dim: int | None
) -> int:
    if not (layers and ctx and kv_heads and head_dim):
        return 0
    return 2 * layers * ctx * kv_heads * head_dim * KV_BYTES


# ---------------------------------------------------------------------- GGUF


def _gguf(path: Path, ctx: int | None) -> Estimate:
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
    ctx = ctx or number("context_length")
    return _finish(path, weights, _kv_bytes(layers, ctx, kv_heads, head_dim), ctx, layers)


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


def _safetensors(path: Path, ctx: int | None) -> Estimate:
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
    ctx = ctx or _int(config.get("max_position_embeddings"))
    return _finish(path, weights, _kv_bytes(layers, ctx, kv_heads, head_dim), ctx, layers)


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
