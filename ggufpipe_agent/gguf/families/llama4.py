"""Llama 4 (Scout 17B-16E, Maverick 17B-128E): ``general.architecture = llama4``.

What llama.cpp 0.3.36 derives from a block's index or the block count
(``src/models/llama4.cpp``, ``src/llama-model.cpp``, ``src/llama-hparams.cpp``):

* **No RoPE on every 4th block, by a constant.** ``use_rope = (il + 1) %
  n_no_rope_layer_step != 0`` (llama4.cpp line 143) with
  ``n_no_rope_layer_step = 4`` (llama-hparams.h; no GGUF key sets it); those
  blocks scale their queries by the attention temperature instead (line 173).
  A stage file renumbers its blocks from 0, so this is exact only when every
  stage starts at a multiple of 4: :func:`_cut_multiple` says so to the
  planner and :func:`_check` refuses any other start by name. A stage also
  needs one of these blocks, so at least 4 blocks: every graph has the
  temperature input (``build_inp_attn_scale()``, line 121), and a graph where
  no block uses it leaves it without a buffer, which aborts when llama.cpp
  sets it (``GGML_ASSERT(buf != NULL && "tensor buffer not set")``, seen
  with a 3-block stage); refused by name.
* **Mixture of experts on every ``interleave_moe_layer_step``-th block, by
  index.** ``is_moe_layer = (i + 1) % n_moe_layer_step == 0`` (line 62; the
  step is a scalar key, 1 for Scout, 2 for Maverick); the dense blocks have
  no expert tensors, so a stage starting off the step would not even load.
  Stages start at multiples of ``lcm(4, step)`` (4 for both real models).
* **Chunked attention by index.** Without ``llama4.attention.sliding_window``
  (real files) llama.cpp sets ``swa_type = CHUNKED`` with a hard-coded chunk
  of 8192 positions and ``load_swa_pattern(ml, 4)`` (lines 13-19): 3 chunked
  blocks then 1 global, the same blocks as the NoPE rule. Chunks are by
  absolute position, which a stage keeps. The stage file carries the
  original pattern's slice as the per-layer bool array
  ``llama4.attention.sliding_window_pattern`` (read in preference to a
  period), which also covers a file that gives another period.
* **``attention.sliding_window = 0``** (MobileLLM-style, all global) makes
  ``n_no_rope_layer_step = n_layer`` (line 11): the *last block by block
  count* has no RoPE, so every stage's last block would lose it; no key
  sets it back, and such a split is refused. (This llama.cpp cannot run that
  variant at all: it builds the temperature input with a zero scale and
  aborts, ``GGML_ASSERT(f_attn_temp_scale != 0.0f)`` in llama-graph.cpp.)
* **Attention temperature tuning** (``log(floor((pos + 1) / 8192) + 1) * 0.1
  + 1``, llama-graph.cpp ``llm_graph_input_attn_temp``) depends on the
  absolute position only; the shared expert is per-block tensors of the MoE
  blocks; ``use_kq_norm`` and the model type come from ``expert_count`` and
  ``embedding_length``, not the block count; ``rope_freqs.weight`` is a
  global tensor every stage keeps; ``output.weight`` may be absent
  (``TENSOR_NOT_REQUIRED``, tied to ``token_embd``).
* **Layer-0 hyperparameters.** The graph and tensor shapes use layer 0's
  head counts, ``n_expert_used`` and feed-forward sizes for every block
  (``LLAMA_LOAD_LOCALS``, ``llm_graph_context``), which llama.cpp may read as
  per-layer arrays; a file whose arrays are not uniform is refused for
  splitting.
"""

from __future__ import annotations

import math

from ggufpipe_agent.errors import UnsupportedArchitecture
from ggufpipe_agent.gguf import rules
from ggufpipe_agent.gguf.rules import Architecture, Metadata, Overrides

