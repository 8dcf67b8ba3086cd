"""``vram = "auto"``: estimates read from small GGUF and safetensors files written here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.gateway.config import parse_config
from gpu_arbiter.gateway.servers.estimate import OVERHEAD_MB, Engine, estimate_vram

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


# ---------------------------------------------------------------------- each server's flags


def test_python_dash_m_names_the_server_and_llama_cpp_python_flags_are_read(
    tmp_path: Path,
) -> None:
    model = tmp_path / "m.gguf"
    write_gguf(model)
    server = ("python3", "-m", "llama_cpp.server", "--model", str(model))
    on_gpu = estimate_vram((*server, "--n_ctx", "512", "--n_gpu_layers", "-1"))
    assert on_gpu.engine is Engine.LLAMA_CPP_PYTHON and on_gpu.file == str(model)
    assert (on_gpu.ctx, on_gpu.weights_mb, on_gpu.kv_cache_mb) == (512, 8, 1)
    assert on_gpu.read == (
        "model file from --model",
        "ctx 512 from --n_ctx",
        "all layers on the GPU from --n_gpu_layers -1",
    )
    assert on_gpu.notes == ()
    # its defaults: 2048 of context, and no layer on the GPU: the model stays on the CPU
    default = estimate_vram((sys.executable, "-X", "utf8", "-m", "llama_cpp.server", "--model",
                             str(model)))  # fmt: skip
    assert default.ctx == 2048 and "ctx 2048: llama-cpp-python's default" in default.read
    assert (default.weights_mb, default.kv_cache_mb, default.total_mb) == (0, 0, OVERHEAD_MB)
    (note,) = default.notes
    assert "no layer on the GPU: the weights and the KV cache stay in CPU memory" in note


# -c and -np as llama.cpp's server (0c1e570) sizes its cache, for a model trained on
# 4096: its own log says "llama_kv_cache: size = ... (CELLS cells, ..., SLOTS/STREAMS seqs)"
LLAMA_CELLS = {
    "-c 8192": 8192,
    "-c 500": 512,  # rounded up to 256
    "-c 512 -np 4": 4 * 256,  # 4 streams of 512 / 4, each rounded up to 256
    "-c 4096 -np 3": 3 * 1536,
    "-c 300 -np 2 -kvu": 512,  # one cache for both
    "-np 1": 4096,
    "": 4096,  # auto slots: one cache of the model's context
    "-np 4": 4 * 4096,  # --fit gives each slot the model's context
    "-c 0 -np 2": 2 * 4096,
    "-np 2 --fit off": 4096,
    "--ctx-size 1024 --parallel 2 --no-kv-unified": 1024,
}


@pytest.mark.parametrize("flags", sorted(LLAMA_CELLS))
def test_llama_cpp_slots_share_the_context(tmp_path: Path, flags: str) -> None:
    model = tmp_path / "m.gguf"
    write_gguf(model)
    estimate = estimate_vram(("llama-server", "-m", str(model), *flags.split()))
    assert estimate.engine is Engine.LLAMA_CPP
    assert estimate.ctx == LLAMA_CELLS[flags]
    # 2 (K, V) * 4 layers * 2 kv heads * 32 head dim * 2 bytes = 1 KiB a cell
    assert estimate.kv_cache_mb == -(-LLAMA_CELLS[flags] // 1024)


def test_gpu_layers_put_a_share_of_the_model_on_the_gpu(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    write_gguf(model)  # 4 layers, 8 MiB of weights
    command = ("/opt/llama/bin/llama-server", "-m", str(model), "-c", "8192")
    assert estimate_vram((*command, "-ngl", "99")).weights_mb == 8
    assert estimate_vram((*command, "-ngl", "all")).weights_mb == 8
    one = estimate_vram((*command, "--n-gpu-layers", "1"))
    assert (one.weights_mb, one.kv_cache_mb) == (2, 2)
    assert one.notes == ("-ngl 1: 1 of 4 layers on the GPU, the rest in CPU memory",)
    none = estimate_vram((*command, "-ngl", "0"))
    assert (none.weights_mb, none.kv_cache_mb, none.total_mb) == (0, 0, OVERHEAD_MB)
    assert none.notes[0].startswith("-ngl 0: no layer on the GPU: the weights and the KV")
    with pytest.raises(InvalidInput, match="'many' after -ngl in the command is not a number"):
        estimate_vram((*command, "-ngl", "many"))


def write_safetensors(directory: Path) -> None:
    directory.mkdir(exist_ok=True)
    save_file({"a": np.zeros((2048, 1024), dtype=np.float16)}, str(directory / "m.safetensors"))
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "hidden_size": 512, "max_position_embeddings": 8192}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))


def test_vllm_serve_model_and_its_tensor_parallel_gpus(tmp_path: Path) -> None:
    write_safetensors(tmp_path)  # 4 MiB; 2 * 2 layers * 4 * 128 * 2 bytes: 4 KiB a cell
    served = estimate_vram(("vllm", "serve", str(tmp_path), "--max-model-len", "1024",
                            "-tp", "2", "--port", "{port}"))  # fmt: skip
    assert served.engine is Engine.VLLM and served.file == str(tmp_path)
    assert served.read == ("model from serve MODEL", "ctx 1024 from --max-model-len",
                           "2 GPUs from -tp")  # fmt: skip
    assert (served.gpus, served.weights_mb, served.kv_cache_mb) == (2, 2, 2)  # half each
    assert "set --gpu-memory-utilization" in served.notes[0]  # it takes 90% unless told
    assert "516 MiB per GPU of 2 = weights 2 MiB + KV cache 2 MiB" in served.describe()
    api = ("python", "-m", "vllm.entrypoints.openai.api_server", f"--model={tmp_path}")
    told = estimate_vram((*api, "--tensor-parallel-size", "2", "-pp", "2",
                          "--gpu-memory-utilization", "0.5"))  # fmt: skip
    assert (told.gpus, told.ctx, told.weights_mb, told.kv_cache_mb) == (4, 8192, 1, 8)
    assert told.notes == ()
    assert estimate_vram((*api, "-tp", "2"), gpus=1).weights_mb == 4  # the gpus key's count
    with pytest.raises(InvalidInput, match="not a local file or directory"):
        estimate_vram(("vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"))


def test_sglang_flags(tmp_path: Path) -> None:
    write_safetensors(tmp_path)
    command = ("python", "-m", "sglang.launch_server", "--model-path", str(tmp_path))
    estimate = estimate_vram((*command, "--context-length", "2048", "--tp-size", "2"))
    assert (estimate.engine, estimate.ctx, estimate.gpus) == (Engine.SGLANG, 2048, 2)
    assert "--mem-fraction-static" in estimate.notes[0]


def test_the_model_file_and_ctx_keys_override_the_command(tmp_path: Path) -> None:
    model, other = tmp_path / "m.gguf", tmp_path / "other.gguf"
    write_gguf(model)
    write_gguf(other, layers=8)
    command = ("llama-server", "-m", str(other), "-c", "8192")
    estimate = estimate_vram(command, model_file=str(model), ctx=1024)
    assert (estimate.file, estimate.layers, estimate.ctx) == (str(model), 4, 1024)
    assert estimate.read == ("model file from model_file", "ctx 1024 from the ctx key")


def test_a_tensor_parallel_command_sets_the_leases_gpus_unless_the_key_does() -> None:
    def gpus(command: str, **keys: object) -> int:
        return parse_config({"models": {"m": {"command": command, **keys}}}).models["m"].gpus

    assert gpus("vllm serve /m --port {port} --tensor-parallel-size 2 -pp 2") == 4
    assert gpus("vllm serve /m --port {port} -tp 2", gpus=8) == 8
    assert gpus("llama-server -m /m.gguf --port {port}") == 1
    with pytest.raises(InvalidInput) as refused:
        gpus("vllm serve /m --port {port} -tp two")
    assert refused.value.field == "models.m.command"
    assert refused.value.reason == "'two' after -tp in the command is not a number of GPUs"
    with pytest.raises(InvalidInput, match="-tp 0 in the command: 1 to 64 GPUs"):
        gpus("vllm serve /m --port {port} -tp 0")


# ---------------------------------------------------------------------- against llama.cpp

KV_LINE = re.compile(rb"llama_kv_cache: size = .*\(\s*(\d+) cells, .* (\d+)/(\d+) seqs\)")


@pytest.mark.parametrize(
    "flags", ["-c 512", "-c 500", "-c 512 -np 4", "-c 1000 -np 3", "-np 2", "-c 700 -np 2 -kvu"]
)
def test_the_cells_are_those_the_real_llama_server_allocates(
    llama_server: Path, tiny_models: Path, flags: str
) -> None:
    model = tiny_models / "tiny-chat.gguf"
    command = (str(llama_server), "-m", str(model), *flags.split(), "--port", "0", "-v")
    assert estimate_vram(command).ctx == _cells_allocated(command)


def _cells_allocated(command: tuple[str, ...]) -> int:
    """The cells of the server's last KV cache (after --fit's trial one), all streams:
    read from its log up to the line saying it listens."""
    found: list[int] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as server:
        assert server.stdout is not None
        try:
            for line in server.stdout:  # ends when it listens, or at its exit
                match = KV_LINE.search(line)
                if match:
                    found.append(int(match.group(1)) * int(match.group(3)))
                if b"listening on" in line:
                    break
        finally:
            server.kill()
    assert found, f"{command} logged no KV cache size"
    return found[-1]
