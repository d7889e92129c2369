"""A tiny synthetic Llama 4 GGUF (the layout of Llama 4 Scout/Maverick) for the split tests.

The metadata keys and tensor names are those llama.cpp 0.3.36 reads for
``llama4`` (``src/models/llama4.cpp``; written by ``conversion/llama.py``
``Llama4Model``): no ``attention.sliding_window`` key (so llama.cpp uses chunked
attention, 3 chunked blocks then 1 global, and no RoPE on every 4th block),
a mixture of experts with a shared expert on every
``interleave_moe_layer_step``-th block (2 here, as Maverick: blocks 1, 3, 5, ...)
and dense feed-forward blocks between them, sigmoid routing, Q/K L2 norms, and
Llama 3 RoPE frequency factors (one global ``rope_freqs.weight``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.synthetic import (
    EXPERTS_USED,
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    Tensors,
    Weights,
    attention,
    blocks,
    expert_keys,
    experts,
    feed_forward,
    outer_tensors,
    shape_keys,
    write_gguf,
)

ARCH = "llama4"
BLOCKS = 17  # stages start at 0, 4, 8 or 12; no RoPE on 3, 7, 11, 15
MOE_STEP = 2
EXPERTS = 4
EXPERT_FFN = 64

KEYS: dict[str, Any] = {
    **shape_keys(BLOCKS, FFN, head_dim=HEAD_DIM),
    "rope.dimension_count": HEAD_DIM,
    "rope.freq_base": 500000.0,
    **expert_keys(EXPERTS, EXPERTS_USED, EXPERT_FFN),
}


def _block(wt: Weights, block: int, moe_step: int) -> Tensors:
    t: Tensors = {
        "attn_norm.weight": wt.norm(HIDDEN),
        **attention(wt, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM),
        "ffn_norm.weight": wt.norm(HIDDEN),
    }
    if moe_step > 0 and (block + 1) % moe_step == 0:  # llama_model_llama4::load_arch_tensors
        t["ffn_gate_inp.weight"] = wt.w(EXPERTS, HIDDEN)
        t |= experts(wt, EXPERTS, EXPERT_FFN)
        t |= feed_forward(wt, EXPERT_FFN, suffix="_shexp")
    else:
        t |= feed_forward(wt, FFN)
    return t


def write_model(path: Path, seed: int = 0, moe_step: int = MOE_STEP, extra: dict | None = None) -> Path:
    """``extra``: more ``llama4.*`` keys (int -> uint32, float -> float32)."""
    wt = Weights(seed)
    outer = outer_tensors(wt) | {"rope_freqs.weight": wt.uniform(1.0, 8.0, HEAD_DIM // 2)}
    tensors = blocks(outer, (_block(wt, block, moe_step) for block in range(BLOCKS)))
    keys = {**KEYS, "interleave_moe_layer_step": moe_step, **(extra or {})}
    return write_gguf(path, ARCH, "synthetic llama4", keys, tensors)
