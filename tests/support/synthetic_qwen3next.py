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

import numpy as np

from tests.support.synthetic import CONTEXT, MERGES, VOCAB, vocabulary

ARCH = "qwen3next"
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
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
EXPERTS_USED = 2
EXPERT_FFN = 32
SHARED_FFN = 48
FFN = 96  # feed_forward_length: written as the converter does, read by nothing here

#: Trunk blocks with ``pattern="interval"`` (the MTP block comes after them).
TRUNK = 16
INTERVAL = 4  # llama.cpp's default: blocks 3, 7, 11 and 15 are full attention
#: The irregular pattern of ``pattern="array"`` (True: recurrent), its trunk.
ARRAY_PATTERN = (True, False, True, True, True, False, False, True, True, False)


def recurrent_flags(pattern: str = "interval") -> list[bool]:
    """Which trunk blocks are recurrent, as llama.cpp decides it for the whole model."""
    if pattern == "array":
        return list(ARRAY_PATTERN)
    return [(index + 1) % INTERVAL != 0 for index in range(TRUNK)]


def write_model(
    path: Path, seed: int = 0, *, pattern: str = "interval", mtp: bool = True, extra: dict | None = None
) -> Path:
    """Write the synthetic model to ``path``. ``pattern``: ``"interval"``
    (only ``full_attention_interval``) or ``"array"`` (also the per-layer
    ``attention.recurrent_layers``); ``mtp``: append one MTP block;
    ``extra``: metadata written instead of the defaults (a test of a refused shape)."""
    import gguf

    rng = np.random.default_rng(seed)
    flags = recurrent_flags(pattern)
    n_mtp = 1 if mtp else 0
    trunk = len(flags)
    blocks = trunk + n_mtp
    a = ARCH
    writer = gguf.GGUFWriter(path, arch=a)
    writer.add_name("synthetic qwen3next")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    meta: dict[str, object] = {
        f"{a}.context_length": CONTEXT,
        f"{a}.embedding_length": HIDDEN,
        f"{a}.block_count": blocks,
        f"{a}.feed_forward_length": FFN,
        f"{a}.attention.head_count": HEADS,
        f"{a}.attention.head_count_kv": KV_HEADS,
        f"{a}.attention.key_length": HEAD_DIM,
        f"{a}.attention.value_length": HEAD_DIM,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.freq_base": 10000.0,
        f"{a}.rope.dimension_count": ROPE_DIM,
        f"{a}.expert_count": EXPERTS,
        f"{a}.expert_used_count": EXPERTS_USED,
        f"{a}.expert_feed_forward_length": EXPERT_FFN,
        f"{a}.expert_shared_feed_forward_length": SHARED_FFN,
        f"{a}.ssm.conv_kernel": SSM_CONV,
        f"{a}.ssm.state_size": SSM_STATE,
        f"{a}.ssm.group_count": SSM_K_HEADS,
        f"{a}.ssm.time_step_rank": SSM_V_HEADS,
        f"{a}.ssm.inner_size": SSM_INNER,
        f"{a}.full_attention_interval": INTERVAL,
    }
    if mtp:
        meta[f"{a}.nextn_predict_layers"] = n_mtp
    if pattern == "array":
        # the converter pads the MTP blocks with False (full attention)
        meta[f"{a}.attention.recurrent_layers"] = flags + [False] * n_mtp
    meta.update(extra or {})
    for key, value in meta.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))  # type: ignore[call-overload]

    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)

    def w(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)) * (2.0 / np.sqrt(cols))

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.3 * rng.standard_normal(n)

    def put(name: str, array: np.ndarray) -> None:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    put("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)))
    put("output_norm.weight", np.ones(HIDDEN))
    put("output.weight", rng.standard_normal((VOCAB, HIDDEN)) * 0.5)

    key_dim, value_dim = SSM_STATE * SSM_K_HEADS, SSM_STATE * SSM_V_HEADS
    for block in range(blocks):
        b = f"blk.{block}"
        put(f"{b}.attn_norm.weight", norm(HIDDEN))
        put(f"{b}.post_attention_norm.weight", norm(HIDDEN))
        if block < trunk and flags[block]:
            # gated delta net: fused q|k|v and the z gate (the converter's split of
            # in_proj_qkvz), the causal conv, dt bias, A (= -exp(A_log)), beta|alpha
            put(f"{b}.attn_qkv.weight", w(2 * key_dim + value_dim, HIDDEN))
            put(f"{b}.attn_gate.weight", w(value_dim, HIDDEN))
            put(f"{b}.ssm_conv1d.weight", rng.standard_normal((2 * key_dim + value_dim, SSM_CONV)) * 0.6)
            put(f"{b}.ssm_dt.bias", 0.5 * rng.standard_normal(SSM_V_HEADS))
            put(f"{b}.ssm_a", -rng.uniform(0.2, 1.5, SSM_V_HEADS))
            put(f"{b}.ssm_ba.weight", w(2 * SSM_V_HEADS, HIDDEN))
            put(f"{b}.ssm_norm.weight", norm(SSM_STATE))
            put(f"{b}.ssm_out.weight", w(HIDDEN, value_dim))
        else:
            # full attention: a query and its gate per head, Q/K RMS norms
            put(f"{b}.attn_q.weight", w(2 * HEADS * HEAD_DIM, HIDDEN))
            put(f"{b}.attn_k.weight", w(KV_HEADS * HEAD_DIM, HIDDEN))
            put(f"{b}.attn_v.weight", w(KV_HEADS * HEAD_DIM, HIDDEN))
            put(f"{b}.attn_output.weight", w(HIDDEN, HEADS * HEAD_DIM))
            put(f"{b}.attn_q_norm.weight", norm(HEAD_DIM))
            put(f"{b}.attn_k_norm.weight", norm(HEAD_DIM))
        put(f"{b}.ffn_gate_inp.weight", w(EXPERTS, HIDDEN))
        put(f"{b}.ffn_gate_exps.weight", np.stack([w(EXPERT_FFN, HIDDEN) for _ in range(EXPERTS)]))
        put(f"{b}.ffn_up_exps.weight", np.stack([w(EXPERT_FFN, HIDDEN) for _ in range(EXPERTS)]))
        put(f"{b}.ffn_down_exps.weight", np.stack([w(HIDDEN, EXPERT_FFN) for _ in range(EXPERTS)]))
        put(f"{b}.ffn_gate_inp_shexp.weight", rng.standard_normal(HIDDEN) * (2.0 / np.sqrt(HIDDEN)))
        put(f"{b}.ffn_gate_shexp.weight", w(SHARED_FFN, HIDDEN))
        put(f"{b}.ffn_up_shexp.weight", w(SHARED_FFN, HIDDEN))
        put(f"{b}.ffn_down_shexp.weight", w(HIDDEN, SHARED_FFN))
        if block >= trunk:
            # the MTP head: llama.cpp loads it only for an MTP draft context
            put(f"{b}.nextn.eh_proj.weight", w(HIDDEN, 2 * HIDDEN))
            put(f"{b}.nextn.enorm.weight", norm(HIDDEN))
            put(f"{b}.nextn.hnorm.weight", norm(HIDDEN))
            put(f"{b}.nextn.shared_head_norm.weight", norm(HIDDEN))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
