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

import numpy as np

from tests.support.synthetic import MERGES, SPECIALS, VOCAB, vocabulary

ARCH = "deepseek2"
HIDDEN = 64
HEADS = 4
Q_LORA = 32
KV_LORA = 32
ROPE_DIM = 8  # qk_rope_head_dim
NOPE_DIM = 16  # qk_nope_head_dim
K_MLA = NOPE_DIM + ROPE_DIM  # key_length_mla
V_MLA = 16  # v_head_dim
FFN = 128  # the dense blocks' feed-forward
EXPERTS = 4
EXPERTS_USED = 2
SHARED = 1
EXPERT_FFN = 32
CONTEXT = 4096

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


def write_model(path: Path, seed: int = 0, lite: bool = False) -> Path:
    """Write a synthetic deepseek2 GGUF to ``path`` (see the module docstring)."""
    import gguf

    rng = np.random.default_rng(seed)
    blocks = LITE_BLOCKS if lite else BLOCKS
    nextn = 0 if lite else NEXTN
    lead = LITE_LEADING_DENSE if lite else LEADING_DENSE
    writer = gguf.GGUFWriter(path, arch=ARCH)
    writer.add_name("synthetic deepseek2 lite" if lite else "synthetic deepseek2")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    a = ARCH
    writer.add_uint32(f"{a}.context_length", CONTEXT)
    writer.add_uint32(f"{a}.embedding_length", HIDDEN)
    writer.add_uint32(f"{a}.block_count", blocks)
    writer.add_uint32(f"{a}.feed_forward_length", FFN)
    writer.add_uint32(f"{a}.attention.head_count", HEADS)
    writer.add_uint32(f"{a}.attention.head_count_kv", 1)  # MLA is MQA once absorbed
    writer.add_float32(f"{a}.rope.freq_base", 10000.0)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_uint32(f"{a}.expert_used_count", EXPERTS_USED)
    writer.add_uint32(f"{a}.leading_dense_block_count", lead)
    writer.add_uint32(f"{a}.vocab_size", VOCAB)
    if not lite:
        writer.add_uint32(f"{a}.attention.q_lora_rank", Q_LORA)
    writer.add_uint32(f"{a}.attention.kv_lora_rank", KV_LORA)
    writer.add_uint32(f"{a}.attention.key_length", KV_LORA + ROPE_DIM)
    writer.add_uint32(f"{a}.attention.value_length", KV_LORA)
    writer.add_uint32(f"{a}.attention.key_length_mla", K_MLA)
    writer.add_uint32(f"{a}.attention.value_length_mla", V_MLA)
    writer.add_uint32(f"{a}.expert_feed_forward_length", EXPERT_FFN)
    writer.add_uint32(f"{a}.expert_count", EXPERTS)
    writer.add_uint32(f"{a}.expert_shared_count", SHARED)
    writer.add_uint32(f"{a}.rope.dimension_count", ROPE_DIM)
    if not lite:
        # DeepSeek V3: routed_scaling_factor, norm_topk_prob, sigmoid scoring,
        # YaRN with mscale_all_dim (written as 0.1 * mscale_all_dim).
        writer.add_float32(f"{a}.expert_weights_scale", 2.5)
        writer.add_bool(f"{a}.expert_weights_norm", True)
        writer.add_uint32(f"{a}.expert_gating_func", GATING_SIGMOID)
        writer.add_string(f"{a}.rope.scaling.type", "yarn")
        writer.add_float32(f"{a}.rope.scaling.factor", 4.0)
        writer.add_uint32(f"{a}.rope.scaling.original_context_length", 32)
        writer.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1)
        writer.add_uint32(f"{a}.nextn_predict_layers", nextn)

    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("deepseek-v3")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * (2.0 / np.sqrt(shape[-1]))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    def put(name: str, array: np.ndarray) -> None:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    # numpy shapes are ggml's ne reversed
    put("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    put("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    put("output.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * 0.5)
    for block in range(blocks):
        t: dict[str, np.ndarray] = {"attn_norm.weight": norm(HIDDEN)}
        if lite:
            t["attn_q.weight"] = w(HEADS * K_MLA, HIDDEN)
        else:
            t["attn_q_a.weight"] = w(Q_LORA, HIDDEN)
            t["attn_q_a_norm.weight"] = norm(Q_LORA)
            t["attn_q_b.weight"] = w(HEADS * K_MLA, Q_LORA)
        t["attn_kv_a_mqa.weight"] = w(KV_LORA + ROPE_DIM, HIDDEN)
        t["attn_kv_a_norm.weight"] = norm(KV_LORA)
        t["attn_k_b.weight"] = w(HEADS, KV_LORA, NOPE_DIM)
        t["attn_v_b.weight"] = w(HEADS, V_MLA, KV_LORA)
        t["attn_output.weight"] = w(HIDDEN, HEADS * V_MLA)
        t["ffn_norm.weight"] = norm(HIDDEN)
        if block < lead:
            t["ffn_gate.weight"] = w(FFN, HIDDEN)
            t["ffn_up.weight"] = w(FFN, HIDDEN)
            t["ffn_down.weight"] = w(HIDDEN, FFN)
        else:
            t["ffn_gate_inp.weight"] = w(EXPERTS, HIDDEN)
            if not lite:
                t["exp_probs_b.bias"] = (0.5 * rng.standard_normal(EXPERTS)).astype(np.float32)
            t["ffn_gate_exps.weight"] = w(EXPERTS, EXPERT_FFN, HIDDEN)
            t["ffn_up_exps.weight"] = w(EXPERTS, EXPERT_FFN, HIDDEN)
            t["ffn_down_exps.weight"] = w(EXPERTS, HIDDEN, EXPERT_FFN)
            t["ffn_gate_shexp.weight"] = w(EXPERT_FFN * SHARED, HIDDEN)
            t["ffn_up_shexp.weight"] = w(EXPERT_FFN * SHARED, HIDDEN)
            t["ffn_down_shexp.weight"] = w(HIDDEN, EXPERT_FFN * SHARED)
        if block >= blocks - nextn:  # the multi-token prediction block
            t["nextn.eh_proj.weight"] = w(HIDDEN, 2 * HIDDEN)
            t["nextn.enorm.weight"] = norm(HIDDEN)
            t["nextn.hnorm.weight"] = norm(HIDDEN)
            t["nextn.shared_head_norm.weight"] = norm(HIDDEN)
        for name, array in t.items():
            put(f"blk.{block}.{name}", array)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


__all__ = ["SPECIALS", "write_model"]
