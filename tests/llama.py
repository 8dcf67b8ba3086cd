"""llama.cpp's real server and tiny models, for the tests that run a real model server.

``llama_server`` (session): the path of a ``llama-server`` binary. ``GPU_ARBITER_LLAMA_SERVER``
names it (``scripts/test`` sets it from ``scripts/llama-server``: the shared binary, else
one it builds into a cache); else ``../shared/bin/llama-server`` beside the repository.
Without one the test is skipped, saying how to get one, except where ``CI`` is set: there
it fails, so CI never skips a real-server test silently.

``tiny_models`` (session): a directory holding ``tiny-chat.gguf`` (2 layers) and
``tiny-big.gguf`` (8 layers): ``../shared/models`` where it has both, else written here
by :func:`write_tiny_gguf` into a temporary directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENV = "GPU_ARBITER_LLAMA_SERVER"
SHARED = Path(__file__).resolve().parents[2] / "shared"
TINY = {"tiny-chat.gguf": 2, "tiny-big.gguf": 8}  # file -> layers
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def find_llama_server() -> Path | None:
    """The binary the tests run: the variable's, else the shared one (None: neither)."""
    named = os.environ.get(ENV, "").strip()
    if named:
        return Path(named)
    shared = SHARED / "bin" / "llama-server"
    return shared if os.access(shared, os.X_OK) else None


@pytest.fixture(scope="session")
def llama_server() -> Path:
    found = find_llama_server()
    if found is not None and not os.access(found, os.X_OK):
        pytest.fail(f"{ENV}={found} is not an executable file")
    if found is None:
        why = (
            f"no llama-server: set {ENV}=/path/to/llama-server, or run ./scripts/test "
            f"(it uses {SHARED}/bin/llama-server, else builds one with scripts/llama-server)"
        )
        if in_ci():
            pytest.fail(why + " (CI is set: a real-server test is never skipped there)")
        pytest.skip(why)
    return found


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shared = SHARED / "models"
    if all((shared / name).is_file() for name in TINY):
        return shared
    made = tmp_path_factory.mktemp("tiny-models")
    for name, layers in TINY.items():
        write_tiny_gguf(made / name, layers)
    return made


def write_tiny_gguf(path: Path, layers: int) -> None:
    """A llama-architecture model with random weights that llama.cpp loads in a moment:
    64 wide, 4 heads, a 2048 context, and a vocabulary of the 256 bytes plus a few
    letters and words (byte fallback), with a chatml template. It writes gibberish."""
    import gguf
    import numpy as np

    width, heads, ff = 64, 4, 128
    rng = np.random.default_rng(0)
    tokens, scores, kinds = _vocabulary()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny random llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(width // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(0)  # all f32
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(kinds)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHATML)

    def tensor(name: str, *shape: int, ones: bool = False) -> None:
        values = np.ones(shape) if ones else rng.standard_normal(shape) * 0.02
        writer.add_tensor(name, values.astype(np.float32))

    tensor("token_embd.weight", len(tokens), width)
    for i in range(layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"blk.{i}.{part}.weight", width, width)
        tensor(f"blk.{i}.attn_norm.weight", width, ones=True)
        tensor(f"blk.{i}.ffn_norm.weight", width, ones=True)
        tensor(f"blk.{i}.ffn_gate.weight", ff, width)
        tensor(f"blk.{i}.ffn_up.weight", ff, width)
        tensor(f"blk.{i}.ffn_down.weight", width, ff)
    tensor("output_norm.weight", width, ones=True)
    tensor("output.weight", len(tokens), width)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _vocabulary() -> tuple[list[str], list[float], list[int]]:
    """SentencePiece pieces: unknown, begin, end (control), the 256 bytes, then letters
    and words (normal), the better-scored first."""
    normal, control, byte = 1, 3, 6
    tokens, scores, kinds = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, control, control]
    for value in range(256):
        tokens.append(f"<0x{value:02X}>")
        scores.append(0.0)
        kinds.append(byte)
    for rank, piece in enumerate("▁abcdefghijklmnopqrstuvwxyz.,!?"):
        tokens.append(piece)
        scores.append(-1.0 - rank)
        kinds.append(normal)
    for word in ("▁hi", "▁hello", "▁the", "▁a", "▁world"):
        tokens.append(word)
        scores.append(-0.5)
        kinds.append(normal)
    return tokens, scores, kinds
