"""A tiny synthetic Qwen3-Next GGUF (``qwen3next``) for the split tests.

The layout is what llama.cpp 0.3.36 reads (``src/models/qwen3next.cpp``
``load_arch_hparams`` / ``load_arch_tensors``) and what its converter writes
(``conversion/qwen.py`` ``Qwen3NextModel``): a hybrid of gated-delta-net
(linear attention, recurrent) blocks and full-attention blocks with a gated
query, a mixture of experts with a gated shared expert in every block, and
one multi-token-prediction (MTP / NextN) block appended after the trunk
(``block_count`` = trunk + 1, ``nextn_predict_layers`` = 1), as the converter
writes Qwen3-Next with its MTP head.

Which block is recurrent is said by ``full_attention_interval`` only
(blocks ``i`` with ``(i + 1) % interval != 0``, llama.cpp's default 4), or,
with ``pattern="array"``, by the per-layer bool array
``qwen3next.attention.recurrent_layers`` (what the converter writes when the
config has ``layer_types``), here an irregular one.

Dimensions are tiny: hidden 64; attention 4 query heads (each with its gate)
over 2 KV heads of 16, RoPE on 8 of 16 dimensions; linear attention with 2 key
heads and 4 value heads of 8 (so the key heads are repeated), a 4-tap
convolution; 4 experts (2 used) of 32 and a shared expert of 48.
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
    blocks,
    expert_keys,
    experts,
    feed_forward,
    nextn,
    outer_tensors,
    shape_keys,
    write_gguf,
)

ARCH = "qwen3next"
HEAD_DIM = 16
ROPE_DIM = 8
#: Linear attention (gated delta net): ssm.state_size, ssm.group_count,
#: ssm.time_step_rank, ssm.conv_kernel; ssm.inner_size = value heads x head size.
SSM_STATE = 8
SSM_K_HEADS = 2
SSM_V_HEADS = 4
SSM_CONV = 4
SSM_INNER = SSM_STATE * SSM_V_HEADS
EXPERTS = 4
EXPERT_FFN = 32
SHARED_FFN = 48
FFN = 96  # feed_forward_length: written as the converter does, read by nothing here

#: Trunk blocks with ``pattern="interval"`` (the MTP block comes after them).
TRUNK = 16
INTERVAL = 4  # llama.cpp's default: blocks 3, 7, 11 and 15 are full attention
#: The irregular pattern of ``pattern="array"`` (True: recurrent), its trunk.
ARRAY_PATTERN = (True, False, True, True, True, False, False, True, True, False)

KEYS: dict[str, Any] = {
    **shape_keys(TRUNK + 1, FFN, 1e-6, head_dim=HEAD_DIM),
    "rope.freq_base": 10000.0,
    "rope.dimension_count": ROPE_DIM,
    **expert_keys(EXPERTS, EXPERTS_USED, EXPERT_FFN),
    "expert_shared_feed_forward_length": SHARED_FFN,
    "ssm.conv_kernel": SSM_CONV,
    "ssm.state_size": SSM_STATE,
    "ssm.group_count": SSM_K_HEADS,
    "ssm.time_step_rank": SSM_V_HEADS,
    "ssm.inner_size": SSM_INNER,
    "full_attention_interval": INTERVAL,
}


def recurrent_flags(pattern: str = "interval") -> list[bool]:
    """Which trunk blocks are recurrent, as llama.cpp decides it for the whole model."""
    if pattern == "array":
        return list(ARRAY_PATTERN)
    return [(index + 1) % INTERVAL != 0 for index in range(TRUNK)]


def _block(wt: Weights, recurrent: bool, mtp: bool) -> Tensors:
    t: Tensors = {"attn_norm.weight": wt.norm(HIDDEN), "post_attention_norm.weight": wt.norm(HIDDEN)}
    key_dim, value_dim = SSM_STATE * SSM_K_HEADS, SSM_STATE * SSM_V_HEADS
    if recurrent:
        # gated delta net: fused q|k|v and the z gate (the converter's split of
        # in_proj_qkvz), the causal conv, dt bias, A (= -exp(A_log)), beta|alpha
        t |= {
            "attn_qkv.weight": wt.w(2 * key_dim + value_dim, HIDDEN),
            "attn_gate.weight": wt.w(value_dim, HIDDEN),
            "ssm_conv1d.weight": wt.rng.standard_normal((2 * key_dim + value_dim, SSM_CONV)) * 0.6,
            "ssm_dt.bias": 0.5 * wt.rng.standard_normal(SSM_V_HEADS),
            "ssm_a": -wt.uniform(0.2, 1.5, SSM_V_HEADS),
            "ssm_ba.weight": wt.w(2 * SSM_V_HEADS, HIDDEN),
            "ssm_norm.weight": wt.norm(SSM_STATE),
            "ssm_out.weight": wt.w(HIDDEN, value_dim),
        }
    else:
        # full attention: a query and its gate per head, Q/K RMS norms
        t |= {
            "attn_q.weight": wt.w(2 * HEADS * HEAD_DIM, HIDDEN),
            "attn_k.weight": wt.w(KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_v.weight": wt.w(KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_output.weight": wt.w(HIDDEN, HEADS * HEAD_DIM),
            "attn_q_norm.weight": wt.norm(HEAD_DIM),
            "attn_k_norm.weight": wt.norm(HEAD_DIM),
        }
    t["ffn_gate_inp.weight"] = wt.w(EXPERTS, HIDDEN)
    t |= experts(wt, EXPERTS, EXPERT_FFN)
    t["ffn_gate_inp_shexp.weight"] = wt.w(HIDDEN)
    t |= feed_forward(wt, SHARED_FFN, suffix="_shexp")
    if mtp:
        # the MTP head: llama.cpp loads it only for an MTP draft context
        t |= nextn(wt)
    return t


def write_model(
    path: Path, seed: int = 0, *, pattern: str = "interval", mtp: bool = True, extra: dict | None = None
) -> Path:
    """Write the synthetic model to ``path``. ``pattern``: ``"interval"``
    (only ``full_attention_interval``) or ``"array"`` (also the per-layer
    ``attention.recurrent_layers``); ``mtp``: append one MTP block;
    ``extra``: ``qwen3next.*`` metadata written instead of the defaults (a
    test of a refused shape)."""
    wt = Weights(seed)
    flags = recurrent_flags(pattern)
    n_mtp = 1 if mtp else 0
    keys = {**KEYS, "block_count": len(flags) + n_mtp}
    if mtp:
        keys["nextn_predict_layers"] = n_mtp
    if pattern == "array":
        # the converter pads the MTP blocks with False (full attention)
        keys["attention.recurrent_layers"] = flags + [False] * n_mtp
    keys |= {key.removeprefix(f"{ARCH}."): value for key, value in (extra or {}).items()}
    per_block = (_block(wt, flag, False) for flag in flags)
    mtp_blocks = (_block(wt, False, True) for _ in range(n_mtp))
    tensors = blocks(outer_tensors(wt), (*per_block, *mtp_blocks))
    return write_gguf(path, ARCH, "synthetic qwen3next", keys, tensors, pre="qwen2")
