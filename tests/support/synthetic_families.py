"""Tiny synthetic GGUFs of the families beyond the llama family, one table.

Each row of :data:`FAMILIES` is one model a test runs: its architecture, its
sizes, the metadata under ``{arch}.`` beyond the shape every model writes,
and the layout of its blocks; :func:`write_model` writes any row. The
metadata keys and tensor names are those llama.cpp 0.3.36 reads for the
architecture (``src/models/<arch>.cpp`` load_arch_hparams and
load_arch_tensors) and its converter writes for the real models. Weights are
random float32, drawn wide (see :mod:`tests.support.synthetic`, whose
vocabulary and building blocks they use) so that greedy decoding keeps
changing tokens; real files may hold some of them quantised, float32
computes the same graph.

The rows:

* ``deepseek2`` (DeepSeek V3/R1, Kimi K2): multi-head latent attention in
  its absorbed form (``attn_kv_a_mqa``, ``attn_k_b``, ``attn_v_b``, one KV
  head) with low-rank queries (``attention.q_lora_rank``), 3 leading dense
  blocks of 29 trunk blocks, then MoE blocks with a shared expert, sigmoid
  gating with the selection bias ``exp_probs_b``, normalised and scaled
  expert weights, YaRN RoPE with DeepSeek's ``yarn_log_multiplier``, and one
  multi-token-prediction block appended as block 29, which llama.cpp loads
  nowhere and never runs; ``deepseek2 lite`` (V2-Lite): 26 blocks (llama.cpp
  takes 26 or 27 trunk blocks for "lite" and then reads no ``q_lora_rank``
  and uses ``attn_q``), one leading dense block, no gating function key
  (llama.cpp then picks softmax from the block count and vocabulary), no MTP.
* ``glm4moe`` (GLM-4.5, 4.5-Air, 4.6): leading dense blocks, then experts
  with a shared expert and the selection bias, sigmoid gating; Q/K/V biases,
  Q/K norms over one head, ``post_attention_norm``, heads x head size !=
  hidden and partial rotary (half the head, as GLM-4.5's 64 of 128); one MTP
  block at the end; no ``rope.dimension_sections`` (a text-only GLM-4.5).
* ``gpt-oss`` (gpt-oss-20b/120b): Q/K/V and output biases, a per-head
  attention sink, a router and experts with biases (SwiGLU-OAI), a sliding
  window of 8 on the even blocks (no pattern key: llama.cpp's default period
  2), YaRN RoPE whose original context the test's positions cross.
* ``llama4 maverick`` / ``llama4 scout``: no ``attention.sliding_window`` key
  (chunked attention, 3 chunked blocks then 1 global, no RoPE on every 4th),
  experts with a shared expert on every ``interleave_moe_layer_step``-th
  block (2: Maverick, blocks 1, 3, 5, ...; 1: Scout, all) and dense blocks
  between them, Llama 3 RoPE frequency factors (``rope_freqs.weight``).
* ``minimax-m2``: Q/K norms over the whole projection, partial rotary,
  sigmoid gating (without ``expert_gating_func`` llama.cpp aborts) with the
  selection bias, experts sized by ``feed_forward_length`` (the converter
  writes the same value to ``expert_feed_forward_length``), untied output.
* ``qwen3moe`` (Qwen3-30B-A3B, 235B-A22B, Coder-480B): Q/K norms over one
  head, a head size larger than hidden / heads (as the real 2048 / 32 = 64
  but 128), softmax gating, untied output.
* ``qwen3next interval+mtp`` / ``qwen3next array``: a hybrid of
  gated-delta-net (linear attention, recurrent) blocks and full-attention
  blocks with a gated query, experts with a gated shared expert in every
  block. Which block is recurrent is said by ``full_attention_interval``
  only (``(i + 1) % 4 != 0``), with one MTP block appended after the 16
  trunk blocks, or also by the per-layer bool array
  ``attention.recurrent_layers`` (what the converter writes when the config
  has ``layer_types``), here an irregular one of 10 blocks without MTP.
  ``qwen3next uniform arrays``: the first with its head counts written as
  (uniform) per-layer arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.synthetic import (
    EXPERTS_USED,
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    VOCAB,
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

#: expert_gating_func values (src/llama-hparams.h LLAMA_EXPERT_GATING_FUNC_TYPE_*).
GATING_SIGMOID = 2

Mixer = Callable[["Family", Weights, int], Tensors]


# ------------------------------------------------------------ the mixers


def gqa(f: Family, wt: Weights, block: int) -> Tensors:
    """Grouped-query attention of ``f.head_dim``, then the feed-forward's norm."""
    assert f.head_dim
    q, kv = HEADS * f.head_dim, KV_HEADS * f.head_dim
    t = attention(wt, q, kv, biases=f.qkv_biases)
    if f.sinks:
        t |= {"attn_output.bias": wt.bias(HIDDEN), "attn_sinks.weight": wt.normal(HEADS)}
    if f.qk_norm:
        q_size, k_size = (f.head_dim, f.head_dim) if f.qk_norm == "head" else (q, kv)
        t |= {"attn_q_norm.weight": wt.norm(q_size), "attn_k_norm.weight": wt.norm(k_size)}
    t["post_attention_norm.weight" if f.post_attention_norm else "ffn_norm.weight"] = wt.norm(HIDDEN)
    return t


