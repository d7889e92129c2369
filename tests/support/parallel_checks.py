"""Checks of runs in flight at once (docs/architecture.md, "Runs in flight"), shared by the local and the
SSH tests: each concurrent request's greedy tokens are what the same request
gives alone (one llama.cpp context, cold), and conversations interleaved on
the slots each keep their own cache, token for token what one llama.cpp
context keeping its cache between turns gives (llama-server's cache_prompt)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ggufpipe_tui.session.pipeline import Pipeline
from ggufpipe_tui.session.runs import Prompt, RunOverrides
from tests.support.common import LONG_PROMPT, whole_model_greedy, whole_model_turns
from tests.support.local import tokenize

SUFFIXES = [" Begin with Nero.", " Begin with Trajan.", " Only the wars.", " Only the buildings."]
OTHERS = ["Once upon a time", "def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,"]


def prompts(model: Path, count: int) -> list[list[int]]:
    """``count`` prompts, half sharing a long prefix, half unrelated."""
    shared = [tokenize(model, LONG_PROMPT + suffix, True) for suffix in SUFFIXES]
    others = [tokenize(model, text, True) for text in OTHERS]
    mixed = [prompt for pair in zip(shared, others, strict=True) for prompt in pair]
    return mixed[:count]


async def concurrent_equal_alone(
    pipeline: Pipeline, model: Path, count: int, steps: int, n_ctx: int, n_ubatch: int
) -> None:
    """``count`` requests at once, cold (cache_prompt false), each equal to
    the same request alone, and at least two of them in flight together."""
    chosen = prompts(model, count)
    most = 0

    def watch(event: object) -> None:
        nonlocal most
        most = max(most, len(pipeline.live_drivers()))

    unsubscribe = pipeline.subscribe(watch)
    options = RunOverrides(max_tokens=steps, ignore_eos=True)
    try:
        handles = [
            pipeline.submit(Prompt(tokens=tuple(prompt), options=options, cache_prompt=False))
            for prompt in chosen
        ]
        results = await asyncio.gather(*(handle.result() for handle in handles))
    finally:
        unsubscribe()
    for prompt, result in zip(chosen, results, strict=True):
        assert result.ok, result.failure
        assert list(result.tokens) == whole_model_greedy(model, prompt, steps, n_ctx, n_ubatch), prompt[:8]
    assert most >= min(2, count), f"at most {most} runs were in flight together"


async def conversations_keep_their_caches(
    pipeline: Pipeline, model: Path, conversations: int, turns: int, steps: int, n_ctx: int, n_ubatch: int
) -> None:
    """``conversations`` chats of ``turns`` turns, their turns in flight
    together; each turn's prompt is its whole conversation so far."""
    follow_ups = [" Go on.", " And then?", " Say more."]
    starts = prompts(model, conversations)
    asked: list[list[list[int]]] = [[] for _ in range(conversations)]
    kept: list[list[int]] = [[] for _ in range(conversations)]
    got: list[list[list[int]]] = [[] for _ in range(conversations)]
    current = [list(start) for start in starts]
    options = RunOverrides(max_tokens=steps, ignore_eos=True)
    for turn in range(turns):
        handles = [pipeline.submit(Prompt(tokens=tuple(tokens), options=options)) for tokens in current]
        results = await asyncio.gather(*(handle.result() for handle in handles))
        for index, result in enumerate(results):
            assert result.ok, result.failure
            asked[index].append(list(current[index]))
            kept[index].append(result.prompt_reused)
            got[index].append(list(result.tokens))
            more = tokenize(model, follow_ups[turn % len(follow_ups)], False)
            current[index] = [*current[index], *result.tokens, *more]
    for index in range(conversations):
        # Each turn's reply is its conversation's in one context keeping its cache.
        assert got[index] == whole_model_turns(model, asked[index], steps, n_ctx, n_ubatch), index
        assert all(count > 0 for count in kept[index][1:]), f"conversation {index} kept {kept[index]}"