NAME = "llama4"
#: llama_hparams::n_no_rope_layer_step: every 4th block has no RoPE (no GGUF key).
NO_ROPE_STEP = 4
DEFAULT_SWA_PERIOD = 4  # llama_model_llama4::load_arch_hparams: load_swa_pattern(ml, 4)
PATTERN = f"{NAME}.attention.sliding_window_pattern"


def _all_global(get: Metadata) -> bool:
    """``llama4.attention.sliding_window = 0``: no chunked attention, and the
    last block by block count without RoPE."""
    window = get(f"{NAME}.attention.sliding_window")
    return window is not None and int(window) == 0


def _cut_multiple(get: Metadata) -> int:
    """Stages start at multiples of 4 (NoPE) and of the MoE step. Without the
    step (the orchestrator's model facts do not carry it) 4, which is right
    for Scout (step 1) and Maverick (step 2); the agents check again from the
    file itself."""
    step = int(get(f"{NAME}.interleave_moe_layer_step") or 1)
    return math.lcm(NO_ROPE_STEP, step)


def swa_flags(get: Metadata, start: int, end: int) -> list[bool]:
    """Which of the original blocks ``start..end-1`` have chunked attention."""
    return rules.swa_flags(get, PATTERN, DEFAULT_SWA_PERIOD, start, end)


def _check(get: Metadata, block_count: int, start: int, end: int, where: str) -> None:
    span = rules.span(NAME, start, end)
    if _all_global(get):
        raise UnsupportedArchitecture(
            f"{where}: {span}: with {NAME}.attention.sliding_window = 0 llama.cpp leaves RoPE out of "
            "the last block by the block count (n_no_rope_layer_step = n_layer), which in a stage "
            "would be the stage's last block; no GGUF key sets it, so this model runs only as one stage"
        )
    rules.refuse_non_uniform(NAME, get, start, end, where)
    rules.refuse_pattern_length(get, PATTERN, block_count, where, "have chunked attention")
    multiple = _cut_multiple(get)
    if start % multiple:
        step = int(get(f"{NAME}.interleave_moe_layer_step") or 1)
        raise UnsupportedArchitecture(
            f"{where}: {span}: a llama4 stage must start at a multiple of {multiple} blocks: "
            f"llama.cpp leaves RoPE out of every {NO_ROPE_STEP}th block by its index in the file "
            f"(n_no_rope_layer_step, no GGUF key) and puts the experts on every {step}th "
            f"(interleave_moe_layer_step), so a stage from block {start} would compute other blocks; "
            f"start it at {start - start % multiple} or {start - start % multiple + multiple}"
        )
    if end - start < NO_ROPE_STEP:
        raise UnsupportedArchitecture(
            f"{where}: {span}: a llama4 stage needs at least {NO_ROPE_STEP} blocks, one of them "
            "without RoPE: llama.cpp builds the attention-temperature input of those blocks into "
            'every graph and aborts when no block uses it (GGML_ASSERT(buf != NULL && "tensor '
            'buffer not set") in ggml-backend.cpp); join this stage to its neighbour'
        )
    if not any(swa_flags(get, start, end)):
        raise UnsupportedArchitecture(
            f"{where}: {span}: a stage without a chunked-attention block cannot load: llama.cpp "
            "aborts on it (GGML_ASSERT(is_swa_any()) in create_memory), and a window of 0 would "
            "move the blocks without RoPE; give this stage a chunked-attention block too"
        )


def _overrides(get: Metadata, start: int, end: int) -> Overrides:
    if _all_global(get):
        return {}  # no pattern read
    return rules.swa_pattern_overrides(get, PATTERN, DEFAULT_SWA_PERIOD, start, end)


ARCHITECTURE = Architecture(
    NAME,
    "synthetic GGUF (random weights, experts with a shared expert on every 2nd block as "
    "Maverick, chunked attention and no RoPE on every 4th block, Llama 3 RoPE factors); "
    "Llama 4 Scout/Maverick; stages start at multiples of 4 blocks and have 4 or more; "
    "attention.sliding_window = 0 is refused",
    check=_check,
    overrides=_overrides,
    cut_multiple=_cut_multiple,
)