def mla(f: Family, wt: Weights, block: int) -> Tensors:
    """DeepSeek's multi-head latent attention, absorbed; low-rank queries
    where ``keys`` has a q_lora_rank; then the feed-forward's norm."""
    keys = f.keys
    kv_lora, rope = keys["attention.kv_lora_rank"], keys["rope.dimension_count"]
    k_mla, v_mla = keys["attention.key_length_mla"], keys["attention.value_length_mla"]
    q_lora = keys.get("attention.q_lora_rank")
    t: Tensors = {}
    if q_lora:
        t["attn_q_a.weight"] = wt.w(q_lora, HIDDEN)
        t["attn_q_a_norm.weight"] = wt.norm(q_lora)
        t["attn_q_b.weight"] = wt.w(HEADS * k_mla, q_lora)
    else:
        t["attn_q.weight"] = wt.w(HEADS * k_mla, HIDDEN)
    t["attn_kv_a_mqa.weight"] = wt.w(kv_lora + rope, HIDDEN)
    t["attn_kv_a_norm.weight"] = wt.norm(kv_lora)
    t["attn_k_b.weight"] = wt.w(HEADS, kv_lora, k_mla - rope)
    t["attn_v_b.weight"] = wt.w(HEADS, v_mla, kv_lora)
    t["attn_output.weight"] = wt.w(HIDDEN, HEADS * v_mla)
    t["ffn_norm.weight"] = wt.norm(HIDDEN)
    return t


def gated_delta_net(f: Family, wt: Weights, block: int) -> Tensors:
    """Qwen3-Next: post_attention_norm, then a gated delta net on the
    recurrent blocks, gated full attention on the others."""
    t: Tensors = {"post_attention_norm.weight": wt.norm(HIDDEN)}
    keys = f.keys
    state, k_heads, v_heads = keys["ssm.state_size"], keys["ssm.group_count"], keys["ssm.time_step_rank"]
    key_dim, value_dim, conv = state * k_heads, state * v_heads, keys["ssm.conv_kernel"]
    if block < len(f.recurrent) and f.recurrent[block]:
        # fused q|k|v and the z gate (the converter's split of in_proj_qkvz),
        # the causal conv, dt bias, A (= -exp(A_log)), beta|alpha
        t |= {
            "attn_qkv.weight": wt.w(2 * key_dim + value_dim, HIDDEN),
            "attn_gate.weight": wt.w(value_dim, HIDDEN),
            "ssm_conv1d.weight": wt.rng.standard_normal((2 * key_dim + value_dim, conv)) * 0.6,
            "ssm_dt.bias": 0.5 * wt.rng.standard_normal(v_heads),
            "ssm_a": -wt.uniform(0.2, 1.5, v_heads),
            "ssm_ba.weight": wt.w(2 * v_heads, HIDDEN),
            "ssm_norm.weight": wt.norm(state),
            "ssm_out.weight": wt.w(HIDDEN, value_dim),
        }
    else:
        assert f.head_dim
        # a query and its gate per head, Q/K RMS norms
        t |= {
            "attn_q.weight": wt.w(2 * HEADS * f.head_dim, HIDDEN),
            "attn_k.weight": wt.w(KV_HEADS * f.head_dim, HIDDEN),
            "attn_v.weight": wt.w(KV_HEADS * f.head_dim, HIDDEN),
            "attn_output.weight": wt.w(HIDDEN, HEADS * f.head_dim),
            "attn_q_norm.weight": wt.norm(f.head_dim),
            "attn_k_norm.weight": wt.norm(f.head_dim),
        }
    return t


