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

from collections.abc import Iterable, Iterator
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
#: Experts each token is routed to, in every mixture-of-experts model here.
EXPERTS_USED = 2

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


class Weights:
    """Random tensors drawn in call order from one seeded generator, wider
    than a trained model's (see the module docstring); numpy shapes are
    ggml's ne reversed."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def w(self, *shape: int) -> np.ndarray:
        """A weight matrix (or a stack of them), scaled by its input size."""
        return self.rng.standard_normal(shape) * (2.0 / np.sqrt(shape[-1]))

    def norm(self, n: int) -> np.ndarray:
        return 1.0 + 0.3 * self.rng.standard_normal(n)

    def bias(self, *shape: int) -> np.ndarray:
        return 0.3 * self.rng.standard_normal(shape)

    def normal(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        """Standard normal values, scaled in float32."""
        return self.rng.standard_normal(shape).astype(np.float32) * scale

    def uniform(self, low: float, high: float, n: int) -> np.ndarray:
        return self.rng.uniform(low, high, n)


Tensors = dict[str, np.ndarray]


def outer_tensors(wt: Weights, hidden: int = HIDDEN) -> Tensors:
    """The token embedding, the final norm and an untied output projection."""
    return {
        "token_embd.weight": wt.normal(VOCAB, hidden),
        "output_norm.weight": np.ones(hidden),
        "output.weight": wt.normal(VOCAB, hidden, scale=0.5),
    }


def attention(wt: Weights, q: int, kv: int, hidden: int = HIDDEN, biases: bool = False) -> Tensors:
    """Separate Q/K/V projections (each with its bias if ``biases``) and the output."""
    tensors: Tensors = {}
    for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
        tensors[f"{name}.weight"] = wt.w(rows, hidden)
        if biases:
            tensors[f"{name}.bias"] = wt.bias(rows)
    tensors["attn_output.weight"] = wt.w(hidden, q)
    return tensors


def feed_forward(wt: Weights, ffn: int, hidden: int = HIDDEN, suffix: str = "") -> Tensors:
    """A gated feed-forward: ``ffn_{gate,up,down}`` (``suffix`` ``_shexp``: a shared expert)."""
    return {
        f"ffn_gate{suffix}.weight": wt.w(ffn, hidden),
        f"ffn_up{suffix}.weight": wt.w(ffn, hidden),
        f"ffn_down{suffix}.weight": wt.w(hidden, ffn),
    }


def experts(wt: Weights, count: int, ffn: int, hidden: int = HIDDEN) -> Tensors:
    """3-D expert feed-forwards ``ffn_{gate,up,down}_exps`` (experts first)."""
    return {
        "ffn_gate_exps.weight": wt.w(count, ffn, hidden),
        "ffn_up_exps.weight": wt.w(count, ffn, hidden),
        "ffn_down_exps.weight": wt.w(count, hidden, ffn),
    }


def nextn(wt: Weights, hidden: int = HIDDEN) -> Tensors:
    """A multi-token-prediction block's own tensors."""
    return {
        "nextn.eh_proj.weight": wt.w(hidden, 2 * hidden),
        "nextn.enorm.weight": wt.norm(hidden),
        "nextn.hnorm.weight": wt.norm(hidden),
        "nextn.shared_head_norm.weight": wt.norm(hidden),
    }


def add_keys(writer: Any, arch: str, keys: dict[str, Any]) -> None:
    """``keys`` under ``{arch}.``: list -> array, bool, float -> float32,
    int -> uint32, str -> string."""
    for key, value in keys.items():
        key = f"{arch}.{key}"
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)


def add_vocabulary(writer: Any, pre: str) -> list[str]:
    """The small byte-level BPE vocabulary with the pre-tokenizer ``pre``; its tokens."""
    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    return tokens


def write_gguf(
    path: Path,
    arch: str,
    name: str,
    keys: dict[str, Any],
    tensors: Iterable[tuple[str, np.ndarray]],
    pre: str = "default",
) -> Path:
    """Write one synthetic GGUF: ``keys`` (see add_keys), the small
    vocabulary, then ``tensors`` as float32, in order (a generator may draw
    them as they are written)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_keys(writer, arch, keys)
    tokens = add_vocabulary(writer, pre)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    for tensor, array in tensors:
        writer.add_tensor(tensor, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def blocks(tensors: Tensors, per_block: Iterable[Tensors]) -> Iterator[tuple[str, np.ndarray]]:
    """The model-wide ``tensors``, then each block's under ``blk.N.``."""
    yield from tensors.items()
    for block, block_tensors in enumerate(per_block):
        for tensor, array in block_tensors.items():
            yield f"blk.{block}.{tensor}", array


