"""Tiny synthetic ``deepseek2`` GGUFs (DeepSeek V2/V3/R1, Kimi K2 layout).

The metadata keys and tensor names are those llama.cpp 0.3.36 reads for
``LLM_ARCH_DEEPSEEK2`` (``src/models/deepseek2.cpp`` load_arch_hparams and
load_arch_tensors; the converter ``conversion/deepseek.py`` DeepseekV2Model):
multi-head latent attention in its absorbed form (``attn_kv_a_mqa``,
``attn_k_b``, ``attn_v_b``, one KV head), leading dense blocks, then MoE
blocks with a shared expert, and the vocabulary of
:mod:`tests.support.synthetic`.

Two variants:

* the default, V3-like: low-rank queries (``attention.q_lora_rank``,
  ``attn_q_a`` / ``attn_q_a_norm`` / ``attn_q_b``), 3 leading dense blocks
  of 29 trunk blocks, sigmoid gating with the selection bias
  (``exp_probs_b``), normalised and scaled expert weights, YaRN RoPE with
  DeepSeek's ``yarn_log_multiplier`` (its mscale), and one multi-token
  prediction block appended as block 29 (``nextn_predict_layers = 1``,
  ``blk.29.nextn.*``), which llama.cpp loads nowhere and never runs;
* ``lite=True``, V2-Lite-like: 26 blocks (llama.cpp takes 26 or 27 trunk
  blocks for "lite" and then reads no ``q_lora_rank`` and uses ``attn_q``),
  one leading dense block, no gating function key (llama.cpp then picks
  softmax from the block count and vocabulary), no MTP block.

Weights are drawn wide (as in :mod:`tests.support.synthetic`) so greedy
decoding keeps changing tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.synthetic import (
    EXPERTS_USED,
    HEADS,
    HIDDEN,
    SPECIALS,
    VOCAB,
    Tensors,
    Weights,
    blocks,
    expert_keys,
    experts,
    feed_forward,
    nextn,
    outer_tensors,
    shape_keys,
    write_gguf,
)

ARCH = "deepseek2"
Q_LORA = 32
KV_LORA = 32
ROPE_DIM = 8  # qk_rope_head_dim
NOPE_DIM = 16  # qk_nope_head_dim
K_MLA = NOPE_DIM + ROPE_DIM  # key_length_mla
V_MLA = 16  # v_head_dim
FFN = 128  # the dense blocks' feed-forward
EXPERTS = 4
SHARED = 1
EXPERT_FFN = 32

#: The V3-like model: 29 trunk blocks (3 dense, 26 MoE) and 1 MTP block, enough
#: for stages of 26 and 27 blocks, the counts llama.cpp takes for "lite".
TRUNK = 29
LEADING_DENSE = 3
NEXTN = 1
BLOCKS = TRUNK + NEXTN
#: The lite model: 26 blocks (1 dense), no MTP block.
LITE_BLOCKS = 26
LITE_LEADING_DENSE = 1

GATING_SIGMOID = 2  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (src/llama-hparams.h)


def _keys(lite: bool) -> dict[str, Any]:
    keys: dict[str, Any] = {
        **shape_keys(LITE_BLOCKS if lite else BLOCKS, FFN, 1e-6, kv_heads=1),  # MLA is MQA once absorbed
        "rope.freq_base": 10000.0,
        **expert_keys(EXPERTS, EXPERTS_USED, EXPERT_FFN),
        "leading_dense_block_count": LITE_LEADING_DENSE if lite else LEADING_DENSE,
        "vocab_size": VOCAB,
    }
    if not lite:
        keys["attention.q_lora_rank"] = Q_LORA
    keys |= {
        "attention.kv_lora_rank": KV_LORA,
        "attention.key_length": KV_LORA + ROPE_DIM,
        "attention.value_length": KV_LORA,
        "attention.key_length_mla": K_MLA,
        "attention.value_length_mla": V_MLA,
        "expert_shared_count": SHARED,
        "rope.dimension_count": ROPE_DIM,
    }
    if not lite:
        # DeepSeek V3: routed_scaling_factor, norm_topk_prob, sigmoid scoring,
        # YaRN with mscale_all_dim (written as 0.1 * mscale_all_dim).
        keys |= {
            "expert_weights_scale": 2.5,
            "expert_weights_norm": True,
            "expert_gating_func": GATING_SIGMOID,
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": 4.0,
            "rope.scaling.original_context_length": 32,
            "rope.scaling.yarn_log_multiplier": 0.1,
            "nextn_predict_layers": NEXTN,
        }
    return keys


def _block(wt: Weights, block: int, lite: bool) -> Tensors:
    blocks_, lead = (LITE_BLOCKS, LITE_LEADING_DENSE) if lite else (BLOCKS, LEADING_DENSE)
    t: Tensors = {"attn_norm.weight": wt.norm(HIDDEN)}
    if lite:
        t["attn_q.weight"] = wt.w(HEADS * K_MLA, HIDDEN)
    else:
        t["attn_q_a.weight"] = wt.w(Q_LORA, HIDDEN)
        t["attn_q_a_norm.weight"] = wt.norm(Q_LORA)
        t["attn_q_b.weight"] = wt.w(HEADS * K_MLA, Q_LORA)
    t["attn_kv_a_mqa.weight"] = wt.w(KV_LORA + ROPE_DIM, HIDDEN)
    t["attn_kv_a_norm.weight"] = wt.norm(KV_LORA)
    t["attn_k_b.weight"] = wt.w(HEADS, KV_LORA, NOPE_DIM)
    t["attn_v_b.weight"] = wt.w(HEADS, V_MLA, KV_LORA)
    t["attn_output.weight"] = wt.w(HIDDEN, HEADS * V_MLA)
    t["ffn_norm.weight"] = wt.norm(HIDDEN)
    if block < lead:
        t |= feed_forward(wt, FFN)
    else:
        t["ffn_gate_inp.weight"] = wt.w(EXPERTS, HIDDEN)
        if not lite:
            t["exp_probs_b.bias"] = wt.normal(EXPERTS, scale=0.5)
        t |= experts(wt, EXPERTS, EXPERT_FFN)
        t |= feed_forward(wt, EXPERT_FFN * SHARED, suffix="_shexp")
    if not lite and block >= blocks_ - NEXTN:  # the multi-token prediction block
        t |= nextn(wt)
    return t


def write_model(path: Path, seed: int = 0, lite: bool = False) -> Path:
    """Write a synthetic deepseek2 GGUF to ``path`` (see the module docstring)."""
    wt = Weights(seed)
    n_blocks = LITE_BLOCKS if lite else BLOCKS
    tensors = blocks(outer_tensors(wt), (_block(wt, block, lite) for block in range(n_blocks)))
    name = "synthetic deepseek2 lite" if lite else "synthetic deepseek2"
    return write_gguf(path, ARCH, name, _keys(lite), tensors, pre="deepseek-v3")


__all__ = ["SPECIALS", "write_model"]
