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

import numpy as np

from tests.support.synthetic import MERGES, VOCAB, vocabulary

ARCH = "glm4moe"
TRUNK = 7  # blocks the whole model computes
NEXTN = 1  # multi-token-prediction blocks after them
BLOCKS = TRUNK + NEXTN  # block_count
LEAD = 2  # leading dense blocks
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32  # explicit key_length: HEADS * HEAD_DIM = 128 != HIDDEN
ROTARY = 16  # rope.dimension_count: partial rotary, half the head
EXPERTS = 8
EXPERTS_USED = 2
SHARED = 1
EXPERT_FFN = 32
FFN = 96
CONTEXT = 4096


def write_model(path: Path, seed: int = 0, metadata: dict[str, Any] | None = None) -> Path:
    """Write the synthetic model to ``path``. ``metadata`` replaces or adds
    ``glm4moe.*`` entries (a list: a per-layer uint32 array), for the refusals."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch=ARCH)
    writer.add_name("synthetic glm4moe")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    keys: dict[str, Any] = {
        "context_length": CONTEXT,
        "embedding_length": HIDDEN,
        "block_count": BLOCKS,
        "feed_forward_length": FFN,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.dimension_count": ROTARY,
        "rope.freq_base": 1000000.0,
        "expert_count": EXPERTS,
        "expert_used_count": EXPERTS_USED,
        "expert_shared_count": SHARED,
        "expert_feed_forward_length": EXPERT_FFN,
        "leading_dense_block_count": LEAD,
        "expert_weights_scale": 2.5,
        "expert_weights_norm": True,
        "expert_gating_func": 2,  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        "nextn_predict_layers": NEXTN,
    }
    keys.update(metadata or {})
    for key, value in keys.items():
        name = f"{ARCH}.{key}"
        if isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_string(name, value)

    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("glm4")
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

    def bias(n: int) -> np.ndarray:
        return (0.3 * rng.standard_normal(n)).astype(np.float32)

    def put(name: str, array: np.ndarray) -> None:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shexp = EXPERT_FFN * SHARED
    put("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    put("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    put("output.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * 0.5)
    for block in range(BLOCKS):
        # numpy shapes are ggml's ne reversed: {n_embd, n_expert} -> (E, H)
        tensors = {
            "attn_norm.weight": norm(HIDDEN),
            "attn_q.weight": w(q, HIDDEN),
            "attn_q.bias": bias(q),
            "attn_k.weight": w(kv, HIDDEN),
            "attn_k.bias": bias(kv),
            "attn_v.weight": w(kv, HIDDEN),
            "attn_v.bias": bias(kv),
            "attn_output.weight": w(HIDDEN, q),
            "attn_q_norm.weight": norm(HEAD_DIM),
            "attn_k_norm.weight": norm(HEAD_DIM),
            "post_attention_norm.weight": norm(HIDDEN),
        }
        if block < LEAD:
            tensors |= {
                "ffn_gate.weight": w(FFN, HIDDEN),
                "ffn_up.weight": w(FFN, HIDDEN),
                "ffn_down.weight": w(HIDDEN, FFN),
            }
        else:
            tensors |= {
                "ffn_gate_inp.weight": w(EXPERTS, HIDDEN),
                "exp_probs_b.bias": bias(EXPERTS),
                "ffn_gate_exps.weight": w(EXPERTS, EXPERT_FFN, HIDDEN),
                "ffn_up_exps.weight": w(EXPERTS, EXPERT_FFN, HIDDEN),
                "ffn_down_exps.weight": w(EXPERTS, HIDDEN, EXPERT_FFN),
                "ffn_gate_shexp.weight": w(shexp, HIDDEN),
                "ffn_up_shexp.weight": w(shexp, HIDDEN),
                "ffn_down_shexp.weight": w(HIDDEN, shexp),
            }
        if block >= TRUNK:
            tensors |= {
                "nextn.eh_proj.weight": w(HIDDEN, 2 * HIDDEN),
                "nextn.enorm.weight": norm(HIDDEN),
                "nextn.hnorm.weight": norm(HIDDEN),
                "nextn.shared_head_norm.weight": norm(HIDDEN),
            }
        for name, array in tensors.items():
            put(f"blk.{block}.{name}", array)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
