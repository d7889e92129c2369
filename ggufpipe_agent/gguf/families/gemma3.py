"""gemma3: Gemma 3 text models (270M, 1B, 4B, 12B, 27B).

What llama.cpp 0.3.36 derives from a block's index or from the block count
(``src/models/gemma3.cpp``), and what a stage file of blocks ``[a, b)`` does
about it:

* **Sliding window by index.** A block is sliding-window or global by its
  index (``is_swa(il) = il % period < period - 1``, period from
  ``gemma3.attention.sliding_window_pattern`` or 6), which also picks its
  RoPE base and scale; the stage file carries the original pattern's slice as
  a per-layer bool array, which llama.cpp reads in preference to a period.
  A stage of global blocks only is written without the window (llama.cpp
  asserts that a model with a window has a sliding-window block).
* **Attention scale by block count.** The scale depends on the model type
  picked from the block count: a 62-block model (27B) uses
  ``1/sqrt(n_embd / n_head)``, every other count ``1/sqrt(head_dim)``; no
  GGUF key overrides it for gemma3, so a split that would change it is
  refused (:func:`_check`).

Embedding input is scaled by sqrt(n_embd) only for token input
(``ubatch.token ? sqrtf(n_embd) : 1``), so a stage fed activations gets them
unscaled, as it must; the final logit softcapping is a global key that only
the last stage uses.
"""

from __future__ import annotations

import math
from typing import Any

from ggufpipe_agent.errors import UnsupportedArchitecture
from ggufpipe_agent.gguf import rules
from ggufpipe_agent.gguf.rules import Architecture, Metadata, Overrides

NAME = "gemma3"
DEFAULT_SWA_PERIOD = 6  # llama_model_gemma3::load_arch_hparams: load_swa_pattern(ml, 6)
GEMMA3_27B_BLOCKS = 62  # the block count llama.cpp maps to LLM_TYPE_27B
WINDOW = f"{NAME}.attention.sliding_window"
PATTERN = f"{NAME}.attention.sliding_window_pattern"


def swa_flags(get: Metadata, start: int, end: int) -> list[bool] | None:
    """Which of the original blocks ``start..end-1`` are sliding-window, as
    llama.cpp decides it for the whole model; None when the model has no
    sliding window (then every block is global whatever its index)."""
    if not get(WINDOW):
        return None
    return rules.swa_flags(get, PATTERN, DEFAULT_SWA_PERIOD, start, end)


def _overrides(get: Metadata, start: int, end: int) -> Overrides:
    flags = swa_flags(get, start, end)
    if flags is None:
        return {}  # no sliding window: every block is global whatever its index
    if not any(flags):
        # A stage of global blocks only: llama.cpp asserts that a model with a
        # sliding window has a sliding-window block (GGML_ASSERT(is_swa_any())
        # in create_memory, which aborts the process). Without the window it
        # builds the plain graph, whose blocks are exactly the global ones:
        # same causal mask, same RoPE base and scale, same full-size KV cache.
        return {WINDOW: rules.uint32(0)}
    return rules.swa_pattern_overrides(get, PATTERN, DEFAULT_SWA_PERIOD, start, end)


def _first(value: Any, index: int) -> int:
    """A per-layer hyperparameter (scalar or per-layer array) at ``index``."""
    if isinstance(value, list):
        return int(value[index])
    return int(value)


def _attention_scale(get: Metadata, n_layer: int, first_block: int) -> float:
    """llama_model_gemma3::load_arch_hparams for a file whose layer 0 is
    ``first_block`` of the original and which has ``n_layer`` blocks."""
    n_embd = int(get(f"{NAME}.embedding_length"))
    n_head = _first(get(f"{NAME}.attention.head_count"), first_block)
    key_length = get(f"{NAME}.attention.key_length")
    head_dim = int(key_length) if key_length is not None else n_embd // n_head
    if n_layer == GEMMA3_27B_BLOCKS:
        return 1.0 / math.sqrt(float(n_embd // n_head))
    return 1.0 / math.sqrt(float(head_dim))


def _check(get: Metadata, block_count: int, start: int, end: int, where: str) -> None:
    rules.refuse_pattern_length(get, PATTERN, block_count, where, "are sliding-window")
    whole = _attention_scale(get, block_count, 0)
    stage = _attention_scale(get, end - start, start)
    if whole == stage:
        return
    if block_count == GEMMA3_27B_BLOCKS:
        reason = (
            f"llama.cpp gives a {GEMMA3_27B_BLOCKS}-block gemma3 (Gemma 3 27B) the attention scale "
            f"1/sqrt(n_embd/n_head) = {whole:.6g} by its block count, and a stage of {end - start} "
            f"blocks would get 1/sqrt(head_dim) = {stage:.6g}; no GGUF key sets it, so Gemma 3 27B "
            "cannot be split exactly and runs only as one stage"
        )
    else:
        reason = (
            f"a stage of exactly {GEMMA3_27B_BLOCKS} blocks would be taken for Gemma 3 27B by "
            f"llama.cpp and get the attention scale {stage:.6g} instead of {whole:.6g}; give this "
            f"stage more or fewer than {GEMMA3_27B_BLOCKS} blocks"
        )
    raise UnsupportedArchitecture(f"{where}: {rules.span(NAME, start, end)}: {reason}")


ARCHITECTURE = Architecture(
    NAME,
    "Gemma 3 270M (real, 18 blocks) and a synthetic GGUF with a short sliding window; "
    "splits anywhere, also off the sliding-window period; the 27B (62 blocks) is refused",
    check=_check,
    overrides=_overrides,
    swa_flags=swa_flags,
)