@dataclass(frozen=True)
class Family:
    """One synthetic model: sizes, metadata and block layout."""

    arch: str
    blocks: int
    #: Metadata under ``{arch}.`` written after the shape and expert keys (see
    #: tests.support.synthetic.add_keys); the layouts read their sizes here too.
    keys: dict[str, Any]
    #: What a block computes between its attn_norm and its feed-forward: one
    #: of :func:`gqa` (the default), :func:`mla`, :func:`gated_delta_net`.
    mixer: Mixer = gqa
    #: Explicit key_length/value_length (None: written by ``keys``).
    head_dim: int | None = HEAD_DIM
    kv_heads: int = KV_HEADS
    #: feed_forward_length (the dense blocks').
    ffn: int = FFN
    eps: float = 1e-5
    experts: int = 0
    expert_ffn: int = 0
    #: A shared expert of this feed-forward (0: none).
    shared_ffn: int = 0
    #: The shared expert has its own gate ``ffn_gate_inp_shexp`` (qwen3next).
    shared_gate: bool = False
    #: Dense blocks before the first mixture-of-experts block.
    lead: int = 0
    #: Experts on every ``moe_step``-th block only, dense between (llama4).
    moe_step: int = 1
    #: Multi-token-prediction blocks at the end (``nextn.*`` tensors).
    nextn: int = 0
    #: The experts' selection bias ``exp_probs_b.bias``: "" none, "bias"
    #: drawn before the experts as a bias, "normal" before them at scale 0.5,
    #: "normal last" after them.
    selection: str = ""
    #: Router and experts with biases, each weight followed by its bias (gpt-oss).
    expert_biases: bool = False
    # the attention of gqa:
    qkv_biases: bool = False
    #: Q/K RMS norms: "head" over one head, "projection" over all heads at once.
    qk_norm: str = ""
    #: attn_output.bias and the per-head attn_sinks (gpt-oss).
    sinks: bool = False
    #: post_attention_norm in place of ffn_norm.
    post_attention_norm: bool = False
    #: The recurrent trunk blocks of gated_delta_net (the others full attention).
    recurrent: tuple[bool, ...] = ()
    #: Llama 3's RoPE frequency factors ``rope_freqs.weight`` (llama4).
    rope_freqs: bool = False
    pre: str = "default"
    #: general.name is ``synthetic {title}`` (default: the architecture).
    title: str = ""

    def metadata(self) -> dict[str, Any]:
        keys = shape_keys(self.blocks, self.ffn, self.eps, self.head_dim, self.kv_heads)
        if self.experts:
            keys |= expert_keys(self.experts, EXPERTS_USED, self.expert_ffn)
        return keys | self.keys

    def has_experts(self, block: int) -> bool:
        return bool(self.experts) and block >= self.lead and (block + 1) % self.moe_step == 0


# ------------------------------------------------------ the feed-forward


def mixture(f: Family, wt: Weights) -> Tensors:
    """The router, the experts (their selection bias, biases) and the shared expert."""
    t: Tensors = {"ffn_gate_inp.weight": wt.w(f.experts, HIDDEN)}
    if f.expert_biases:
        t["ffn_gate_inp.bias"] = wt.bias(f.experts)
        for part, shape in (
            ("gate", (f.expert_ffn, HIDDEN)),
            ("up", (f.expert_ffn, HIDDEN)),
            ("down", (HIDDEN, f.expert_ffn)),
        ):
            t[f"ffn_{part}_exps.weight"] = wt.w(f.experts, *shape)
            t[f"ffn_{part}_exps.bias"] = wt.bias(f.experts, shape[0])
        return t
    if f.selection == "bias":
        t["exp_probs_b.bias"] = wt.bias(f.experts)
    elif f.selection == "normal":
        t["exp_probs_b.bias"] = wt.normal(f.experts, scale=0.5)
    t |= experts(wt, f.experts, f.expert_ffn)
    if f.selection == "normal last":  # chooses experts, does not weight them
        t["exp_probs_b.bias"] = wt.normal(f.experts, scale=0.5)
    if f.shared_gate:
        t["ffn_gate_inp_shexp.weight"] = wt.w(HIDDEN)
    if f.shared_ffn:
        t |= feed_forward(wt, f.shared_ffn, suffix="_shexp")
    return t


