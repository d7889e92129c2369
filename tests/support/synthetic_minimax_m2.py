"""A tiny synthetic ``minimax-m2`` GGUF (MiniMax M2 layout).

What llama.cpp 0.3.36 reads for it (``src/models/minimax-m2.cpp``,
``llama_model_base::load_hparams`` in ``src/llama-model.cpp``): Q/K RMS norms
over the whole projection (``attn_q_norm`` of ``head_count * key_length``,
``attn_k_norm`` of ``head_count_kv * key_length``), partial rotary
(``rope.dimension_count`` half the head size, as the real 64 of 128), sigmoid
expert gating (``expert_gating_func`` 2: without it llama.cpp aborts) with a
per-block selection bias ``exp_probs_b.bias``, expert tensors sized by
``feed_forward_length`` (``expert_feed_forward_length`` is required too; the
converter writes the same value to both), and a required ``output.weight``.

Random float32 weights, drawn wide so that greedy decoding keeps changing
tokens; the vocabulary is the small gpt2-style one of :mod:`tests.support.synthetic`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.support.synthetic import VOCAB
from tests.support.synthetic_qwen3moe import finish, write_keys, write_vocabulary

ARCH = "minimax-m2"
BLOCKS = 8
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32  # HEADS * HEAD_DIM = 128 != HIDDEN, as the real model (48 * 128 != 3072)
ROPE_DIMS = 16  # partial rotary: half of the head, as the real 64 of 128
EXPERTS = 8
EXPERTS_USED = 2
EXPERT_FFN = 32
GATING_SIGMOID = 2  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
CONTEXT = 4096


def write_model(path: Path, seed: int = 0, metadata: dict[str, Any] | None = None) -> Path:
    """Write the synthetic model to ``path``. ``metadata`` replaces or adds
    ``minimax-m2.*`` entries (a list: a per-layer uint32 array), for the refusals."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch=ARCH)
    writer.add_name("synthetic minimax-m2")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    keys: dict[str, Any] = {
        "context_length": CONTEXT,
        "embedding_length": HIDDEN,
        "block_count": BLOCKS,
        "feed_forward_length": EXPERT_FFN,
        "expert_feed_forward_length": EXPERT_FFN,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 5000000.0,
        "rope.dimension_count": ROPE_DIMS,
        "expert_count": EXPERTS,
        "expert_used_count": EXPERTS_USED,
        "expert_gating_func": GATING_SIGMOID,
    }
    keys.update(metadata or {})
    write_keys(writer, ARCH, keys)
    write_vocabulary(writer, "default")

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
            "attn_q_norm.weight": norm(q),  # over all heads at once
            "attn_k_norm.weight": norm(kv),
            "ffn_norm.weight": norm(HIDDEN),
            # numpy shapes are ggml's ne reversed: {n_embd, n_expert} -> (E, H)
            "ffn_gate_inp.weight": w(EXPERTS, HIDDEN),
            "ffn_gate_exps.weight": w(EXPERTS, EXPERT_FFN, HIDDEN),
            "ffn_up_exps.weight": w(EXPERTS, EXPERT_FFN, HIDDEN),
            "ffn_down_exps.weight": w(EXPERTS, HIDDEN, EXPERT_FFN),
            # selection bias (chooses experts, does not weight them)
            "exp_probs_b.bias": (0.5 * rng.standard_normal(EXPERTS)).astype(np.float32),
        }
        for name, array in tensors.items():
            put(f"blk.{block}.{name}", array)
    return finish(writer, path)
