"""What an architecture is to ggufpipe: its split rules, as data.

A leaf module: :mod:`ggufpipe_agent.gguf.architectures` gathers the
architectures, and each module of :mod:`ggufpipe_agent.gguf.families`
defines one with these types (importing them from here, not from
``architectures``, so that a family module can be imported first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
