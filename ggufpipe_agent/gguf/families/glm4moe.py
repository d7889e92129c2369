"""glm4moe: GLM-4.5, GLM-4.5-Air, GLM-4.6 (and Solar Open, converted as glm4moe).

What llama.cpp 0.3.36 (vendored commit 0c1e57098) derives from a block's
index or from the block count, and what a stage file of blocks ``[a, b)``
does about it:

* Leading dense blocks (``src/models/glm4-moe.cpp``: ``use_moe = i >=
  n_layer_dense_lead`` in ``load_arch_tensors``, ``il < n_layer_dense_lead``
  in the graph): block ``i`` has a dense feed-forward when its index is below
  ``glm4moe.leading_dense_block_count``. A stage file carries
  ``min(max(lead - a, 0), b - a)``, so each of its blocks is dense exactly when
  the original block is.
* Multi-token-prediction blocks (``glm4moe.nextn_predict_layers``,
  ``src/llama-model.cpp`` ``load_hparams`` and ``llama_hparams::n_layer()`` =
  ``block_count - nextn_predict_layers``): the last ``nextn`` blocks of the
  file are MTP blocks. The main graph loops ``il < n_layer`` only ("NextN
  layers are processed by graph_mtp"), and their tensors are loaded with
  ``TENSOR_SKIP`` (``llama_model_default_params().load_mtp`` is false), so the
  whole model never computes them. A stage that ends before them carries
  ``nextn_predict_layers = 0`` (else llama.cpp would take its last trunk
  block for an MTP block and skip it); the last stage keeps the original
  value and the MTP blocks, which it skips as the whole model does. A stage
  that holds MTP blocks but not the end of the model, or only MTP blocks, is
  refused (:func:`ggufpipe_agent.gguf.rules.refuse_mtp_cuts`).
* Embedding input (``graph::graph``: ``if (ubatch.embd && !use_mrope)
  GGML_ABORT``): llama.cpp aborts the process on a batch of embeddings unless
  the model has M-RoPE sections (``llama_hparams::use_mrope``: ``sections[0]
  > 0 && sections[1] > 0``). A stage fed embeddings (``a > 0``) carries
  ``glm4moe.rope.dimension_sections = [s0, s1, 0, 0]``; the rope type then is
  ``LLAMA_ROPE_TYPE_MROPE`` instead of ``NEOX`` (``llama_model_rope_type``),
  which rotates the same NeoX pairs (``ggml-cpu/ops.cpp``
  ``ggml_compute_forward_rope_flt``: ``case GGML_ROPE_TYPE_NEOX: case
  GGML_ROPE_TYPE_MROPE: rotate_pairs(n_dims, n_dims/2, ...)``) with angles from
  ``ggml_mrope_cache_init``, which starts every section's angle at its own
  position and multiplies all of them by the same ``theta_scale`` per pair, as
  ``ggml_rope_cache_init`` does. Given the positions ``[p, p, p, 0]``
  (``llm_graph_input_pos::set_input``'s expansion of text positions, which the
  stage engine writes for embeddings, 4 per token: :func:`positions_per_token`)
  the three first sections see ``p`` and the fourth, empty, is never read, so
  every angle and every rotated value is bit for bit plain NeoX RoPE at ``p``.
  The CUDA kernels agree (``ggml-cuda/rope.cu``: ``rope_neox`` and
  ``rope_multi`` both take ``pos * powf(theta_scale, i/2)``). Partial rotary
  (``rope.dimension_count`` below the head size, as GLM-4.5's 64 of 128) is
  unchanged: ``n_rot`` goes to both paths. A model that already has M-RoPE
  sections keeps them, in every stage.
* Per-layer counts: ``attention.head_count``, ``attention.head_count_kv``,
  ``expert_used_count``, ``feed_forward_length`` and
  ``expert_feed_forward_length`` may be per-layer arrays
  (``get_key_or_arr`` in ``load_hparams`` and ``load_arch_hparams``), but the
  graph and the tensor shapes read layer 0's value for every block
  (``llm_graph_context``: ``n_head(hparams.n_head())``, ``n_expert_used
  (hparams.n_expert_used())``, ``n_ff_exp()``), and a stage's layer 0 is
  another block: a split of a file where they differ between blocks is refused.
* Everything else is global and copied: Q/K/V biases, optional Q/K norms and
  the post-attention norm are block tensors; sigmoid gating (the default when
  ``expert_gating_func`` is absent), the ``exp_probs_b`` selection bias,
  ``expert_weights_norm``/``expert_weights_scale`` and the shared experts
  (``expert_shared_count``) are per block or global. The block count only
  picks a model-type label (46: GLM-4.5-Air, 92: GLM-4.5).
"""

