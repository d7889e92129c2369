"""Qwen3-Next (``qwen3next``): gated-delta-net (recurrent) and full-attention
blocks, a mixture of experts with a gated shared expert, an optional MTP head.

What llama.cpp 0.3.36 derives from a block's index or from the block count
(line numbers of the vendored llama.cpp sources of llama-cpp-python 0.3.36),
and what a stage file does about it:

* **Recurrent or attention, by index.** ``llama_model_qwen3next::load_arch_hparams``
  (``src/models/qwen3next.cpp:17-23``) reads the per-layer array
  ``qwen3next.attention.recurrent_layers`` if there is one, else marks block
  ``i`` recurrent when ``(i + 1) % interval != 0`` (``qwen3next.full_attention_interval``,
  default 4) and ``i < n_layer()``.
  A stage file always carries its slice of the whole model's pattern as that
  per-layer bool array (the stage writer slices an array the source has; for
  a source with only the interval, :func:`_overrides` writes it), so every
  block keeps its kind wherever the cut falls. The kind also picks the
  block's tensors (``attn_qkv``/``attn_gate``/``ssm_*`` or ``attn_q``/``k``/``v``
  with Q/K norms), so a wrong pattern fails to load rather than computing
  something else.
* **The MTP (NextN) blocks** are the last ``qwen3next.nextn_predict_layers``
  blocks (``src/llama-model.cpp:1329``; ``llama_hparams::n_layer() =
  n_layer_all - n_layer_nextn``, ``src/llama-hparams.cpp:348``). The main
  graph runs blocks ``0 .. n_layer()-1`` only (``src/models/qwen3next.cpp:151``:
  "MTP/NextN layers are loaded as extra decoder blocks but not executed in the
  main pass"); their tensors are skipped at load unless an MTP draft context
  asks for them (``mtp_flags = TENSOR_SKIP``, ``qwen3next.cpp:40``), and the
  hybrid memory filters them out (``il < hparams.n_layer()`` in
  ``create_memory``, ``src/llama-model.cpp:2698-2705``). A stage file says how
  many MTP blocks it holds: 0 in every stage but the last (else its own last
  trunk blocks would be taken for MTP blocks), the source's count in the last
  stage, which keeps the MTP tensors and ignores them as the whole model
  does. A stage of MTP blocks only, or a cut between MTP blocks, is refused:
  such a stage would run no block of the main pass.
* **Per-layer counts read as one value.** ``llama_model::load_hparams``
  (``src/llama-model.cpp:1333, 1395-1404``) reads
  ``attention.head_count``, ``attention.head_count_kv``, ``feed_forward_length``
  and ``expert_used_count`` (and ``load_arch_hparams`` ``expert_feed_forward_length``)
  as scalar-or-per-layer arrays, but the graph uses block 0's value for every
  block (``LLAMA_LOAD_LOCALS``, ``src/llama-model.h:864-877``: ``hparams.n_head()``,
  ``n_head_kv()``, ``n_expert_used()``, ``n_ff()``; ``qwen3next.cpp:53``
  ``n_ff_exp()``; ``llm_graph_context``, ``src/llama-graph.cpp:1470-1477``:
  ``n_head``, ``n_expert_used``), and the head size defaults to
  ``n_embd / n_head(0)`` (``src/llama-model.cpp:1439``). A
  stage's block 0 is another block of the original, so a file whose arrays
  are not uniform is refused for any split (uniform arrays are sliced and fine).
* **Every stage needs a block of each kind.** The hybrid memory gives the
  attention cache the non-recurrent trunk blocks and the recurrent state the
  recurrent ones (``create_memory``: ``filter_attn`` / ``filter_recr``), and
  ``llm_graph_input_mem_hybrid::set_input`` (``src/llama-graph.cpp:1094-1111``) fills
  the inputs of both: the KV indices of a cache without layers, or the
  state-copy indices of a state without layers, are tensors no graph node
  uses, left without a buffer, and ``ggml_backend_buffer_is_host`` aborts the
  process (``GGML_ASSERT(buffer) failed``, ggml-backend.cpp:205) at the first
  decode. A stage whose trunk blocks are all recurrent or all full attention
  is refused. With the default interval 4 any stage of at least 4 trunk
  blocks is fine; the smallest stage is 2 blocks (one of each kind).
* The block count only picks a model-type label (48 -> ``LLM_TYPE_80B_A3B``,
  ``qwen3next.cpp:26``) that no computation reads. Token embeddings are not scaled
  (``build_inp_embd``), so a stage fed activations gets them as they are; the
  final norm and ``output.weight`` are used by the last stage only.

Prefix reuse: the gated-delta-net state holds one position (the last one), and
``llama_memory_recurrent::seq_rm`` cannot drop a partial suffix (no per-token
snapshots in a context with ``n_rs_seq = 0``), so a stage keeps its whole state
or nothing (``src/llama-memory-recurrent.cpp:161-204``).
``llama_memory_seq_pos_min`` of the hybrid memory is the recurrent state's
last position (``src/llama-memory-hybrid.cpp:172-175``), so
``StageEngine.keepable`` keeps nothing today (its reason wrongly names a
sliding window); keeping the whole state needs the engine to know it.
"""

