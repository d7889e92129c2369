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

import numpy as np

from tests.support.synthetic import CONTEXT, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, MERGES, VOCAB, vocabulary

ARCH = "gpt-oss"
BLOCKS = 9  # sliding window on 0, 2, 4, 6, 8; full attention on 1, 3, 5, 7
EXPERTS = 4
EXPERTS_USED = 2
EXPERT_FFN = 64
WINDOW = 8


def write_model(path: Path, seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch=ARCH)
    writer.add_name("synthetic gpt-oss")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    a = ARCH
    writer.add_uint32(f"{a}.context_length", CONTEXT)
    writer.add_uint32(f"{a}.embedding_length", HIDDEN)
    writer.add_uint32(f"{a}.block_count", BLOCKS)
    writer.add_uint32(f"{a}.feed_forward_length", EXPERT_FFN)
    writer.add_uint32(f"{a}.attention.head_count", HEADS)
    writer.add_uint32(f"{a}.attention.head_count_kv", KV_HEADS)
    writer.add_uint32(f"{a}.attention.key_length", HEAD_DIM)
    writer.add_uint32(f"{a}.attention.value_length", HEAD_DIM)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32(f"{a}.attention.sliding_window", WINDOW)
    writer.add_uint32(f"{a}.expert_count", EXPERTS)
    writer.add_uint32(f"{a}.expert_used_count", EXPERTS_USED)
    writer.add_uint32(f"{a}.expert_feed_forward_length", EXPERT_FFN)
    writer.add_float32(f"{a}.rope.freq_base", 150000.0)
    writer.add_string(f"{a}.rope.scaling.type", "yarn")
    writer.add_float32(f"{a}.rope.scaling.factor", 4.0)
    writer.add_uint32(f"{a}.rope.scaling.original_context_length", 32)

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

    def bias(*shape: int) -> np.ndarray:
        return 0.3 * rng.standard_normal(shape)

    def put(name: str, array: np.ndarray) -> None:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    put("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)))
    put("output_norm.weight", np.ones(HIDDEN))
    put("output.weight", rng.standard_normal((VOCAB, HIDDEN)) * 0.5)
    for block in range(BLOCKS):
        tensors = {
            "attn_norm.weight": norm(HIDDEN),
            "attn_q.weight": w(q, HIDDEN),
            "attn_q.bias": bias(q),
            "attn_k.weight": w(kv, HIDDEN),
            "attn_k.bias": bias(kv),
            "attn_v.weight": w(kv, HIDDEN),
            "attn_v.bias": bias(kv),
            "attn_output.weight": w(HIDDEN, q),
            "attn_output.bias": bias(HIDDEN),
            "attn_sinks.weight": rng.standard_normal(HEADS),
            "post_attention_norm.weight": norm(HIDDEN),
            # numpy shapes are ggml's ne reversed: experts first
            "ffn_gate_inp.weight": w(EXPERTS, HIDDEN),
            "ffn_gate_inp.bias": bias(EXPERTS),
            "ffn_gate_exps.weight": w(EXPERTS, EXPERT_FFN, HIDDEN),
            "ffn_gate_exps.bias": bias(EXPERTS, EXPERT_FFN),
            "ffn_up_exps.weight": w(EXPERTS, EXPERT_FFN, HIDDEN),
            "ffn_up_exps.bias": bias(EXPERTS, EXPERT_FFN),
            "ffn_down_exps.weight": w(EXPERTS, HIDDEN, EXPERT_FFN),
            "ffn_down_exps.bias": bias(EXPERTS, HIDDEN),
        }
        for name, array in tensors.items():
            put(f"blk.{block}.{name}", array)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
