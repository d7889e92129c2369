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


#: The start of the failure of a resumed run whose stages did not hold what
#: it needed: recovery replays it whole instead (session/recovery.py).
RESUME_REFUSED = "cannot carry the run on in proportion: "


@dataclass(frozen=True, slots=True)
class Resume:
    """An interrupted run carried on in proportion (docs/recovery.md,
    "Replay in proportion"): the stages that lived keep their caches, the
    one started again (``rebuild``; -1: none, a link was re-made) is fed its
    positions again in the parts it first had, and the run goes on from its
    next step with a sampler brought to where it was. ``tokens``: what the
    interrupted run ``run_id`` streamed; ``positions``: what its stages
    hold (its prompt and every token but the last); ``kept``: what it had
    kept itself of the run before it (its prompt_reused)."""

    run_id: RunId
    tokens: tuple[int, ...]
    positions: int
    rebuild: int = -1
    kept: int = 0

    def offer(self) -> PrefixOffer:
        return PrefixOffer(self.run_id, self.positions, resume=True)


def resume_problem(resume: Resume, holds: Sequence[PrefixHeld]) -> str:
    """Why the stages cannot carry ``resume`` on ("" when they can): every
    stage but the rebuilt one holds its positions, and the one before the
    rebuilt stage still holds the rows it sent it."""
    wanted = resume.positions
    for index, held in enumerate(holds):
        if index == resume.rebuild:
            continue
        if held.run_id != resume.run_id or held.positions < wanted:
            why = f" ({held.reason})" if held.reason else ""
            return f"stage {index} holds {held.positions} of its {wanted} positions{why}"
    if resume.rebuild > 0 and holds[resume.rebuild - 1].sent < wanted:
        sent = holds[resume.rebuild - 1].sent
        return f"stage {resume.rebuild - 1} holds the rows it sent of {sent} of {wanted} positions"
    return ""


def rebuild_parts(resume: Resume, prompt: Sequence[int]) -> list[tuple[list[int], int]]:
    """What the orchestrator feeds a rebuilt stage 0 before the run goes
    on, as (tokens, position) parts: the prompt as it was fed (stage 0 cuts
    it into the same chunks), then each token fed back, one a step."""
    if resume.rebuild != 0:
        return []
    parts = [(list(prompt), 0)]
    parts += [([token], len(prompt) + i) for i, token in enumerate(resume.tokens[:-1])]
    return parts
