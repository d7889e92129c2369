"""What an architecture is to ggufpipe: its split rules, as data, and the
rules several architectures share (the helpers below), so that a family
module states only what is particular to it.

A leaf module: :mod:`ggufpipe_agent.gguf.architectures` gathers the
architectures, and each module of :mod:`ggufpipe_agent.gguf.families`
defines one with these types (importing them from here, not from
``architectures``, so that a family module can be imported first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ggufpipe_agent.errors import ModelError, UnsupportedArchitecture

#: A metadata lookup: key -> value, or None when the key is absent.
Metadata = Callable[[str], Any]
#: ``{key: (value, GGUFValueType, sub type or None)}`` for GGUFWriter.add_key_value.
Overrides = dict[str, tuple[Any, Any, Any]]


#: ``check(get, block_count, start, end, where)``: raise for a range ``[start, end)``
#: (never the whole model) that no stage file can make exact.
SplitCheck = Callable[[Metadata, int, int, int, str], None]
#: ``overrides(get, start, end)``: what a stage file of ``[start, end)`` must carry.
StageOverrides = Callable[[Metadata, int, int], Overrides]


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str
    #: How the split was proven identical to the whole model (docs/architectures.md).
    verified: str
    #: Refuses the ranges a stage file cannot make exact (None: every range is fine).
    check: SplitCheck | None = None
    #: The metadata a stage file must carry instead of the copied values.
    overrides: StageOverrides | None = None
    #: Global tensors every stage file keeps, not only the last stage
    #: (llama.cpp requires ``output.weight`` to load some architectures).
    keep_tensors: tuple[str, ...] = ()
    #: ``cut_multiple(get)``: every stage must start at a multiple of this
    #: block index (1: anywhere); the planner places its cuts there.
    cut_multiple: Callable[[Metadata], int] | None = None
    #: ``positions_per_token(get)``: positions a batch of embeddings carries per
    #: token for this model (4 with M-RoPE sections; llama_batch_init gives 1).
    positions_per_token: Callable[[Metadata], int] | None = None
    #: ``swa_flags(get, start, end)``: which of blocks ``[start, end)`` have a
    #: sliding window (None: none), for the memory estimate (its masks and a
    #: cache without ``swa_full``); None: every block counts as global.
    swa_flags: Callable[[Metadata, int, int], list[bool] | None] | None = None


# ------------------------------------------------------------ shared rules
#
# What several families' rules have in common: llama.cpp derives the same
# things from a block's index in several architectures, and a family module
# states only which of these apply to it, with its own keys.

#: Hyperparameters llama.cpp may read per layer (``get_key_or_arr``: a scalar
#: or one value per layer) but uses layer 0's value of for every block in
#: places (``LLAMA_LOAD_LOCALS``, ``llm_graph_context``: ``n_head()``,
#: ``n_head_kv()``, ``n_expert_used()``, ``n_ff()``, ``n_ff_exp()``).
LAYER0_KEYS = (
    "attention.head_count",
    "attention.head_count_kv",
    "expert_used_count",
    "feed_forward_length",
    "expert_feed_forward_length",
)


def span(arch: str, start: int, end: int) -> str:
    """How a refusal names the stage range it refuses."""
    return f"layers [{start}, {end}) of a {arch} model"


def refuse_non_uniform(arch: str, get: Metadata, start: int, end: int, where: str) -> None:
    """Refuse a split of a model whose per-layer array of one of
    :data:`LAYER0_KEYS` is not uniform: the stage writer slices the array, so a
    stage's layer 0, another block of the original, would give every block of
    the stage that block's value."""
    for key in LAYER0_KEYS:
        value: Any = get(f"{arch}.{key}")
        if isinstance(value, list) and len({int(v) for v in value}) > 1:
            raise UnsupportedArchitecture(
                f"{where}: {span(arch, start, end)}: {arch}.{key} differs between blocks "
                f"({sorted({int(v) for v in value})}); llama.cpp uses layer 0's value for every block "
                "in places, and a stage's layer 0 is another block of the original, so this model "
                "cannot be split exactly and runs only as one stage"
            )


def refuse_nextn(arch: str, get: Metadata, start: int, end: int, where: str) -> None:
    """Refuse a split of a model with multi-token-prediction blocks, for an
    architecture whose stage files cannot say how many a stage holds."""
    nextn = get(f"{arch}.nextn_predict_layers")
    if nextn:
        raise UnsupportedArchitecture(
            f"{where}: {span(arch, start, end)}: {arch}.nextn_predict_layers = {nextn}: llama.cpp "
            f"takes the last {nextn} blocks of a file for multi-token prediction, which a stage file "
            "cannot say of one range; this model runs only as one stage"
        )


