"""A tiny synthetic ``qwen3moe`` GGUF (Qwen3-30B-A3B / 235B-A22B / Coder-480B layout).

What llama.cpp 0.3.36 reads for it (``src/models/qwen3moe.cpp``,
``llama_model_base::load_hparams`` in ``src/llama-model.cpp``): Q/K RMS norms
over one head (``attn_q_norm``/``attn_k_norm`` of ``key_length``), an explicit
head size larger than ``embedding_length / head_count`` (as the real models:
2048 / 32 = 64 but 128), a router ``ffn_gate_inp`` and 3-D expert tensors
``ffn_{gate,up,down}_exps`` sized by ``expert_feed_forward_length``, softmax
gating over ``expert_count`` experts with the top ``expert_used_count``
renormalised, untied ``output.weight``.

Random float32 weights, drawn wide so that greedy decoding keeps changing
tokens; the vocabulary is the small gpt2-style one of :mod:`tests.support.synthetic`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.support.synthetic import MERGES, VOCAB, vocabulary

ARCH = "qwen3moe"
BLOCKS = 8
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32  # explicit key_length: HEADS * HEAD_DIM = 128 != HIDDEN
EXPERTS = 8
EXPERTS_USED = 2
EXPERT_FFN = 32
FFN = 96  # the dense feed_forward_length the converter writes; unused by qwen3moe
CONTEXT = 4096


def write_model(path: Path, seed: int = 0, metadata: dict[str, Any] | None = None) -> Path:
    """Write the synthetic model to ``path``. ``metadata`` replaces or adds
    ``qwen3moe.*`` entries (a list: a per-layer uint32 array), for the refusals."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch=ARCH)
    writer.add_name("synthetic qwen3moe")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    keys: dict[str, Any] = {
        "context_length": CONTEXT,
        "embedding_length": HIDDEN,
        "block_count": BLOCKS,
        "feed_forward_length": FFN,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 1000000.0,
        "expert_count": EXPERTS,
        "expert_used_count": EXPERTS_USED,
        "expert_feed_forward_length": EXPERT_FFN,
    }
    keys.update(metadata or {})
    write_keys(writer, ARCH, keys)
    write_vocabulary(writer, "qwen2")

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * (2.0 / np.sqrt(shape[-1]))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    def put(name: str, array: np.ndarray) -> None:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    put("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    put("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    put("output.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * 0.5)
    for block in range(BLOCKS):
        tensors = {
            "attn_norm.weight": norm(HIDDEN),
            "attn_q.weight": w(q, HIDDEN),
            "attn_k.weight": w(kv, HIDDEN),
            "attn_v.weight": w(kv, HIDDEN),
            "attn_output.weight": w(HIDDEN, q),
            "attn_q_norm.weight": norm(HEAD_DIM),
            "attn_k_norm.weight": norm(HEAD_DIM),
            "ffn_norm.weight": norm(HIDDEN),
            # numpy shapes are ggml's ne reversed: {n_embd, n_expert} -> (E, H)
            "ffn_gate_inp.weight": w(EXPERTS, HIDDEN),
            "ffn_gate_exps.weight": w(EXPERTS, EXPERT_FFN, HIDDEN),
            "ffn_up_exps.weight": w(EXPERTS, EXPERT_FFN, HIDDEN),
            "ffn_down_exps.weight": w(EXPERTS, HIDDEN, EXPERT_FFN),
        }
        for name, array in tensors.items():
            put(f"blk.{block}.{name}", array)
    return finish(writer, path)


def write_keys(writer: Any, arch: str, keys: dict[str, Any]) -> None:
    """``{arch}.key`` entries: float -> float32, int -> uint32, list -> uint32
    array, str -> string."""
    for key, value in keys.items():
        name = f"{arch}.{key}"
        if isinstance(value, list):
            writer.add_array(name, value)
            continue
        if isinstance(value, float):
            writer.add_float32(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_string(name, value)


def write_vocabulary(writer: Any, pre: str) -> None:
    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)


def finish(writer: Any, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
