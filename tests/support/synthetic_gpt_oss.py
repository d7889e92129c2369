"""A tiny synthetic gpt-oss GGUF (the layout of gpt-oss-20b/120b) for the split tests.

The metadata keys and tensor names are those llama.cpp 0.3.36 reads for
``gpt-oss`` (``src/models/openai-moe.cpp``; written by ``conversion/gpt_oss.py``):
Q/K/V and output biases, a per-head attention sink, a post-attention norm, a
mixture-of-experts feed-forward with router and expert biases (SwiGLU-OAI,
softmax over the chosen experts), a sliding window on the even blocks (no
pattern key: llama.cpp's default period 2) and YaRN RoPE scaling whose
original context the test's positions cross. Real files hold the experts in
MXFP4; float32 computes the same graph. The window is 8 positions so that
sliding and full-attention blocks differ within a short test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.synthetic import (
    EXPERTS_USED,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    Tensors,
    Weights,
    attention,
    blocks,
    expert_keys,
    outer_tensors,
    shape_keys,
    write_gguf,
)

ARCH = "gpt-oss"
BLOCKS = 9  # sliding window on 0, 2, 4, 6, 8; full attention on 1, 3, 5, 7
EXPERTS = 4
EXPERT_FFN = 64
WINDOW = 8

KEYS: dict[str, Any] = {
    **shape_keys(BLOCKS, EXPERT_FFN, head_dim=HEAD_DIM),
    "attention.sliding_window": WINDOW,
    **expert_keys(EXPERTS, EXPERTS_USED, EXPERT_FFN),
    "rope.freq_base": 150000.0,
    "rope.scaling.type": "yarn",
    "rope.scaling.factor": 4.0,
    "rope.scaling.original_context_length": 32,
}


def _block(wt: Weights) -> Tensors:
    return {
        "attn_norm.weight": wt.norm(HIDDEN),
        **attention(wt, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, biases=True),
        "attn_output.bias": wt.bias(HIDDEN),
        "attn_sinks.weight": wt.normal(HEADS),
        "post_attention_norm.weight": wt.norm(HIDDEN),
        # experts with biases: each weight followed by its bias
        "ffn_gate_inp.weight": wt.w(EXPERTS, HIDDEN),
        "ffn_gate_inp.bias": wt.bias(EXPERTS),
        "ffn_gate_exps.weight": wt.w(EXPERTS, EXPERT_FFN, HIDDEN),
        "ffn_gate_exps.bias": wt.bias(EXPERTS, EXPERT_FFN),
        "ffn_up_exps.weight": wt.w(EXPERTS, EXPERT_FFN, HIDDEN),
        "ffn_up_exps.bias": wt.bias(EXPERTS, EXPERT_FFN),
        "ffn_down_exps.weight": wt.w(EXPERTS, HIDDEN, EXPERT_FFN),
        "ffn_down_exps.bias": wt.bias(EXPERTS, HIDDEN),
    }


def write_model(path: Path, seed: int = 0) -> Path:
    wt = Weights(seed)
    tensors = blocks(outer_tensors(wt), (_block(wt) for _ in range(BLOCKS)))
    return write_gguf(path, ARCH, "synthetic gpt-oss", KEYS, tensors)
