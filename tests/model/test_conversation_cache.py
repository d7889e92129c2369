"""A conversation keeps its cache (docs/worker.md, "Prefix reuse"): with run.reuse: cache
(the default) each follow-up turn keeps every position the stages hold of
the previous turn, at the default ubatch of 512 too, computes only its new
tokens, and its greedy tokens are those of ONE llama.cpp context that kept
its cache between turns and was fed the same batches (the reference a
conversation must equal: llama-server with cache_prompt). run.reuse: exact
keeps only what a cold run computes alike and equals a cold run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ggufpipe_tui.core.events import RunResult, StageStats
from ggufpipe_tui.core.inventory import load_inventory
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support.common import LONG_PROMPT, whole_model_greedy, whole_model_turns
from tests.support.local import tokenize

pytestmark = pytest.mark.model

CONTEXT, STEPS = 1024, 16
SPLIT = [(0, 7), (7, 23), (23, 30)]
TURNS = (" Now the second century, briefly.", " And the third?", " Thank you. One more: the fourth?")


def write_inventory(tmp_path: Path, model: Path, reuse: str | None, ubatch: int = 512) -> Path:
    stages = "".join(f"  - {{host: here, layers: [{a}, {b}]}}\n" for a, b in SPLIT)
    chosen = f", reuse: {reuse}" if reuse else ""
    path = tmp_path / "inventory.yaml"
    path.write_text(
        f"model: {{path: {model}}}\nhosts:\n  here: {{local: true, threads: 1}}\nstages:\n{stages}"
        f"run: {{context: {CONTEXT}, ubatch: {ubatch}, max_tokens: {STEPS}, ignore_eos: true, chat: false{chosen}}}\n"
        "timeouts: {connect: 60, ready: 300, step: 60, teardown: 10}\n"
    )
    return path


def prefill_rows(events: list[Any], result: RunResult) -> list[tuple[int, int]]:
    final: dict[int, tuple[int, int]] = {}
    for event in events:
        if isinstance(event, StageStats) and event.run_id == result.run_id:
            final[event.stage] = (event.counters.kept, event.counters.prefill_rows)
    return [final[stage] for stage in sorted(final)]


async def conversation(inventory_path: Path, model_path: Path) -> tuple[list[RunResult], list[Any]]:
    events: list[Any] = []
    pipeline = Pipeline(load_inventory(inventory_path), events.append)
    results: list[RunResult] = []
    try:
        await pipeline.start()
        prompt = tokenize(model_path, LONG_PROMPT, bos=True)
        for words in ("", *TURNS):
            if results:
                prompt = prompt + list(results[-1].tokens) + tokenize(model_path, words, bos=False)
            results.append(await pipeline.generate_tokens(prompt))
    finally:
        await pipeline.close()
    return results, events


async def test_each_turn_keeps_everything_and_equals_one_context_that_kept_its_cache(
    tmp_path, model_path, no_agent_left
):
    results, events = await conversation(write_inventory(tmp_path, model_path, None), model_path)
    for result in results:
        assert result.outcome == "completed", result.failure
    prompts = [list(result.prompt_tokens) for result in results]
    oracle = whole_model_turns(model_path, prompts, STEPS, n_ctx=CONTEXT, n_ubatch=512)
    assert [list(result.tokens) for result in results] == oracle
    assert results[0].prompt_reused == 0
    for before, result in zip(results, results[1:], strict=False):
        kept = (
            len(before.prompt_tokens) + STEPS - 1
        )  # every position fed: the prompt, the reply but its last token
        assert result.prompt_reused == kept, "the default ubatch of 512 keeps everything"
        assert prefill_rows(events, result) == [(kept, len(result.prompt_tokens) - kept)] * 3, (
            "only the new tokens"
        )


async def test_exact_reuse_keeps_what_a_cold_run_computes_alike(tmp_path, model_path, no_agent_left):
    results, _ = await conversation(write_inventory(tmp_path, model_path, "exact"), model_path)
    for result in results[1:]:
        assert result.outcome == "completed", result.failure
        assert (
            result.prompt_reused % 512 == 0
        )  # whole ubatches only, or everything where rows are batch-invariant
        cold = whole_model_greedy(model_path, list(result.prompt_tokens), STEPS, n_ctx=CONTEXT, n_ubatch=512)
        assert list(result.tokens) == cold, "exact: a follow-up equals a cold run of its tokens"
