"""Tiny synthetic GGUF models for the architecture tests.

Each file has the metadata layout and tensor names that llama.cpp expects
for its architecture (read from llama.cpp 0.3.36's ``src/models/<arch>.cpp``),
random float32 weights, and a small but valid byte-level BPE vocabulary
(``gpt2`` tokenizer: 256 byte tokens, a few merges, control tokens), so that
llama.cpp loads it like a real model. The dimensions are tiny (hidden 64,
4 query heads over 2 KV heads, a few blocks) so a test can run a whole model
and several split chains in seconds.

The weights are drawn wider than a trained model's so that greedy decoding
of random weights keeps changing tokens for many steps instead of locking
onto one: a test that compares 64 identical tokens proves little.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
FFN = 128
CONTEXT = 4096

#: Control tokens appended after the byte and merge tokens. llama.cpp looks
#: up <s>, </s> and <unk> by text when the model name contains "phi3".
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<unk>")
MERGES = ("Ġ t", "h e", "i n", "Ġ a", "e r", "o n", "Ġt he", "r e")


@dataclass(frozen=True)
class Spec:
    """What to write for one architecture."""

    arch: str
    blocks: int
    #: Write output.weight (False: tied to token_embd, as in small Qwen/Gemma models).
    untied_output: bool = True
    #: Extra metadata under ``{arch}.``: float -> float32, int -> uint32, str, bool.
    extra: dict[str, Any] = field(default_factory=dict)
    pre: str = "default"
    #: Mixture-of-experts feed-forward (Mixtral layout) with this many experts.
    experts: int = 0


SPECS: dict[str, Spec] = {
    # Llama 3 style: RoPE frequency factors (rope_freqs.weight), untied output.
    "llama": Spec("llama", 7, pre="llama-bpe", extra={"rope.freq_base": 500000.0}),
    # Mixtral: the llama architecture with a mixture-of-experts feed-forward.
    "llama-moe": Spec(
        "llama",
        7,
        extra={"rope.freq_base": 1000000.0, "expert_count": 4, "expert_used_count": 2},
        experts=4,
    ),
    # Qwen2/2.5: Q/K/V biases, tied output (as Qwen2.5 0.5B).
    "qwen2": Spec("qwen2", 7, untied_output=False, pre="qwen2", extra={"rope.freq_base": 1000000.0}),
    # Qwen3: Q/K RMS norms, explicit head size.
    "qwen3": Spec("qwen3", 7, pre="qwen2", extra={"rope.freq_base": 1000000.0}),
    # Ministral 3 / Mistral Small 3.x text model: YaRN RoPE and Llama-4 attention
    # temperature scaling, whose floor scale (the original context, 32 here) the
    # test's positions cross several times.
    "mistral3": Spec(
        "mistral3",
        7,
        pre="tekken",
        extra={
            "rope.freq_base": 1000000.0,
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": 4.0,
            "rope.scaling.original_context_length": 32,
            "rope.scaling.yarn_log_multiplier": 1.0,
            "attention.temperature_scale": 0.5,
        },
    ),
    # Phi-3/Phi-4: fused QKV, fused gate+up FFN, LongRoPE factor tensors; the
    # long factors are in use because the test context exceeds the original one.
    "phi3": Spec(
        "phi3",
        7,
        extra={
            "rope.freq_base": 10000.0,
            "rope.scaling.original_context_length": 64,
            "rope.dimension_count": HEAD_DIM,
            "attention.sliding_window": 2047,  # as Phi-3 mini writes it; llama.cpp ignores it
        },
    ),
    # Gemma 3: a sliding window of 8 positions (so sliding and global blocks
    # differ within a short test), the default period 6 (blocks 5 and 11 are
    # global), separate RoPE bases, final logit softcapping, tied output.
    "gemma3": Spec(
        "gemma3",
        13,
        untied_output=False,
        extra={
            "rope.freq_base": 1000000.0,
            "rope.freq_base_swa": 10000.0,
            "attention.sliding_window": 8,
            "final_logit_softcapping": 30.0,
        },
    ),
    # Not accepted: only needs to be recognisable as a GGUF of that architecture.
    "gpt2": Spec("gpt2", 3, pre="gpt-2"),
    "falcon": Spec("falcon", 3, pre="falcon"),
}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = {byte: byte for byte in visible}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return [chr(chars[byte]) for byte in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens and token types: 256 byte tokens, one per merge, then control tokens."""
    tokens = _bytes_to_unicode()
    tokens += [merge.replace(" ", "") for merge in MERGES]
    types = [1] * len(tokens)  # normal
    tokens += list(SPECIALS)
    types += [3] * len(SPECIALS)  # control
    return tokens, types


VOCAB = len(vocabulary()[0])