from __future__ import annotations

from ggufpipe_agent.errors import ModelError, UnsupportedArchitecture
from ggufpipe_agent.gguf import rules
from ggufpipe_agent.gguf.rules import Architecture, Metadata, Overrides

ARCH = "qwen3next"
#: llama_model_qwen3next::load_arch_hparams: ``uint32_t full_attn_interval = 4``.
DEFAULT_FULL_ATTENTION_INTERVAL = 4
PATTERN_KEY = f"{ARCH}.attention.recurrent_layers"
NEXTN_KEY = f"{ARCH}.nextn_predict_layers"
INTERVAL_KEY = f"{ARCH}.full_attention_interval"
#: Per-layer arrays llama.cpp reads, of which the graph uses block 0's value everywhere.
UNIFORM_KEYS = tuple(f"{ARCH}.{key}" for key in rules.LAYER0_KEYS)


def _nextn(get: Metadata) -> int:
    return int(get(NEXTN_KEY) or 0)


def recurrent_flags(get: Metadata, start: int, end: int) -> list[bool]:
    """Which of the original blocks ``start..end-1`` are recurrent (gated delta
    net), as llama.cpp decides it for the whole model."""
    pattern = get(PATTERN_KEY)
    if isinstance(pattern, list):
        return [bool(flag) for flag in pattern[start:end]]
    n_layer = int(get(f"{ARCH}.block_count")) - _nextn(get)
    interval = get(INTERVAL_KEY)
    interval = DEFAULT_FULL_ATTENTION_INTERVAL if interval is None else int(interval)
    if interval <= 0:
        raise ModelError(f"{ARCH}.full_attention_interval is {interval}; llama.cpp divides by it")
    return [index < n_layer and (index + 1) % interval != 0 for index in range(start, end)]


def _overrides(get: Metadata, start: int, end: int) -> Overrides:
    overrides: Overrides = {}
    if not isinstance(get(PATTERN_KEY), list):
        # Only the interval: the stage's blocks would be classified by their new
        # index; carry the original pattern's slice (read in preference to it).
        overrides[PATTERN_KEY] = rules.bool_array(recurrent_flags(get, start, end))
    nextn = _nextn(get)
    if nextn:
        block_count = int(get(f"{ARCH}.block_count"))
        overrides[NEXTN_KEY] = rules.uint32(rules.trailing_in(nextn, block_count, start, end))
    return overrides


def _check(get: Metadata, block_count: int, start: int, end: int, where: str) -> None:
    span = rules.span(ARCH, start, end)
    pattern = get(PATTERN_KEY)
    if pattern is not None and (not isinstance(pattern, list) or len(pattern) != block_count):
        raise ModelError(
            f"{where}: {PATTERN_KEY} has {len(pattern) if hasattr(pattern, '__len__') else 'no'} "
            f"entries for {block_count} blocks; cannot tell which blocks of a stage are recurrent"
        )
    rules.refuse_non_uniform(ARCH, get, start, end, where)
    if pattern is None:
        interval = get(INTERVAL_KEY)
        if interval is not None and int(interval) <= 0:
            raise ModelError(f"{where}: {INTERVAL_KEY} is {interval}; llama.cpp divides by it")
    rules.refuse_mtp_cuts(ARCH, get, block_count, start, end, where)
    n_layer = block_count - _nextn(get)
    if get(f"{ARCH}.ssm.conv_kernel") is None:
        return  # only the model facts of a plan: the agents check again from the file
    flags = recurrent_flags(get, start, min(end, n_layer))
    if all(flags) or not any(flags):
        kind = "recurrent (gated delta net)" if any(flags) else "full-attention"
        other = "full-attention" if any(flags) else "recurrent"
        raise UnsupportedArchitecture(
            f"{where}: {span}: its blocks are all {kind}; llama.cpp's hybrid memory then has "
            f"no {other} layer, and decoding aborts the process (GGML_ASSERT(buffer) in "
            f"llm_graph_input_mem_hybrid::set_input); every stage needs at least one "
            f"full-attention and one recurrent block"
        )


ARCHITECTURE = Architecture(
    ARCH,
    "synthetic GGUF (random weights: gated-delta-net and gated full-attention blocks, MoE with "
    "a gated shared expert, an MTP block; the recurrent pattern by interval and by array); "
    "splits anywhere in the trunk, off the pattern; every stage needs a block of each kind "
    "(llama.cpp aborts otherwise); an MTP-only stage is refused; Qwen3-Next-80B-A3B",
    check=_check,
    overrides=_overrides,
)