def block_tensors(f: Family, wt: Weights, block: int) -> Tensors:
    """Block ``block`` of ``f``: attn_norm, the mixer, the feed-forward, the MTP tensors."""
    t: Tensors = {"attn_norm.weight": wt.norm(HIDDEN)}
    t |= f.mixer(f, wt, block)
    t |= mixture(f, wt) if f.has_experts(block) else feed_forward(wt, f.ffn)
    if block >= f.blocks - f.nextn:
        t |= nextn(wt)
    return t


# ------------------------------------------------------------ the table

_DEEPSEEK2_KEYS: dict[str, Any] = {
    "rope.freq_base": 10000.0,
    "vocab_size": VOCAB,
    "attention.kv_lora_rank": 32,
    "attention.key_length": 32 + 8,  # kv_lora_rank + qk_rope_head_dim
    "attention.value_length": 32,
    "attention.key_length_mla": 16 + 8,  # qk_nope_head_dim + qk_rope_head_dim
    "attention.value_length_mla": 16,
    "expert_shared_count": 1,
    "rope.dimension_count": 8,
}
_DEEPSEEK2 = Family(
    "deepseek2",
    26,
    {**_DEEPSEEK2_KEYS, "leading_dense_block_count": 1},
    mixer=mla,
    head_dim=None,
    kv_heads=1,  # MLA is MQA once absorbed
    ffn=128,
    eps=1e-6,
    experts=4,
    expert_ffn=32,
    shared_ffn=32,
    lead=1,
    pre="deepseek-v3",
    title="deepseek2 lite",
)

_QWEN3NEXT_KEYS: dict[str, Any] = {
    "rope.freq_base": 10000.0,
    "rope.dimension_count": 8,
    "expert_shared_feed_forward_length": 48,
    "ssm.conv_kernel": 4,
    "ssm.state_size": 8,
    "ssm.group_count": 2,  # key heads, repeated over the value heads
    "ssm.time_step_rank": 4,  # value heads
    "ssm.inner_size": 8 * 4,  # value heads x state
    "full_attention_interval": 4,  # llama.cpp's default
}
#: The irregular per-layer pattern of ``qwen3next array`` (True: recurrent).
ARRAY_PATTERN = (True, False, True, True, True, False, False, True, True, False)
_QWEN3NEXT = Family(
    "qwen3next",
    17,
    {**_QWEN3NEXT_KEYS, "nextn_predict_layers": 1},
    mixer=gated_delta_net,
    head_dim=16,
    ffn=96,  # written as the converter does, read by nothing here
    eps=1e-6,
    experts=4,
    expert_ffn=32,
    shared_ffn=48,
    shared_gate=True,
    nextn=1,
    recurrent=tuple((block + 1) % 4 != 0 for block in range(16)),  # full attention at 3, 7, 11, 15
    pre="qwen2",
)
_LLAMA4 = Family(
    "llama4",
    17,  # stages start at 0, 4, 8 or 12; no RoPE on 3, 7, 11, 15
    {"rope.dimension_count": HEAD_DIM, "rope.freq_base": 500000.0, "interleave_moe_layer_step": 2},
    experts=4,
    expert_ffn=64,
    shared_ffn=64,
    moe_step=2,
    rope_freqs=True,
)

