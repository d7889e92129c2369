"""Which architectures a stage may run, and what a stage file must carry for each.

An architecture is accepted only once a test proves that a split chain of
stages gives the same greedy tokens as the whole model in one llama.cpp
context (tests/test_architectures.py; docs/architectures.md has the table).
Everything else is refused before anything loads: a pipeline that silently
computes something else is worse than one that says no.

A stage file renumbers its blocks from 0 and says ``block_count = end - start``
(see :mod:`ggufpipe_agent.stagefiles.writer`). That is exact as long as llama.cpp
derives nothing from a block's index or from the block count. Where an
architecture does (read from llama.cpp 0.3.36, ``src/models/<arch>.cpp``):

* llama, qwen2, qwen3, mistral3, phi3: the block count only picks a model-type
  label (``LLM_TYPE_*``) that no computation reads; per-layer metadata arrays
  are sliced by the stage writer. Nothing to do.
* gemma3: (1) a block is sliding-window or global by its index
  (``is_swa(il) = il % period < period - 1``, period from
  ``gemma3.attention.sliding_window_pattern`` or 6), which also picks its RoPE
  base and scale; the stage file carries the original pattern's slice as a
  per-layer bool array, which llama.cpp reads in preference to a period.
  (2) The attention scale depends on the model type picked from the block
  count: a 62-block model (27B) uses ``1/sqrt(n_embd / n_head)``, every other
  count ``1/sqrt(head_dim)``; no GGUF key overrides it for gemma3, so a split
  that would change it is refused (:func:`check_split`).
  Embedding input is scaled by sqrt(n_embd) only for token input
  (``ubatch.token ? sqrtf(n_embd) : 1``), so a stage fed activations gets them
  unscaled, as it must; the final logit softcapping is a global key that only
  the last stage uses.
"""

from __future__ import annotations

import math
from typing import Any

from ggufpipe_agent.errors import ModelError, UnsupportedArchitecture
from ggufpipe_agent.gguf.rules import Architecture, Metadata, Overrides

ISSUES_URL = "https://github.com/ggufpipe/ggufpipe/issues"


SUPPORTED: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture(
            "llama",
            "SmolLM2-135M-Instruct (real, 30 blocks) and a synthetic GGUF with Llama 3 RoPE "
            "frequency factors; covers Llama 2/3, SmolLM2, Mistral 7B / Nemo (converted as llama)",
        ),
        Architecture("qwen2", "synthetic GGUF (random weights, Q/K/V biases, GQA)"),
        Architecture("qwen3", "synthetic GGUF (random weights, Q/K norms, GQA)"),
        Architecture(
            "mistral3",
            "synthetic GGUF (random weights, YaRN RoPE and Llama-4 attention temperature "
            "scaling); Mistral Small 3.x / Ministral 3 text models",
        ),
        Architecture(
            "phi3",
            "synthetic GGUF (random weights, fused QKV, fused gate/up FFN, LongRoPE factors)",
        ),
        Architecture(
            "gemma3",
            "Gemma 3 270M (real, 18 blocks) and a synthetic GGUF with a short sliding window; "
            "splits anywhere, also off the sliding-window period; the 27B (62 blocks) is refused",
        ),
    )
}


def _families() -> dict[str, Architecture]:
    """The architectures of :mod:`ggufpipe_agent.gguf.families`: one module
    each, with its split rules and its own split-exactness test
    (tests/model/test_arch_<module>.py)."""
    import importlib
    import pkgutil

    from ggufpipe_agent.gguf import families

    found: dict[str, Architecture] = {}
    for module in sorted(pkgutil.iter_modules(families.__path__), key=lambda m: m.name):
        arch = importlib.import_module(f"{families.__name__}.{module.name}").ARCHITECTURE
        found[arch.name] = arch
    return found


SUPPORTED.update(_families())


def keep_tensors(arch: str) -> tuple[str, ...]:
    """Global tensors every stage file of ``arch`` keeps (besides the usual ones)."""
    support = SUPPORTED.get(arch)
    return support.keep_tensors if support else ()


def cut_multiple(arch: str, get: Metadata) -> int:
    """Stages of ``arch`` start at multiples of this block index (1: anywhere)."""
    support = SUPPORTED.get(arch)
    return support.cut_multiple(get) if support and support.cut_multiple else 1


def positions_per_token(arch: str, get: Metadata) -> int:
    """Positions per token of a batch of embeddings for this model (usually 1)."""
    support = SUPPORTED.get(arch)
    return support.positions_per_token(get) if support and support.positions_per_token else 1


def check_architecture(arch: str, where: str) -> Architecture:
    support = SUPPORTED.get(arch)
    if support is None:
        accepted = ", ".join(sorted(SUPPORTED))
        raise UnsupportedArchitecture(
            f"{where}: architecture '{arch}' is not verified for split execution "
            f"(accepted: {accepted}); ask for it at {ISSUES_URL} with a link to a small "
            f"GGUF of that architecture"
        )
    return support


