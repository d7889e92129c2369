"""Which architectures a stage may run, and what a stage file must carry for each.

An architecture is accepted only once a test proves that a split chain of
stages gives the same greedy tokens as the whole model in one llama.cpp
context (tests/test_architectures.py; docs/architectures.md has the table).
Everything else is refused before anything loads: a pipeline that silently
computes something else is worse than one that says no.

A stage file renumbers its blocks from 0 and says ``block_count = end - start``
(see :mod:`ggufpipe_agent.stagefiles.build`). That is exact as long as llama.cpp
derives nothing from a block's index or from the block count. Where an
architecture does (read from llama.cpp 0.3.36, ``src/models/<arch>.cpp``):

* llama, qwen2, qwen3, mistral3, phi3: the block count only picks a model-type
  label (``LLM_TYPE_*``) that no computation reads; per-layer metadata arrays
  are sliced by the stage writer. Nothing to do.
* every other architecture: one module of :mod:`ggufpipe_agent.gguf.families`
  each, with its split rules as hooks (:class:`~ggufpipe_agent.gguf.rules.Architecture`)
  and the rules several share in :mod:`ggufpipe_agent.gguf.rules`.
"""

from __future__ import annotations

from typing import Any

from ggufpipe_agent.errors import UnsupportedArchitecture
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
    )
}


def _families() -> dict[str, Architecture]:
    """The architectures beyond the llama family, those of :mod:`ggufpipe_agent.gguf.families`: one module
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


def swa_flags(arch: str, get: Metadata, start: int, end: int) -> list[bool] | None:
    """Which of blocks ``[start, end)`` of ``arch`` have a sliding window, as
    the memory estimate counts them (None: none)."""
    support = SUPPORTED.get(arch)
    return support.swa_flags(get, start, end) if support and support.swa_flags else None


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
    support = SUPPORTED.get(arch)
    if support is not None and support.overrides is not None:
        return support.overrides(get, start, end)
    return {}
