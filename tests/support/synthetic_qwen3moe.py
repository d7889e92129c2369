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

ARCH = "qwen3moe"
BLOCKS = 8
HEAD_DIM = 32  # explicit key_length: HEADS * HEAD_DIM = 128 != HIDDEN
EXPERTS = 8
EXPERT_FFN = 32
FFN = 96  # the dense feed_forward_length the converter writes; unused by qwen3moe

KEYS: dict[str, Any] = {
    **shape_keys(BLOCKS, FFN, 1e-6, head_dim=HEAD_DIM),
    "rope.freq_base": 1000000.0,
    **expert_keys(EXPERTS, EXPERTS_USED, EXPERT_FFN),
}


def _block(wt: Weights) -> Tensors:
    return {
        "attn_norm.weight": wt.norm(HIDDEN),
        **attention(wt, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM),
        "attn_q_norm.weight": wt.norm(HEAD_DIM),
        "attn_k_norm.weight": wt.norm(HEAD_DIM),
        "ffn_norm.weight": wt.norm(HIDDEN),
        "ffn_gate_inp.weight": wt.w(EXPERTS, HIDDEN),
        **experts(wt, EXPERTS, EXPERT_FFN),
    }


def write_model(path: Path, seed: int = 0, metadata: dict[str, Any] | None = None) -> Path:
    """Write the synthetic model to ``path``. ``metadata`` replaces or adds
    ``qwen3moe.*`` entries (a list: a per-layer uint32 array), for the refusals."""
    wt = Weights(seed)
    tensors = blocks(outer_tensors(wt), (_block(wt) for _ in range(BLOCKS)))
    return write_gguf(path, ARCH, "synthetic qwen3moe", {**KEYS, **(metadata or {})}, tensors, pre="qwen2")