def _block_tensors(spec: Spec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One block's tensors, numpy shapes (ggml ne reversed)."""
    arch = spec.arch

    def w(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * (2.0 / np.sqrt(cols))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (0.3 * rng.standard_normal(n)).astype(np.float32)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    if arch == "phi3":
        return {
            "attn_norm.weight": norm(HIDDEN),
            "attn_qkv.weight": w(q + 2 * kv, HIDDEN),
            "attn_output.weight": w(HIDDEN, q),
            "ffn_norm.weight": norm(HIDDEN),
            "ffn_up.weight": w(2 * FFN, HIDDEN),
            "ffn_down.weight": w(HIDDEN, FFN),
        }
    if arch == "gpt2":
        return {
            "attn_norm.weight": norm(HIDDEN),
            "attn_norm.bias": bias(HIDDEN),
            "attn_qkv.weight": w(3 * HIDDEN, HIDDEN),
            "attn_qkv.bias": bias(3 * HIDDEN),
            "attn_output.weight": w(HIDDEN, HIDDEN),
            "attn_output.bias": bias(HIDDEN),
            "ffn_norm.weight": norm(HIDDEN),
            "ffn_norm.bias": bias(HIDDEN),
            "ffn_up.weight": w(FFN, HIDDEN),
            "ffn_up.bias": bias(FFN),
            "ffn_down.weight": w(HIDDEN, FFN),
            "ffn_down.bias": bias(HIDDEN),
        }
    if arch == "falcon":
        return {
            "attn_norm.weight": norm(HIDDEN),
            "attn_norm.bias": bias(HIDDEN),
            "attn_qkv.weight": w(q + 2 * kv, HIDDEN),
            "attn_output.weight": w(HIDDEN, q),
            "ffn_up.weight": w(FFN, HIDDEN),
            "ffn_down.weight": w(HIDDEN, FFN),
        }
    tensors = {
        "attn_norm.weight": norm(HIDDEN),
        "attn_q.weight": w(q, HIDDEN),
        "attn_k.weight": w(kv, HIDDEN),
        "attn_v.weight": w(kv, HIDDEN),
        "attn_output.weight": w(HIDDEN, q),
        "ffn_norm.weight": norm(HIDDEN),
        "ffn_gate.weight": w(FFN, HIDDEN),
        "ffn_up.weight": w(FFN, HIDDEN),
        "ffn_down.weight": w(HIDDEN, FFN),
    }
    if spec.experts:
        for name in ("ffn_gate", "ffn_up", "ffn_down"):
            del tensors[f"{name}.weight"]
        e = spec.experts
        tensors |= {
            "ffn_gate_inp.weight": w(e, HIDDEN),
            "ffn_gate_exps.weight": np.stack([w(FFN, HIDDEN) for _ in range(e)]),
            "ffn_up_exps.weight": np.stack([w(FFN, HIDDEN) for _ in range(e)]),
            "ffn_down_exps.weight": np.stack([w(HIDDEN, FFN) for _ in range(e)]),
        }
    if arch == "qwen2":
        tensors |= {"attn_q.bias": bias(q), "attn_k.bias": bias(kv), "attn_v.bias": bias(kv)}
    if arch in ("qwen3", "gemma3"):
        tensors |= {"attn_q_norm.weight": norm(HEAD_DIM), "attn_k_norm.weight": norm(HEAD_DIM)}
    if arch == "gemma3":
        tensors |= {"post_attention_norm.weight": norm(HIDDEN), "post_ffw_norm.weight": norm(HIDDEN)}
    return tensors


def write_model(path: Path, name: str, seed: int = 0) -> Path:
    """Write the synthetic GGUF ``name`` (a key of SPECS) to ``path``."""
    import gguf

    spec = SPECS[name]
    arch = spec.arch
    n_blocks = spec.blocks
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_name(f"synthetic {name}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    a = arch
    writer.add_uint32(f"{a}.context_length", CONTEXT)
    writer.add_uint32(f"{a}.embedding_length", HIDDEN)
    writer.add_uint32(f"{a}.block_count", n_blocks)
    writer.add_uint32(f"{a}.feed_forward_length", FFN)
    writer.add_uint32(f"{a}.attention.head_count", HEADS)
    writer.add_uint32(f"{a}.attention.head_count_kv", KV_HEADS)
    if arch in ("gpt2", "falcon"):
        writer.add_float32(f"{a}.attention.layer_norm_epsilon", 1e-5)
    else:
        writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6 if arch == "gemma3" else 1e-5)
    if arch in ("qwen3", "gemma3", "mistral3"):
        writer.add_uint32(f"{a}.attention.key_length", HEAD_DIM)
        writer.add_uint32(f"{a}.attention.value_length", HEAD_DIM)
    for key, value in spec.extra.items():
        name = f"{a}.{key}"
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_string(name, value)

    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)

    def emb(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)).astype(np.float32)

    def put(name: str, array: np.ndarray) -> None:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    # Gemma multiplies token embeddings by sqrt(hidden): keep its input well
    # below the blocks' output, or the residual stays the input token and the
    # tied output predicts the same few tokens again and again.
    put("token_embd.weight", emb(VOCAB, HIDDEN) * (0.4 / HIDDEN**0.5 if arch == "gemma3" else 1.0))
    if arch == "gpt2":
        put("position_embd.weight", emb(CONTEXT, HIDDEN) * 0.1)
    put("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    if arch in ("gpt2", "falcon"):
        put("output_norm.bias", np.zeros(HIDDEN, dtype=np.float32))
    if spec.untied_output:
        put("output.weight", emb(VOCAB, HIDDEN) * 0.5)
    if arch == "llama":
        # Llama 3's per-dimension RoPE frequency factors: one global tensor.
        put("rope_freqs.weight", rng.uniform(1.0, 8.0, HEAD_DIM // 2).astype(np.float32))
    if arch == "phi3":
        half = HEAD_DIM // 2
        put("rope_factors_long.weight", rng.uniform(1.0, 4.0, half).astype(np.float32))
        put("rope_factors_short.weight", rng.uniform(1.0, 1.5, half).astype(np.float32))
    for block in range(n_blocks):
        for tensor, array in _block_tensors(spec, rng).items():
            put(f"blk.{block}.{tensor}", array)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def prompt_tokens(length: int, seed: int = 1) -> list[int]:
    """A prompt of ordinary (non-control) token ids."""
    rng = np.random.default_rng(seed)
    ordinary = VOCAB - len(SPECIALS)
    return [int(token) for token in rng.integers(0, ordinary, length)]