def check_split(arch: str, get: Metadata, start: int, end: int, where: str) -> None:
    """Refuse a stage range ``[start, end)`` that a stage file cannot make exact.

    Call it wherever a range is planned or a stage file is written; the whole
    model (``[0, block_count)``) is always fine, it is the source file itself.
    """
    check_architecture(arch, where)
    block_count = int(get(f"{arch}.block_count") or 0)
    if start == 0 and end == block_count:
        return
    if arch == "gemma3":
        _gemma3_check(get, block_count, start, end, where)
    support = SUPPORTED[arch]
    if support.check is not None:
        support.check(get, block_count, start, end, where)


def plan_metadata(facts: Any) -> Metadata:
    """The metadata the orchestrator knows of a model from its facts
    (``ggufpipe_agent.wire.protocol.ModelFacts``): what plan-time checks read."""
    arch = facts.architecture
    known = {
        f"{arch}.block_count": facts.block_count,
        f"{arch}.embedding_length": facts.hidden_dim,
        f"{arch}.attention.head_count": facts.head_count,
        f"{arch}.attention.key_length": facts.key_length,
    }
    return known.get


def check_plan(facts: Any, ranges: list[tuple[int, int]], where: str) -> None:
    """:func:`check_split` for every range of a plan, from the model facts the
    orchestrator has, so a split that no stage file can make exact is refused
    before any agent prepares. The agents check again from the file itself
    when they write stage files."""
    for start, end in ranges:
        check_split(facts.architecture, plan_metadata(facts), start, end, where)


def stage_metadata_overrides(arch: str, get: Metadata, start: int, end: int) -> Overrides:
    """Metadata a stage file of ``arch`` for blocks ``[start, end)`` must carry
    instead of (or besides) the copied value. Empty for the llama family,
    which derives nothing from the block index or count."""
    if arch == "gemma3":
        return _gemma3_overrides(get, start, end)
    support = SUPPORTED.get(arch)
    if support is not None and support.overrides is not None:
        return support.overrides(get, start, end)
    return {}


# ------------------------------------------------------------------ gemma3

GEMMA3_DEFAULT_SWA_PERIOD = 6  # llama_model_gemma3::load_arch_hparams: load_swa_pattern(ml, 6)
GEMMA3_27B_BLOCKS = 62  # the block count llama.cpp maps to LLM_TYPE_27B


def gemma3_swa_flags(get: Metadata, start: int, end: int) -> list[bool] | None:
    """Which of the original blocks ``start..end-1`` are sliding-window, as
    llama.cpp decides it for the whole model; None when the model has no
    sliding window (then every block is global whatever its index)."""
    window = get("gemma3.attention.sliding_window")
    if not window:
        return None
    pattern = get("gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return [bool(flag) for flag in pattern[start:end]]
    period = GEMMA3_DEFAULT_SWA_PERIOD if pattern is None else int(pattern)
    # llama_hparams::set_swa_pattern(n_pattern, dense_first=false)
    return [period == 0 or index % period < period - 1 for index in range(start, end)]


def _gemma3_overrides(get: Metadata, start: int, end: int) -> Overrides:
    import gguf

    flags = gemma3_swa_flags(get, start, end)
    if flags is None:
        return {}  # no sliding window: every block is global whatever its index
    if not any(flags):
        # A stage of global blocks only: llama.cpp asserts that a model with a
        # sliding window has a sliding-window block (GGML_ASSERT(is_swa_any())
        # in create_memory, which aborts the process). Without the window it
        # builds the plain graph, whose blocks are exactly the global ones:
        # same causal mask, same RoPE base and scale, same full-size KV cache.
        return {"gemma3.attention.sliding_window": (0, gguf.GGUFValueType.UINT32, None)}
    if isinstance(get("gemma3.attention.sliding_window_pattern"), list):
        return {}  # already a per-layer array: the stage writer slices it
    return {
        "gemma3.attention.sliding_window_pattern": (
            flags,
            gguf.GGUFValueType.ARRAY,
            gguf.GGUFValueType.BOOL,
        )
    }


def _first(value: Any, index: int) -> int:
    """A per-layer hyperparameter (scalar or per-layer array) at ``index``."""
    if isinstance(value, list):
        return int(value[index])
    return int(value)


def _gemma3_attention_scale(get: Metadata, n_layer: int, first_block: int) -> float:
    """llama_model_gemma3::load_arch_hparams for a file whose layer 0 is
    ``first_block`` of the original and which has ``n_layer`` blocks."""
    n_embd = int(get("gemma3.embedding_length"))
    n_head = _first(get("gemma3.attention.head_count"), first_block)
    key_length = get("gemma3.attention.key_length")
    head_dim = int(key_length) if key_length is not None else n_embd // n_head
    if n_layer == GEMMA3_27B_BLOCKS:
        return 1.0 / math.sqrt(float(n_embd // n_head))
    return 1.0 / math.sqrt(float(head_dim))


def _gemma3_check(get: Metadata, block_count: int, start: int, end: int, where: str) -> None:
    pattern = get("gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) != block_count:
        raise ModelError(
            f"{where}: gemma3.attention.sliding_window_pattern has {len(pattern)} entries for "
            f"{block_count} blocks; cannot tell which blocks of a stage are sliding-window"
        )
    whole = _gemma3_attention_scale(get, block_count, 0)
    stage = _gemma3_attention_scale(get, end - start, start)
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
    raise UnsupportedArchitecture(f"{where}: layers [{start}, {end}) of a gemma3 model: {reason}")
