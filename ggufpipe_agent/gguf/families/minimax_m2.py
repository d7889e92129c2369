"""minimax-m2: MiniMax M2 (230B-A10B, 62 blocks).

Read from llama.cpp 0.3.36 (vendored commit 0c1e57098):

* ``src/models/minimax-m2.cpp`` ``load_arch_hparams``: the block count only
  picks a model-type label (``case 62: LLM_TYPE_230B_A10B``) that no
  computation reads. The graph uses nothing of a block's index but
  ``il == n_layer - 1`` (drop the rows nobody asked for after the last block,
  also right for a stage's last block). Everything else is global or per
  block: Q/K RMS norms over the whole projection (``attn_q_norm`` of
  ``n_embd_head_k * n_head``, before the reshape to heads), NeoX RoPE over the
  first ``rope.dimension_count`` dimensions of each head (partial rotary: 64
  of 128; the ``n_embd_head == n_rot`` assert is commented out there), the
  scale ``1/sqrt(head_dim)``, and ``build_moe_ffn`` with the gating function
  of ``expert_gating_func`` (sigmoid for the real model; llama.cpp aborts
  without it), the per-block selection bias ``exp_probs_b.bias`` added for the
  choice only, and the chosen weights renormalised (``norm_w = true``).
* ``load_arch_tensors`` creates ``output.weight`` without
  ``TENSOR_NOT_REQUIRED`` (and, unlike qwen3moe, never falls back to
  ``token_embd``): a stage file without it fails to load ("check_tensor_dims: tensor
  'output.weight' not found"), so every stage file keeps it (``keep_tensors``).
* Per-layer arrays and multi-token-prediction blocks: as for qwen3moe
  (:func:`ggufpipe_agent.gguf.rules.uniform_check`): ``load_hparams`` reads
  ``expert_used_count``, ``attention.head_count(_kv)`` and
  ``feed_forward_length`` (which sizes the expert tensors here) per layer, and
  ``minimax-m2.cpp`` reads ``expert_feed_forward_length`` the same way, but
  llama.cpp uses layer 0's value for every block in places and a stage's layer
  0 is another block; a split of a file whose array is not uniform, or with
  ``nextn_predict_layers``, is refused (the converter writes scalars and no
  MTP blocks for MiniMax M2).
"""

from __future__ import annotations

from ggufpipe_agent.gguf import rules
from ggufpipe_agent.gguf.rules import Architecture

ARCHITECTURE = Architecture(
    "minimax-m2",
    "synthetic GGUF (random weights, 8 experts top-2 with sigmoid gating and a selection bias, "
    "Q/K norms over the whole projection, partial rotary, GQA); MiniMax M2; every stage keeps "
    "output.weight, which llama.cpp requires; a non-uniform per-layer head or expert count is "
    "refused",
    check=rules.uniform_check("minimax-m2"),
    keep_tensors=("output.weight",),
)
