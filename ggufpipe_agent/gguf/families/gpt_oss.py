"""gpt-oss (OpenAI gpt-oss-20b, gpt-oss-120b): ``general.architecture = gpt-oss``.

What llama.cpp 0.3.36 derives from a block's index or the block count
(``src/models/openai-moe.cpp``, ``src/llama-model.cpp``, ``src/llama-hparams.cpp``):

* **Sliding window by index.** ``load_arch_hparams`` sets
  ``swa_type = LLAMA_SWA_TYPE_STANDARD`` unconditionally and calls
  ``load_swa_pattern(ml, 2)`` (openai-moe.cpp lines 8-9): the per-layer bool
  array ``gpt-oss.attention.sliding_window_pattern`` if the file has one
  (``ml.get_arr(LLM_KV_ATTENTION_SLIDING_WINDOW_PATTERN, is_swa_impl)``,
  llama-model.cpp ``load_swa_pattern``), else a period (that key as a number,
  default 2) through ``set_swa_pattern(n, dense_first=false)``:
  ``is_swa(il) = il % n < n - 1``, so the even blocks slide and the odd ones
  attend fully (llama-hparams.cpp ``set_swa_pattern``). The window kind also
  picks the block's RoPE base and scale (``get_rope_freq_base/scale(cparams,
  il)``, openai-moe.cpp line 78; ``gpt-oss.rope.freq_base_swa`` when present).
  A stage file carries the original pattern's slice as the per-layer bool
  array, which llama.cpp reads in preference to the period.
* **A stage without a sliding-window block cannot load.** ``create_memory``
  asserts ``GGML_ASSERT(hparams.is_swa_any())`` whenever ``swa_type`` is not
  NONE (llama-model.cpp, the ``llama_kv_cache_iswa`` branch), and gpt-oss
  never sets NONE (a window of 0 does not turn it off, unlike gemma3's
  loader), so that process would abort. With the default pattern that is a
  one-block stage at an odd index: refused by name (:func:`_check`).
* **Model type.** The block count picks ``LLM_TYPE_20B`` (24) or
  ``LLM_TYPE_120B`` (36), a label no computation reads.
* **Layer-0 hyperparameters.** The graph and the tensor shapes use layer 0's
  ``n_head``, ``n_head_kv``, ``n_expert_used``, ``n_ff_exp`` and head sizes
  for every block (``LLAMA_LOAD_LOCALS``, ``llm_graph_context``), which
  llama.cpp may read as per-layer arrays (``get_key_or_arr``): a stage would
  take its own first block's value, so a file whose arrays are not uniform is
  refused for splitting, as is one with separate sliding-window head or
  rotary sizes (``*_swa`` keys: layer 0's window kind picks them).

Everything else is global and copied: the attention sinks, Q/K/V/output and
expert biases are per-block tensors; YaRN scaling (``rope.scaling.*``), the
window size and the attention scale ``1/sqrt(n_rot)`` are global keys; the
experts' MXFP4 blocks are copied byte for byte. ``output.weight`` is required
(``create_tensor(..., 0)``, openai-moe.cpp line 31), so every stage keeps it.
"""

from __future__ import annotations

from ggufpipe_agent.errors import UnsupportedArchitecture
from ggufpipe_agent.gguf import rules
from ggufpipe_agent.gguf.rules import Architecture, Metadata, Overrides

NAME = "gpt-oss"
DEFAULT_SWA_PERIOD = 2  # llama_model_openai_moe::load_arch_hparams: load_swa_pattern(ml, 2)
PATTERN = f"{NAME}.attention.sliding_window_pattern"
#: Head and rotary sizes of sliding-window layers, distinct from the full ones
#: only when present (llama_model_base::load_hparams).
SWA_SIZE_KEYS = {
    "attention.key_length_swa": "attention.key_length",
    "attention.value_length_swa": "attention.value_length",
    "rope.dimension_count_swa": "rope.dimension_count",
}


def swa_flags(get: Metadata, start: int, end: int) -> list[bool]:
    """Which of the original blocks ``start..end-1`` have a sliding window,
    as llama.cpp decides it for the whole model."""
    return rules.swa_flags(get, PATTERN, DEFAULT_SWA_PERIOD, start, end)


def _check(get: Metadata, block_count: int, start: int, end: int, where: str) -> None:
    span = rules.span(NAME, start, end)
    rules.refuse_pattern_length(get, PATTERN, block_count, where, "are sliding-window")
    rules.refuse_non_uniform(NAME, get, start, end, where)
    for swa_key, full_key in SWA_SIZE_KEYS.items():
        value = get(f"{NAME}.{swa_key}")
        if value is not None and value != get(f"{NAME}.{full_key}"):
            raise UnsupportedArchitecture(
                f"{where}: {span}: {NAME}.{swa_key} differs from {NAME}.{full_key}, and llama.cpp "
                "sizes every block by its first block's window kind; such a model runs only as one stage"
            )
    if not any(swa_flags(get, start, end)):
        raise UnsupportedArchitecture(
            f"{where}: {span}: a stage without a sliding-window block cannot load: llama.cpp always "
            "builds gpt-oss with sliding-window attention and aborts on a stage that has none "
            "(GGML_ASSERT(is_swa_any()) in create_memory; no GGUF key turns the window off); "
            f"{'block ' + str(start) + ' attends fully, ' if end - start == 1 else ''}"
            "give this stage a neighbouring (even, sliding-window) block too"
        )


def _overrides(get: Metadata, start: int, end: int) -> Overrides:
    return rules.swa_pattern_overrides(get, PATTERN, DEFAULT_SWA_PERIOD, start, end)


ARCHITECTURE = Architecture(
    NAME,
    "synthetic GGUF (random weights, attention sinks, Q/K/V/output and expert biases, "
    "SwiGLU-OAI experts, sliding window on even blocks, YaRN); gpt-oss-20b/120b; "
    "splits anywhere but a one-block stage of a full-attention (odd) block",
    check=_check,
    overrides=_overrides,
    keep_tensors=("output.weight",),
)
