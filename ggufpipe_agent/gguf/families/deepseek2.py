"""deepseek2: DeepSeek V2 / V2.5 / V3 / R1 / V3.1, Kimi K2, GLM-4.7-Flash, ...

Multi-head latent attention, MoE blocks with shared experts after leading
dense blocks, optional multi-token prediction (MTP, "NextN") blocks appended
after the trunk. Read from llama.cpp 0.3.36 (vendored commit 0c1e57098):
``src/models/deepseek2.cpp`` (``load_arch_hparams``, ``load_arch_tensors``,
``graph::graph``), ``src/llama-model.cpp`` (``load_hparams``: the generic keys;
``create_memory``: the KV cache), ``src/llama-hparams.cpp``. What llama.cpp
derives from the block index or the block count, and what a stage file of
blocks ``[a, b)`` does about it:

* **Dense or MoE** by index: ``i < n_layer_dense_lead`` (deepseek2.cpp:126
  in load_arch_tensors, deepseek2.cpp:646 in the graph), from
  ``leading_dense_block_count`` (deepseek2.cpp:11). The stage file carries it clamped to the
  stage, ``min(max(lead - a, 0), b - a)``.
* **MTP blocks**: ``n_layer() = block_count - nextn_predict_layers``
  (llama-hparams.cpp:349, the key read at llama-model.cpp:1329); the graph
  runs blocks ``0 .. n_layer()-1`` only (deepseek2.cpp:465), the MTP
  blocks' tensors are created with ``TENSOR_SKIP`` unless a draft context
  asks for them (deepseek2.cpp:63-66, ``ml.load_mtp`` false for an ordinary
  model) and the KV cache leaves them out (llama-model.cpp:2802).
  So the whole model ignores them. A stage file carries
  ``nextn_predict_layers`` = the MTP blocks inside the stage: 0 for every
  stage before them (copying the model's count would silently drop a
  stage's last blocks), the model's count for the stage that holds them.
  MTP blocks are the model's last blocks, so only the last stage can hold
  them; a cut between two MTP blocks (the first stage's capture point,
  its last block, would never run), or a stage of MTP blocks only (it runs
  no block, and llama.cpp aborts the process on it: ggml-backend.cpp
  "tensor buffer not set", tried), is refused: end the trunk's last stage
  at the model's last block instead.
* **"Lite"** by the trunk's block count: ``is_lite = n_layer() == 27 ||
  n_layer() == 26 || (n_layer() == 48 && n_vocab == 128256)``
  (deepseek2.cpp:8; DeepSeek-V2-Lite, GigaChat3, Kanana-2), ``n_vocab`` from
  ``vocab_size`` or the token list (deepseek2.cpp:5). A lite model does not
  read ``attention.q_lora_rank`` (deepseek2.cpp:12-14, ``n_lora_q`` stays 0)
  and loads ``attn_q`` instead of ``attn_q_a``/``attn_q_b``
  (deepseek2.cpp ``if (q_lora_rank > 0)`` in load_arch_tensors); the graph
  follows the tensors (deepseek2.cpp:498, ``is_lite = model.layers[il].wq``). No key sets "lite", but
  ``q_lora_rank`` decides the tensors when it is read: every stage of a
  lite model carries ``q_lora_rank = 0`` (a non-lite stage then loads
  ``attn_q`` as the whole model does). A stage of a non-lite model whose
  trunk would be taken for lite (26 or 27 blocks, or 48 with a 128256-token
  vocabulary) would look for ``attn_q``, which the model does not have: it
  is refused unless the model's own ``q_lora_rank`` is 0.
* **Gating function** defaults by block count and vocabulary when
  ``expert_gating_func`` is absent (or 0): sigmoid for 47 or 48 trunk
  blocks with a 154880-token vocabulary (GLM-4.7-Flash), else softmax
  (deepseek2.cpp:23-31). Every stage file carries the value the whole model
  uses.
* **Model type** (``LLM_TYPE_16B``/``236B``/``671B`` from 27/60/61 blocks,
  deepseek2.cpp:46-52): a label no computation reads.
* **Per-layer values**: ``attention.head_count``, ``head_count_kv``,
  ``feed_forward_length``, ``expert_used_count`` may be per-layer arrays
  (llama-model.cpp:1333, 1395, 1396, 1404, ``get_key_or_arr``), and so may
  ``expert_feed_forward_length`` (deepseek2.cpp:18), but deepseek2 uses
  the first layer's value for every block (``hparams.n_head()``,
  ``n_ff()``, ``n_ff_exp()``, ``n_expert_used()`` with the default
  ``il = 0``: LLAMA_LOAD_LOCALS in llama-model.h:860-878, the
  llm_graph_context at llama-graph.cpp:1470-1477). The stage
  writer slices the arrays, so a stage's first layer would give another
  value: a model whose arrays are not uniform is refused.

Nothing else depends on the index or the count: the YaRN factors
(``rope.scaling.*``, ``yarn_log_multiplier`` as DeepSeek's mscale, the
kq_scale pre-scaling in graph::graph and llama-context.cpp), the expert
weights' scale and normalisation, the shared-expert count, expert groups,
the attention temperature scaling (from positions) are global keys copied
unchanged. A stage fed activations skips the token embedding lookup only
(``build_inp_embd``). ``output.weight`` is optional (tied to
``token_embd`` when absent), so only the last stage needs it.
"""

