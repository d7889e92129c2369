"""Prefix reuse across runs (docs/worker.md, "Prefix reuse"), the orchestrator's half. Pure: no I/O.

Each stage keeps its KV cache between runs. A run's provision offers the
stages the previous run on the chain (:class:`ReuseSource`: its id and the
tokens it fed, prompt and fed-back tokens, position by position); each stage
says in StageReady how much of it it still holds (``PrefixHeld``). When the
prompt arrives, :func:`choose_kept` picks how many positions every stage
keeps: the common prefix of the fed tokens and the new prompt, bounded by
what every stage holds, at least one prompt token left to compute (the last
stage needs it for the first token's logits), and a multiple of every
stage's granularity. The prompt object then starts at that position.

The KV cache of a run holds its prompt and every generated token but the
last, which was sampled and never fed back: the fed tokens are what the
orchestrator wrote, not what it received.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ggufpipe_agent.ids import RunId
from ggufpipe_agent.wire.protocol import PrefixHeld, PrefixOffer


@dataclass(frozen=True, slots=True)
class ReuseSource:
    """A run whose positions the stages may still hold: the tokens it fed,
    position 0 on."""

    run_id: RunId
    fed: tuple[int, ...]

    def offer(self) -> PrefixOffer:
        return PrefixOffer(self.run_id, len(self.fed))


@dataclass(frozen=True, slots=True)
class Reuse:
    """How many positions a run keeps, and why not more (for the run log)."""

    kept: int
    reason: str = ""


def common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading tokens the two sequences share."""
    count = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        count += 1
    return count


def choose_kept(source: ReuseSource | None, prompt: Sequence[int], holds: Sequence[PrefixHeld]) -> Reuse:
    """Positions every stage keeps for ``prompt``, given what each holds of
    ``source`` (one ``PrefixHeld`` per stage, in stage order)."""
    if source is None or not source.fed:
        return Reuse(0, "no earlier run to reuse")
    shared = common_prefix(source.fed, prompt)
    if shared == 0:
        return Reuse(0, "the prompt shares no prefix with the last run")
    kept, reason = min(shared, len(prompt) - 1), ""
    if kept < shared:
        reason = "the last prompt token is always computed"
    granularity = 1
    for index, held in enumerate(holds):
        if held.run_id != source.run_id:
            return Reuse(0, f"stage {index} was not offered run {source.run_id:016x}")
        if held.positions < kept:
            kept = held.positions
            why = held.reason or f"it holds {held.positions} positions"
            reason = f"stage {index}: {why}"
        granularity = math.lcm(granularity, held.granularity)
    if kept % granularity:
        kept -= kept % granularity
        reason = f"a kept prefix must end at a multiple of {granularity} positions on every stage"
    if kept <= 0:
        return Reuse(0, reason)
    return Reuse(kept, reason)