FAMILIES: dict[str, Family] = {
    "deepseek2": dataclasses.replace(
        _DEEPSEEK2,
        blocks=29 + 1,  # 29 trunk blocks (3 dense, 26 MoE), enough for stages of 26 and 27, and 1 MTP
        keys={
            **_DEEPSEEK2_KEYS,
            "leading_dense_block_count": 3,
            "attention.q_lora_rank": 32,
            # routed_scaling_factor, norm_topk_prob, sigmoid scoring, YaRN with
            # mscale_all_dim (written as 0.1 * mscale_all_dim)
            "expert_weights_scale": 2.5,
            "expert_weights_norm": True,
            "expert_gating_func": GATING_SIGMOID,
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": 4.0,
            "rope.scaling.original_context_length": 32,
            "rope.scaling.yarn_log_multiplier": 0.1,
            "nextn_predict_layers": 1,
        },
        lead=3,
        nextn=1,
        selection="normal",
        title="",
    ),
    "deepseek2 lite": _DEEPSEEK2,
    "glm4moe": Family(
        "glm4moe",
        7 + 1,  # 7 trunk blocks (2 dense), 1 MTP
        {
            "rope.dimension_count": 16,  # partial rotary, half the head
            "rope.freq_base": 1000000.0,
            "expert_shared_count": 1,
            "leading_dense_block_count": 2,
            "expert_weights_scale": 2.5,
            "expert_weights_norm": True,
            "expert_gating_func": GATING_SIGMOID,
            "nextn_predict_layers": 1,
        },
        head_dim=32,  # HEADS * 32 = 128 != HIDDEN
        ffn=96,
        experts=8,
        expert_ffn=32,
        shared_ffn=32,
        lead=2,
        nextn=1,
        selection="bias",
        qkv_biases=True,
        qk_norm="head",
        post_attention_norm=True,
        pre="glm4",
    ),
    "gpt-oss": Family(
        "gpt-oss",
        9,  # sliding window on 0, 2, 4, 6, 8; full attention on 1, 3, 5, 7
        {
            "attention.sliding_window": 8,
            "rope.freq_base": 150000.0,
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": 4.0,
            "rope.scaling.original_context_length": 32,
        },
        ffn=64,
        experts=4,
        expert_ffn=64,
        expert_biases=True,
        qkv_biases=True,
        sinks=True,
        post_attention_norm=True,
    ),
    "llama4 maverick": _LLAMA4,
    "llama4 scout": dataclasses.replace(
        _LLAMA4, keys={**_LLAMA4.keys, "interleave_moe_layer_step": 1}, moe_step=1
    ),
    "minimax-m2": Family(
        "minimax-m2",
        8,
        {"rope.freq_base": 5000000.0, "rope.dimension_count": 16, "expert_gating_func": GATING_SIGMOID},
        head_dim=32,  # HEADS * 32 = 128 != HIDDEN, as the real model (48 * 128 != 3072)
        ffn=32,
        eps=1e-6,
        experts=8,
        expert_ffn=32,
        selection="normal last",
        qk_norm="projection",
    ),
    "qwen3moe": Family(
        "qwen3moe",
        8,
        {"rope.freq_base": 1000000.0},
        head_dim=32,  # HEADS * 32 = 128 != HIDDEN
        ffn=96,  # the dense feed_forward_length the converter writes; unused by qwen3moe
        eps=1e-6,
        experts=8,
        expert_ffn=32,
        qk_norm="head",
        pre="qwen2",
    ),
    "qwen3next interval+mtp": _QWEN3NEXT,
    "qwen3next array": dataclasses.replace(
        _QWEN3NEXT,
        blocks=len(ARRAY_PATTERN),
        # full attention at 1, 5, 6, 9; the converter pads MTP blocks with False
        keys={**_QWEN3NEXT_KEYS, "attention.recurrent_layers": list(ARRAY_PATTERN)},
        nextn=0,
        recurrent=ARRAY_PATTERN,
    ),
    # expert_used_count stays a scalar: ggufpipe_agent/gguf/memory.py cannot read it as an array yet
    "qwen3next uniform arrays": dataclasses.replace(
        _QWEN3NEXT,
        keys={
            **_QWEN3NEXT.keys,
            "attention.head_count": [HEADS] * 17,
            "attention.head_count_kv": [KV_HEADS] * 17,
        },
    ),
}


def write_model(path: Path, name: str, seed: int = 0, metadata: dict[str, Any] | None = None) -> Path:
    """Write the model ``name`` of FAMILIES to ``path``. ``metadata`` replaces
    or adds entries (``{arch}.`` optional; a list: a per-layer array), for
    the refusals."""
    f = FAMILIES[name]
    wt = Weights(seed)
    outer = outer_tensors(wt)
    if f.rope_freqs:
        outer["rope_freqs.weight"] = wt.uniform(1.0, 8.0, HEAD_DIM // 2)
    tensors = blocks(outer, (block_tensors(f, wt, block) for block in range(f.blocks)))
    keys = f.metadata() | {key.removeprefix(f"{f.arch}."): value for key, value in (metadata or {}).items()}
    return write_gguf(path, f.arch, f"synthetic {f.title or f.arch}", keys, tensors, f.pre)
