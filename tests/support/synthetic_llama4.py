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

import numpy as np

from tests.support.synthetic import CONTEXT, FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, MERGES, VOCAB, vocabulary

ARCH = "llama4"
BLOCKS = 17  # stages start at 0, 4, 8 or 12; no RoPE on 3, 7, 11, 15
MOE_STEP = 2
EXPERTS = 4
EXPERTS_USED = 2
EXPERT_FFN = 64


def write_model(path: Path, seed: int = 0, moe_step: int = MOE_STEP, extra: dict | None = None) -> Path:
    """``extra``: more ``llama4.*`` keys (int -> uint32, float -> float32)."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch=ARCH)
    writer.add_name("synthetic llama4")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    a = ARCH
    writer.add_uint32(f"{a}.context_length", CONTEXT)
    writer.add_uint32(f"{a}.embedding_length", HIDDEN)
    writer.add_uint32(f"{a}.block_count", BLOCKS)
    writer.add_uint32(f"{a}.feed_forward_length", FFN)
    writer.add_uint32(f"{a}.attention.head_count", HEADS)
    writer.add_uint32(f"{a}.attention.head_count_kv", KV_HEADS)
    writer.add_uint32(f"{a}.attention.key_length", HEAD_DIM)
    writer.add_uint32(f"{a}.attention.value_length", HEAD_DIM)
    writer.add_uint32(f"{a}.rope.dimension_count", HEAD_DIM)
    writer.add_float32(f"{a}.rope.freq_base", 500000.0)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32(f"{a}.expert_count", EXPERTS)
    writer.add_uint32(f"{a}.expert_used_count", EXPERTS_USED)
    writer.add_uint32(f"{a}.expert_feed_forward_length", EXPERT_FFN)
    writer.add_uint32(f"{a}.interleave_moe_layer_step", moe_step)
    for key, value in (extra or {}).items():
        if isinstance(value, float):
            writer.add_float32(f"{a}.{key}", value)
        else:
            writer.add_uint32(f"{a}.{key}", value)

    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape) * (2.0 / np.sqrt(shape[-1]))

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.3 * rng.standard_normal(n)

    def put(name: str, array: np.ndarray) -> None:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    put("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)))
    put("output_norm.weight", np.ones(HIDDEN))
    put("output.weight", rng.standard_normal((VOCAB, HIDDEN)) * 0.5)
    put("rope_freqs.weight", rng.uniform(1.0, 8.0, HEAD_DIM // 2))
    for block in range(BLOCKS):
        tensors = {
            "attn_norm.weight": norm(HIDDEN),
            "attn_q.weight": w(q, HIDDEN),
            "attn_k.weight": w(kv, HIDDEN),
            "attn_v.weight": w(kv, HIDDEN),
            "attn_output.weight": w(HIDDEN, q),
            "ffn_norm.weight": norm(HIDDEN),
        }
        if moe_step > 0 and (block + 1) % moe_step == 0:  # llama_model_llama4::load_arch_tensors
            tensors |= {
                # numpy shapes are ggml's ne reversed: experts first
                "ffn_gate_inp.weight": w(EXPERTS, HIDDEN),
                "ffn_gate_exps.weight": w(EXPERTS, EXPERT_FFN, HIDDEN),
                "ffn_up_exps.weight": w(EXPERTS, EXPERT_FFN, HIDDEN),
                "ffn_down_exps.weight": w(EXPERTS, HIDDEN, EXPERT_FFN),
                "ffn_gate_shexp.weight": w(EXPERT_FFN, HIDDEN),
                "ffn_up_shexp.weight": w(EXPERT_FFN, HIDDEN),
                "ffn_down_shexp.weight": w(HIDDEN, EXPERT_FFN),
            }
        else:
            tensors |= {
                "ffn_gate.weight": w(FFN, HIDDEN),
                "ffn_up.weight": w(FFN, HIDDEN),
                "ffn_down.weight": w(HIDDEN, FFN),
            }
        for name, array in tensors.items():
            put(f"blk.{block}.{name}", array)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
