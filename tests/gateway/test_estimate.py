"""``vram = "auto"``: estimates read from small GGUF and safetensors files written here."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.gateway.estimate import OVERHEAD_MB, estimate_vram

MIB = 1024 * 1024


def write_gguf(path: Path, *, layers: int = 4, heads: int = 8, kv_heads: int = 2) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(256)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_tensor("token_embd.weight", np.zeros((2048, 1024), dtype=np.float16))  # 4 MiB
    writer.add_tensor("output.weight", np.zeros((1024, 1024), dtype=np.float32))  # 4 MiB
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_weights_and_the_kv_cache_of_the_context_in_the_command(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    write_gguf(model)
    command = ("llama-server", "-m", str(model), "-c", "8192", "--port", "{port}")
    estimate = estimate_vram(command)
    assert estimate.weights_mb == 8
    # 2 (K, V) * 4 layers * 8192 ctx * 2 kv heads * (256 / 8) head dim * 2 bytes = 8 MiB
    assert estimate.kv_cache_mb == 8
    assert estimate.overhead_mb == OVERHEAD_MB + 1  # 512 + 5% of 16 MiB
    assert estimate.total_mb == 8 + 8 + 513
    assert estimate.ctx == 8192 and estimate.layers == 4
    # no -c: the ctx key; neither: the context the model was trained for (4096)
    assert estimate_vram(command[:3], ctx=16384).kv_cache_mb == 16
    assert estimate_vram(("srv", f"--model={model}")).kv_cache_mb == 4


def test_safetensors_sizes_from_the_header_and_config_json(tmp_path: Path) -> None:
    save_file({"a": np.zeros((1024, 1024), dtype=np.float16)}, str(tmp_path / "m-1.safetensors"))
    save_file({"b": np.zeros((512, 1024), dtype=np.float32)}, str(tmp_path / "m-2.safetensors"))
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "hidden_size": 512, "max_position_embeddings": 1024}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    estimate = estimate_vram(("vllm", "serve", "--port", "{port}"), model_file=str(tmp_path))
    assert estimate.weights_mb == 4  # 2 MiB + 2 MiB, over both shards
    assert estimate.kv_cache_mb == 2 * 2 * 1024 * 4 * 128 * 2 // MIB
    one = estimate_vram(("srv", str(tmp_path / "m-1.safetensors"), "--max-model-len", "2048"))
    assert one.weights_mb == 2 and one.ctx == 2048


def test_a_file_that_is_not_a_model_is_named(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(InvalidInput, match=r"junk\.gguf is not a GGUF file"):
        estimate_vram(("srv", "-m", str(junk)))
    with pytest.raises(InvalidInput, match="does not exist"):
        estimate_vram(("srv", "-m", str(tmp_path / "gone.gguf")))
    with pytest.raises(InvalidInput, match="needs a model file"):
        estimate_vram(("srv", "--port", "{port}"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10**12).to_bytes(8, "little"))
    with pytest.raises(InvalidInput, match="header too long"):
        estimate_vram(("srv", str(bad)))
