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

from tests.support.synthetic import (
    EXPERTS_USED,
    HEADS,
    HIDDEN,
    KV_HEADS,
    Tensors,
    Weights,
    attention,
    blocks,
    expert_keys,
    experts,
    outer_tensors,
    shape_keys,
    write_gguf,
)

ARCH = "minimax-m2"
BLOCKS = 8
HEAD_DIM = 32  # HEADS * HEAD_DIM = 128 != HIDDEN, as the real model (48 * 128 != 3072)
ROPE_DIMS = 16  # partial rotary: half of the head, as the real 64 of 128
EXPERTS = 8
EXPERT_FFN = 32
GATING_SIGMOID = 2  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID

KEYS: dict[str, Any] = {
    **shape_keys(BLOCKS, EXPERT_FFN, 1e-6, head_dim=HEAD_DIM),
    **expert_keys(EXPERTS, EXPERTS_USED, EXPERT_FFN),
    "rope.freq_base": 5000000.0,
    "rope.dimension_count": ROPE_DIMS,
    "expert_gating_func": GATING_SIGMOID,
}


def _block(wt: Weights) -> Tensors:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {
        "attn_norm.weight": wt.norm(HIDDEN),
        **attention(wt, q, kv),
        "attn_q_norm.weight": wt.norm(q),  # over all heads at once
        "attn_k_norm.weight": wt.norm(kv),
        "ffn_norm.weight": wt.norm(HIDDEN),
        "ffn_gate_inp.weight": wt.w(EXPERTS, HIDDEN),
        **experts(wt, EXPERTS, EXPERT_FFN),
        # selection bias (chooses experts, does not weight them)
        "exp_probs_b.bias": wt.normal(EXPERTS, scale=0.5),
    }


def write_model(path: Path, seed: int = 0, metadata: dict[str, Any] | None = None) -> Path:
    """Write the synthetic model to ``path``. ``metadata`` replaces or adds
    ``minimax-m2.*`` entries (a list: a per-layer uint32 array), for the refusals."""
    wt = Weights(seed)
    tensors = blocks(outer_tensors(wt), (_block(wt) for _ in range(BLOCKS)))
    return write_gguf(path, ARCH, "synthetic minimax-m2", {**KEYS, **(metadata or {})}, tensors)