def _block_tensors(spec: Spec, wt: Weights) -> Tensors:
    """One block's tensors of a model of SPECS."""
    arch = spec.arch
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    if arch == "phi3":
        return {
            "attn_norm.weight": wt.norm(HIDDEN),
            "attn_qkv.weight": wt.w(q + 2 * kv, HIDDEN),
            "attn_output.weight": wt.w(HIDDEN, q),
            "ffn_norm.weight": wt.norm(HIDDEN),
            "ffn_up.weight": wt.w(2 * FFN, HIDDEN),
            "ffn_down.weight": wt.w(HIDDEN, FFN),
        }
    if arch == "gpt2":
        return {
            "attn_norm.weight": wt.norm(HIDDEN),
            "attn_norm.bias": wt.bias(HIDDEN),
            "attn_qkv.weight": wt.w(3 * HIDDEN, HIDDEN),
            "attn_qkv.bias": wt.bias(3 * HIDDEN),
            "attn_output.weight": wt.w(HIDDEN, HIDDEN),
            "attn_output.bias": wt.bias(HIDDEN),
            "ffn_norm.weight": wt.norm(HIDDEN),
            "ffn_norm.bias": wt.bias(HIDDEN),
            "ffn_up.weight": wt.w(FFN, HIDDEN),
            "ffn_up.bias": wt.bias(FFN),
            "ffn_down.weight": wt.w(HIDDEN, FFN),
            "ffn_down.bias": wt.bias(HIDDEN),
        }
    if arch == "falcon":
        return {
            "attn_norm.weight": wt.norm(HIDDEN),
            "attn_norm.bias": wt.bias(HIDDEN),
            "attn_qkv.weight": wt.w(q + 2 * kv, HIDDEN),
            "attn_output.weight": wt.w(HIDDEN, q),
            "ffn_up.weight": wt.w(FFN, HIDDEN),
            "ffn_down.weight": wt.w(HIDDEN, FFN),
        }
    tensors = {
        "attn_norm.weight": wt.norm(HIDDEN),
        **attention(wt, q, kv),
        "ffn_norm.weight": wt.norm(HIDDEN),
    }
    dense = feed_forward(wt, FFN)  # drawn for the MoE model too: its weights stay those it always had
    if spec.experts:
        tensors["ffn_gate_inp.weight"] = wt.w(spec.experts, HIDDEN)
        tensors |= experts(wt, spec.experts, FFN)
    else:
        tensors |= dense
    if arch == "qwen2":
        tensors |= {"attn_q.bias": wt.bias(q), "attn_k.bias": wt.bias(kv), "attn_v.bias": wt.bias(kv)}
    if arch in ("qwen3", "gemma3"):
        tensors |= {"attn_q_norm.weight": wt.norm(HEAD_DIM), "attn_k_norm.weight": wt.norm(HEAD_DIM)}
    if arch == "gemma3":
        tensors |= {"post_attention_norm.weight": wt.norm(HIDDEN), "post_ffw_norm.weight": wt.norm(HIDDEN)}
    return tensors


def shape_keys(
    blocks: int,
    ffn: int,
    eps: float = 1e-5,
    head_dim: int | None = None,
    kv_heads: int = KV_HEADS,
    context: int = CONTEXT,
) -> dict[str, Any]:
    """The shape every synthetic model writes: context, hidden size, blocks,
    feed-forward, heads and, if ``head_dim``, an explicit head size."""
    keys: dict[str, Any] = {
        "context_length": context,
        "embedding_length": HIDDEN,
        "block_count": blocks,
        "feed_forward_length": ffn,
        "attention.head_count": HEADS,
        "attention.head_count_kv": kv_heads,
        "attention.layer_norm_rms_epsilon": eps,
    }
    if head_dim:
        keys |= {"attention.key_length": head_dim, "attention.value_length": head_dim}
    return keys


def expert_keys(count: int, used: int, ffn: int) -> dict[str, Any]:
    """A mixture of experts: ``count`` experts of feed-forward ``ffn``, ``used`` per token."""
    return {"expert_count": count, "expert_used_count": used, "expert_feed_forward_length": ffn}


def write_model(path: Path, name: str, seed: int = 0) -> Path:
    """Write the synthetic GGUF ``name`` (a key of SPECS) to ``path``."""
    spec = SPECS[name]
    arch = spec.arch
    head_dim = HEAD_DIM if arch in ("qwen3", "gemma3", "mistral3") else None
    keys = shape_keys(spec.blocks, FFN, 1e-6 if arch == "gemma3" else 1e-5, head_dim) | spec.extra
    if arch in ("gpt2", "falcon"):  # layer norm, not RMS norm
        keys["attention.layer_norm_epsilon"] = keys.pop("attention.layer_norm_rms_epsilon")

    wt = Weights(seed)
    # Gemma multiplies token embeddings by sqrt(hidden): keep its input well
    # below the blocks' output, or the residual stays the input token and the
    # tied output predicts the same few tokens again and again.
    outer = {
        "token_embd.weight": wt.normal(VOCAB, HIDDEN, scale=0.4 / HIDDEN**0.5 if arch == "gemma3" else 1.0)
    }
    if arch == "gpt2":
        outer["position_embd.weight"] = wt.normal(CONTEXT, HIDDEN, scale=0.1)
    outer["output_norm.weight"] = np.ones(HIDDEN)
    if arch in ("gpt2", "falcon"):
        outer["output_norm.bias"] = np.zeros(HIDDEN)
    if spec.untied_output:
        outer["output.weight"] = wt.normal(VOCAB, HIDDEN, scale=0.5)
    if arch == "llama":
        # Llama 3's per-dimension RoPE frequency factors: one global tensor.
        outer["rope_freqs.weight"] = wt.uniform(1.0, 8.0, HEAD_DIM // 2)
    if arch == "phi3":
        outer["rope_factors_long.weight"] = wt.uniform(1.0, 4.0, HEAD_DIM // 2)
        outer["rope_factors_short.weight"] = wt.uniform(1.0, 1.5, HEAD_DIM // 2)
    per_block = (_block_tensors(spec, wt) for _ in range(spec.blocks))
    return write_gguf(path, arch, f"synthetic {name}", keys, blocks(outer, per_block), spec.pre)


def prompt_tokens(length: int, seed: int = 1) -> list[int]:
    """A prompt of ordinary (non-control) token ids."""
    rng = np.random.default_rng(seed)
    ordinary = VOCAB - len(SPECIALS)
    return [int(token) for token in rng.integers(0, ordinary, length)]