def refuse_mtp_cuts(arch: str, get: Metadata, block_count: int, start: int, end: int, where: str) -> None:
    """For an architecture whose stage files say how many multi-token-prediction
    (MTP) blocks they hold: the model's last ``nextn_predict_layers`` blocks,
    which llama.cpp's main pass never runs. They stay with the trunk's last
    block in the last stage: a stage of MTP blocks only, or a cut between
    them, is refused."""
    key = f"{arch}.nextn_predict_layers"
    nextn = int(get(key) or 0)
    trunk = block_count - nextn
    if not nextn:
        return
    blocks = f"blocks {trunk}..{block_count - 1}"
    if start >= trunk:
        raise UnsupportedArchitecture(
            f"{where}: {span(arch, start, end)}: {blocks} are the model's multi-token-prediction "
            f"blocks ({key} = {nextn}), which llama.cpp does not run in the main pass: a stage of only "
            "those would run no block (llama.cpp aborts the process on a stage of MTP blocks only, "
            f"with no block to run); end the previous stage at block {block_count} instead"
        )
    if trunk < end < block_count:
        raise UnsupportedArchitecture(
            f"{where}: {span(arch, start, end)}: the cut at {end} falls between the "
            f"multi-token-prediction {blocks} ({key} = {nextn}): a stage would end inside the "
            "multi-token-prediction blocks, and a cut between them leaves a stage whose last block "
            f"llama.cpp does not run; end it at block {trunk} or {block_count}"
        )


def uniform_check(arch: str) -> SplitCheck:
    """The split check of an architecture that derives nothing from a block's
    index or the block count but reads :data:`LAYER0_KEYS` at layer 0 and the
    multi-token-prediction count of the whole file."""

    def check(get: Metadata, block_count: int, start: int, end: int, where: str) -> None:
        refuse_non_uniform(arch, get, start, end, where)
        refuse_nextn(arch, get, start, end, where)

    return check


def swa_flags(get: Metadata, key: str, default_period: int, start: int, end: int) -> list[bool]:
    """Which of the original blocks ``start..end-1`` have a sliding window, as
    llama.cpp's ``load_swa_pattern(ml, default_period)`` decides it for the
    whole model: the per-layer bool array ``key`` if the file has one, else a
    period (``key`` as a number, else ``default_period``)."""
    pattern = get(key)
    if isinstance(pattern, list):
        return [bool(flag) for flag in pattern[start:end]]
    period = default_period if pattern is None else int(pattern)
    # llama_hparams::set_swa_pattern(n_pattern, dense_first=false)
    return [period == 0 or index % period < period - 1 for index in range(start, end)]


def refuse_pattern_length(get: Metadata, key: str, block_count: int, where: str, kind: str) -> None:
    """A per-layer pattern array must have one entry per block of the model."""
    pattern = get(key)
    if isinstance(pattern, list) and len(pattern) != block_count:
        raise ModelError(
            f"{where}: {key} has {len(pattern)} entries for {block_count} blocks; "
            f"cannot tell which blocks of a stage {kind}"
        )


def bool_array(flags: list[bool]) -> tuple[Any, Any, Any]:
    """An override value: a per-layer bool array."""
    import gguf

    return (flags, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)


def uint32(value: int) -> tuple[Any, Any, Any]:
    """An override value: one unsigned 32-bit number."""
    import gguf

    return (value, gguf.GGUFValueType.UINT32, None)


def swa_pattern_overrides(get: Metadata, key: str, default_period: int, start: int, end: int) -> Overrides:
    """A stage file's sliding-window pattern: the original pattern's slice as
    the per-layer bool array ``key``, which llama.cpp reads in preference to a
    period (nothing when the source already has the array: the stage writer
    slices it)."""
    if isinstance(get(key), list):
        return {}
    return {key: bool_array(swa_flags(get, key, default_period, start, end))}


def leading_in(lead: int, start: int, end: int) -> int:
    """How many of blocks ``[start, end)`` are among the model's first ``lead``
    blocks (leading dense blocks), as a stage file counts them from 0."""
    return min(max(lead - start, 0), end - start)


def trailing_in(trailing: int, block_count: int, start: int, end: int) -> int:
    """How many of blocks ``[start, end)`` are among the model's last
    ``trailing`` blocks (multi-token-prediction blocks)."""
    return max(0, end - max(start, block_count - trailing))
