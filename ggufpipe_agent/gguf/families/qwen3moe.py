"""qwen3moe: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B / 480B-A35B.

Read from llama.cpp 0.3.36 (vendored commit 0c1e57098):

* ``src/models/qwen3moe.cpp`` ``load_arch_hparams``: the block count only
  picks a model-type label (``case 48: LLM_TYPE_30B_A3B; case 94:
  LLM_TYPE_235B_A22B``) that no computation reads. The graph
  (``llama_model_qwen3moe::graph``) uses nothing of a block's index but
  ``il == n_layer - 1`` (drop the rows nobody asked for after the last block,
  which is also right for a stage's last block): Q/K RMS norms per head,
  NeoX RoPE over the whole head (``n_rot`` from the global head size), the
  scale ``1/sqrt(head_dim)``, and ``build_moe_ffn`` with softmax gating,
  top ``n_expert_used``, the chosen weights always renormalised
  (``norm_w = true``, so ``norm_topk_prob`` is not read; no
  ``expert_weights_scale`` or ``expert_weights_norm`` key is read either).
  Nothing to carry: a stage file is the renumbered blocks.
* ``src/llama-model.cpp`` ``llama_model_base::load_hparams`` reads
  ``expert_used_count``, ``attention.head_count``, ``attention.head_count_kv``
  and ``feed_forward_length`` with ``get_key_or_arr`` (a scalar or one value
  per layer), and ``qwen3moe.cpp`` reads ``expert_feed_forward_length`` the
  same way. The stage writer slices such an array, but llama.cpp uses layer
  0's value for every block in places (``LLAMA_LOAD_LOCALS`` in
  ``src/llama-model.h``: ``n_head``, ``n_head_kv``, ``n_ff``,
  ``n_expert_used``; ``llm_graph_context`` in ``src/llama-graph.cpp``:
  ``n_head(hparams.n_head())``, ``n_expert_used(hparams.n_expert_used())``
  for the top-k; ``hparams.n_ff_exp()`` for the expert tensor shapes), and a
  stage's layer 0 is the original block ``start``. So a split of a file whose
  per-layer array is not uniform is refused (no real model has one: the
  converter writes scalars).
* ``nextn_predict_layers`` (``load_hparams``) marks the last blocks as
  multi-token-prediction blocks outside the main graph (``n_layer() =
  n_layer_all - n_layer_nextn``); a stage file would copy the count into every
  stage, so a split of such a file is refused.
"""

from __future__ import annotations

from ggufpipe_agent.gguf import rules
from ggufpipe_agent.gguf.rules import Architecture

ARCHITECTURE = Architecture(
    "qwen3moe",
    "synthetic GGUF (random weights, 8 experts top-2 with softmax gating, Q/K norms, explicit "
    "head size, GQA); Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-480B-A35B; a non-uniform "
    "per-layer head or expert count is refused",
    check=rules.uniform_check("qwen3moe"),
)