from __future__ import annotations

from typing import Any

from ggufpipe_agent.gguf import rules
from ggufpipe_agent.gguf.rules import Architecture, Metadata, Overrides

NAME = "glm4moe"
LEAD = f"{NAME}.leading_dense_block_count"
NEXTN = f"{NAME}.nextn_predict_layers"
SECTIONS = f"{NAME}.rope.dimension_sections"
MROPE_SECTIONS = 4  # GGML_MROPE_SECTIONS


def uses_mrope(sections: Any) -> bool:
    """``llama_hparams::use_mrope`` for a ``rope.dimension_sections`` value
    (absent, a scalar that ``get_key_or_arr`` repeats 4 times, or an array)."""
    if sections is None:
        return False
    values = list(sections) if isinstance(sections, list) else [sections] * MROPE_SECTIONS
    return len(values) >= 2 and int(values[0]) > 0 and int(values[1]) > 0


def rotary_dims(get: Metadata) -> int:
    """``n_rot``: ``rope.dimension_count``, else the head size (``load_hparams``)."""
    n_rot = get(f"{NAME}.rope.dimension_count")
    if n_rot is not None:
        return int(n_rot)
    key_length = get(f"{NAME}.attention.key_length")
    if key_length is not None:
        return int(key_length)
    heads = get(f"{NAME}.attention.head_count")
    heads = heads[0] if isinstance(heads, list) else heads
    return int(get(f"{NAME}.embedding_length")) // int(heads)


def text_sections(get: Metadata) -> list[int]:
    """M-RoPE sections that make text positions plain RoPE: the rotated pairs
    split over the first two sections (both must be positive for llama.cpp to
    use M-RoPE), the fourth section empty."""
    pairs = max(2, rotary_dims(get) // 2)
    return [pairs - pairs // 2, pairs // 2, 0, 0]


def _check(get: Metadata, block_count: int, start: int, end: int, where: str) -> None:
    rules.refuse_non_uniform(NAME, get, start, end, where)
    rules.refuse_mtp_cuts(NAME, get, block_count, start, end, where)


def _overrides(get: Metadata, start: int, end: int) -> Overrides:
    import gguf

    found: Overrides = {}
    lead = get(LEAD)
    if lead is not None:
        found[LEAD] = rules.uint32(rules.leading_in(int(lead), start, end))
    block_count = int(get(f"{NAME}.block_count") or 0)
    if int(get(NEXTN) or 0) and end < block_count:
        found[NEXTN] = rules.uint32(0)  # no MTP block in this stage: all of it is trunk
    sections = get(SECTIONS)
    if uses_mrope(sections) or (start == 0 and isinstance(sections, list)):
        # The model's own sections, written again: a 4-entry array of a
        # 4-block model would otherwise be sliced as a per-layer array.
        values = list(sections) if isinstance(sections, list) else [int(sections)] * MROPE_SECTIONS
        found[SECTIONS] = ([int(v) for v in values], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    elif start > 0:
        found[SECTIONS] = (text_sections(get), gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    return found


def positions_per_token(get: Metadata) -> int:
    """``llama_hparams::n_pos_per_embd``: 4 positions per token of an
    embedding batch when the rope type is M-RoPE (the file has sections)."""
    return MROPE_SECTIONS if uses_mrope(get(SECTIONS)) else 1


ARCHITECTURE = Architecture(
    NAME,
    "synthetic GGUF (random weights: leading dense blocks, sigmoid-gated experts with a selection "
    "bias, normalised and scaled expert weights, a shared expert, Q/K/V biases, Q/K norms, partial "
    "rotary, a multi-token-prediction block); stages fed embeddings carry M-RoPE sections that equal "
    "plain RoPE for text positions; splits anywhere in the trunk",
    check=_check,
    overrides=_overrides,
    positions_per_token=positions_per_token,
)
