"""Conversations in the TUI with the real pipeline (real agents, llama.cpp on
SmolLM2): each prompt is the next turn, ctrl+n starts fresh, and a
conversation that would overflow the context is refused before it runs.

SmolLM2-135M answers "And of Italy?" with "The capital of Italy is Rome."
only when it sees the turn about France before it; alone it rambles about
Italian culture (greedy, checked against llama.cpp)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import Input

from ggufpipe_tui.views.app import GgufpipeApp
from ggufpipe_tui.views.transcript import Transcript
from ggufpipe_tui.views.widgets import LogPane, StatusBar
from tests.support.app import (
    READY_TIMEOUT,
    RUN_TIMEOUT,
    ready_for_prompt,
    type_prompt,
    wait_for,
    write_inventory,
)

pytestmark = [pytest.mark.model, pytest.mark.slow]

FRANCE = "What is the capital of France? Answer in one short sentence."
ITALY = "And of Italy?"


@contextlib.asynccontextmanager
async def loaded_app(
    tmp_path: Path, model_path: Path, run: str
) -> AsyncIterator[tuple[GgufpipeApp, Pilot[int]]]:
    """The app on the real pipeline with ``run:`` options, its stages loaded."""
    inventory = write_inventory(tmp_path, model_path, run)
    app = GgufpipeApp(inventory, log_dir=tmp_path / "runs")
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: ready_for_prompt(app), READY_TIMEOUT, "the stages to load")
        yield app, pilot


async def test_the_second_answer_uses_the_first_and_ctrl_n_starts_fresh(
    tmp_path: Path, model_path: Path, no_agent_left: None
) -> None:
    # ubatch 32: SmolLM2's CPU kernels give a row the same bits in any batch
    # there, so a stage may keep every position it holds (docs/worker.md).
    async with loaded_app(tmp_path, model_path, "{max_tokens: 40, ubatch: 32}") as (app, pilot):
        first = await type_prompt(pilot, FRANCE)
        await wait_for(pilot, lambda: len(app.results) == 1, RUN_TIMEOUT, "the first turn")
        france = app.results[0]
        assert france.ok and "Paris" in france.text, france.text
        assert first.text == france.text

        await wait_for(pilot, lambda: ready_for_prompt(app, france.run_id), READY_TIMEOUT, "the next run")
        status = app.query_one(StatusBar).view
        assert "conversation: 1 turn" in status.hint, status.hint
        second = await type_prompt(pilot, ITALY)
        await wait_for(pilot, lambda: len(app.results) == 2, RUN_TIMEOUT, "the second turn")
        italy = app.results[1]
        assert italy.ok and "Rome" in italy.text, italy.text
        assert second.text == italy.text
        # The second prompt is the whole conversation: the first prompt's
        # tokens, the first reply, then the new turn.
        assert italy.prompt_tokens[: len(france.prompt_tokens)] == france.prompt_tokens
        assert len(italy.prompt_tokens) > len(france.prompt_tokens) + len(france.tokens)
        assert app.turns.conversation.exchanges == 2
        # The stages kept the first turn (prefix reuse) and the summary says so.
        assert france.prompt_reused == 0 and italy.prompt_reused > len(france.prompt_tokens)
        said = second.view.summary.plain if second.view.summary else ""
        assert f"reused {italy.prompt_reused} of {len(italy.prompt_tokens)} prompt tokens" in said, said

        # ctrl+n: the transcript says so, and the same question alone is not understood.
        await pilot.press("ctrl+n")
        divider = app.query_one(Transcript).notes("divider")
        assert len(divider) == 1 and "new conversation" in divider[0].text
        logged = [line.plain for _, line in app.query_one(LogPane).entries]
        assert "[·] conversation 2: new" in logged
        await wait_for(pilot, lambda: ready_for_prompt(app, italy.run_id), READY_TIMEOUT, "the next run")
        fresh = await type_prompt(pilot, ITALY)
        await wait_for(pilot, lambda: len(app.results) == 3, RUN_TIMEOUT, "the fresh turn")
        alone = app.results[2]
        assert alone.ok and "Rome" not in alone.text, alone.text
        assert fresh.text == alone.text
        assert len(alone.prompt_tokens) < len(france.prompt_tokens), "the fresh prompt carries no history"
        assert 0 < alone.prompt_reused < len(alone.prompt_tokens), (
            "only the template's system prompt is shared"
        )
        assert app.turns.conversation.number == 2 and app.turns.conversation.exchanges == 1

        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None, 60, "the app to quit")


async def test_a_conversation_that_would_overflow_is_refused_before_it_runs(
    tmp_path: Path, model_path: Path, no_agent_left: None
) -> None:
    # The first turn is 43 prompt tokens: 43 + 72 fit a context of 128. The
    # second is 65 (the first turn, its reply, the new question): 65 + 72 do not.
    async with loaded_app(tmp_path, model_path, "{max_tokens: 72, context: 128}") as (app, pilot):
        await type_prompt(pilot, FRANCE)
        await wait_for(pilot, lambda: len(app.results) == 1, RUN_TIMEOUT, "the first turn")
        assert app.results[0].ok and app.results[0].stop_reason == "eos"
        await wait_for(
            pilot, lambda: ready_for_prompt(app, app.results[0].run_id), READY_TIMEOUT, "the next run"
        )
        prepared = app.run_id

        refused = await type_prompt(pilot, ITALY)
        await wait_for(pilot, lambda: refused.finished, RUN_TIMEOUT, "the refusal")
        said = refused.view.summary.plain if refused.view.summary else ""
        assert said.startswith("not run: this conversation is 65 tokens and a reply may take 72 more"), said
        assert "the context holds 128" in said and "ctrl+n starts a new conversation" in said
        assert refused.run_id is None and len(app.results) == 1, "nothing ran"
        assert app.run_id == prepared and ready_for_prompt(app), "the prepared run still waits, unharmed"
        assert app.query_one("#prompt", Input).value == ITALY, "the prompt is back in the input"
        assert app.turns.conversation.exchanges == 1, "a refused prompt is not part of the conversation"

        # The way out: a new conversation, and the same prompt runs.
        await pilot.press("ctrl+n", "enter")
        await wait_for(pilot, lambda: len(app.results) == 2, RUN_TIMEOUT, "the prompt in a new conversation")
        assert app.results[1].ok and app.results[1].run_id == prepared
        assert len(app.results[1].prompt_tokens) == 34

        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None, 60, "the app to quit")
