"""A tiny synthetic ``glm4moe`` GGUF (GLM-4.5, GLM-4.5-Air, GLM-4.6 layout).

What llama.cpp 0.3.36 reads for it (``src/models/glm4-moe.cpp``,
``llama_model_base::load_hparams`` in ``src/llama-model.cpp``), all present
here as the converter writes them for the real models:

* ``leading_dense_block_count`` dense blocks first (``ffn_{gate,up,down}`` of
  ``feed_forward_length``), then mixture-of-experts blocks: a router
  ``ffn_gate_inp``, the selection bias ``exp_probs_b.bias``, 3-D experts
  ``ffn_{gate,up,down}_exps`` of ``expert_feed_forward_length``, and a shared
  expert ``ffn_{gate,up,down}_shexp``; sigmoid gating
  (``expert_gating_func`` = 2), ``expert_weights_norm`` and
  ``expert_weights_scale``;
* Q/K/V biases, Q/K RMS norms over one head, ``post_attention_norm``, an
  explicit head size (``key_length``: heads x head size != hidden, as the
  real models) and partial rotary (``rope.dimension_count`` half the head
  size, as GLM-4.5's 64 of 128), NeoX RoPE;
* one multi-token-prediction block at the end (``nextn_predict_layers`` = 1:
  ``nextn.eh_proj``, ``nextn.enorm``, ``nextn.hnorm``,
  ``nextn.shared_head_norm`` on top of a mixture-of-experts block), which
  the whole model loads with ``TENSOR_SKIP`` and never computes;
* no ``rope.dimension_sections``: a text-only GLM-4.5 has none.

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
    feed_forward,
    nextn,
    outer_tensors,
    shape_keys,
    write_gguf,
)

ARCH = "glm4moe"
TRUNK = 7  # blocks the whole model computes
NEXTN = 1  # multi-token-prediction blocks after them
BLOCKS = TRUNK + NEXTN  # block_count
LEAD = 2  # leading dense blocks
HEAD_DIM = 32  # explicit key_length: HEADS * HEAD_DIM = 128 != HIDDEN
ROTARY = 16  # rope.dimension_count: partial rotary, half the head
EXPERTS = 8
SHARED = 1
EXPERT_FFN = 32
FFN = 96

KEYS: dict[str, Any] = {
    **shape_keys(BLOCKS, FFN, head_dim=HEAD_DIM),
    "rope.dimension_count": ROTARY,
    "rope.freq_base": 1000000.0,
    **expert_keys(EXPERTS, EXPERTS_USED, EXPERT_FFN),
    "expert_shared_count": SHARED,
    "leading_dense_block_count": LEAD,
    "expert_weights_scale": 2.5,
    "expert_weights_norm": True,
    "expert_gating_func": 2,  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
    "nextn_predict_layers": NEXTN,
}


def _block(wt: Weights, block: int) -> Tensors:
    t: Tensors = {
        "attn_norm.weight": wt.norm(HIDDEN),
        **attention(wt, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, biases=True),
        "attn_q_norm.weight": wt.norm(HEAD_DIM),
        "attn_k_norm.weight": wt.norm(HEAD_DIM),
        "post_attention_norm.weight": wt.norm(HIDDEN),
    }
    if block < LEAD:
        t |= feed_forward(wt, FFN)
    else:
        t["ffn_gate_inp.weight"] = wt.w(EXPERTS, HIDDEN)
        t["exp_probs_b.bias"] = wt.bias(EXPERTS)
        t |= experts(wt, EXPERTS, EXPERT_FFN)
        t |= feed_forward(wt, EXPERT_FFN * SHARED, suffix="_shexp")
    if block >= TRUNK:
        t |= nextn(wt)
    return t


def write_model(path: Path, seed: int = 0, metadata: dict[str, Any] | None = None) -> Path:
    """Write the synthetic model to ``path``. ``metadata`` replaces or adds
    ``glm4moe.*`` entries (a list: a per-layer uint32 array), for the refusals."""
    wt = Weights(seed)
    tensors = blocks(outer_tensors(wt), (_block(wt, block) for block in range(BLOCKS)))
    return write_gguf(path, ARCH, "synthetic glm4moe", {**KEYS, **(metadata or {})}, tensors, pre="glm4")