from __future__ import annotations

from ggufpipe_agent.errors import UnsupportedArchitecture
from ggufpipe_agent.gguf import rules
from ggufpipe_agent.gguf.rules import Architecture, Metadata, Overrides

ARCH = "deepseek2"

#: LLAMA_EXPERT_GATING_FUNC_TYPE_* (src/llama-hparams.h)
GATING_NONE = 0
GATING_SOFTMAX = 1
GATING_SIGMOID = 2


def _int(get: Metadata, key: str, default: int = 0) -> int:
    value = get(f"{ARCH}.{key}")
    return default if value is None else int(value)


def _n_vocab(get: Metadata) -> int | None:
    """load_arch_hparams: ``vocab_size``, else the tokenizer's token count."""
    size = get(f"{ARCH}.vocab_size")
    if size is not None:
        return int(size)
    tokens = get("tokenizer.ggml.tokens")
    return None if tokens is None else len(tokens)


def is_lite(trunk: int, n_vocab: int | None) -> bool:
    """llama.cpp's ``is_lite`` for a file of ``trunk`` non-MTP blocks."""
    return trunk in (26, 27) or (trunk == 48 and n_vocab == 128256)


def gating_func(get: Metadata) -> int:
    """The expert gating function the whole model uses."""
    value = _int(get, "expert_gating_func", GATING_NONE)
    if value != GATING_NONE:
        return value
    trunk = _int(get, "block_count") - _int(get, "nextn_predict_layers")
    if trunk in (47, 48) and _n_vocab(get) == 154880:
        return GATING_SIGMOID
    return GATING_SOFTMAX


def nextn_in(get: Metadata, start: int, end: int) -> int:
    """How many of blocks ``[start, end)`` are MTP blocks."""
    return rules.trailing_in(_int(get, "nextn_predict_layers"), _int(get, "block_count"), start, end)


def _check(get: Metadata, block_count: int, start: int, end: int, where: str) -> None:
    span = rules.span(ARCH, start, end)
    rules.refuse_non_uniform(ARCH, get, start, end, where)
    rules.refuse_mtp_cuts(ARCH, get, block_count, start, end, where)
    nextn = _int(get, "nextn_predict_layers")
    n_vocab = _n_vocab(get)
    stage_trunk = (end - start) - nextn_in(get, start, end)
    if is_lite(block_count - nextn, n_vocab) or not is_lite(stage_trunk, n_vocab):
        return
    q_lora = get(f"{ARCH}.attention.q_lora_rank")
    if q_lora is not None and int(q_lora) == 0:
        return  # the model itself uses attn_q, as a lite stage will
    raise UnsupportedArchitecture(
        f"{where}: {span}: a stage of {stage_trunk} blocks would be taken for a lite deepseek2 model "
        "(llama.cpp decides 'lite' from 26 or 27 blocks, or 48 blocks with a 128256-token vocabulary, "
        "and no GGUF key overrides it) and look for attn_q tensors this model does not have "
        "(it uses low-rank queries, attn_q_a/attn_q_b); give this stage more or fewer blocks"
    )


def _overrides(get: Metadata, start: int, end: int) -> Overrides:
    lead = _int(get, "leading_dense_block_count")
    out: Overrides = {
        f"{ARCH}.leading_dense_block_count": rules.uint32(rules.leading_in(lead, start, end)),
        f"{ARCH}.expert_gating_func": rules.uint32(gating_func(get)),
    }
    if get(f"{ARCH}.nextn_predict_layers") is not None:
        out[f"{ARCH}.nextn_predict_layers"] = rules.uint32(nextn_in(get, start, end))
    block_count = _int(get, "block_count")
    if is_lite(block_count - _int(get, "nextn_predict_layers"), _n_vocab(get)):
        out[f"{ARCH}.attention.q_lora_rank"] = rules.uint32(0)
    return out


ARCHITECTURE = Architecture(
    ARCH,
    "synthetic GGUFs: V3-like (low-rank queries, 3 leading dense blocks, MoE with a shared expert, "
    "sigmoid gating with selection bias, YaRN with mscale, one MTP block) and V2-Lite-like "
    "(26 blocks, attn_q, default gating); splits inside and right after the dense blocks; "
    "a stage taken for 'lite' by its block count, a cut among MTP blocks and non-uniform "
    "per-layer head or expert counts are refused",
    check=_check,
    overrides=_overrides,
)
