"""Fault injection for the fault tests: an event consumer that acts (sends a
signal to a stage's agent, ...) when an event first matches, and one run
driven with it. The agents are processes on this machine, local or behind
the loopback sshd alike."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ggufpipe_tui.core.events import (
    AgentLog,
    Notice,
    RunFinished,
    RunPhaseChanged,
    RunRecovered,
    RunResult,
    StageRecovery,
    StageStateChanged,
    TokenStreamed,
)
from ggufpipe_tui.core.inventory import load_inventory
from ggufpipe_tui.session.pipeline import Pipeline
from tests.support.common import LONG_PROMPT, whole_model_greedy


class Saboteur:
    """Consumes the pipeline's events and, when ``when(event)`` first holds,
    does ``act(pipeline)`` (in the event loop, between two events)."""

    def __init__(self, when: Callable[[Any], bool], act: Callable[[Pipeline], None]) -> None:
        self.when, self.act = when, act
        self.pipeline: Pipeline | None = None
        self.events: list[Any] = []
        self.fired = False
        self.close_seconds = 0.0  # how long Pipeline.close() took

    def __call__(self, event: Any) -> None:
        self.events.append(event)
        if not self.fired and self.pipeline is not None and self.when(event):
            self.fired = True
            self.act(self.pipeline)

    def phases(self) -> list[str]:
        return [e.phase for e in self.events if isinstance(e, RunPhaseChanged)]

    def logged(self, stage: int) -> list[str]:
        return [e.line for e in self.events if isinstance(e, AgentLog) and e.stage == stage]

    def stopped(self) -> set[int]:
        """Stages whose agent went through Stopping to Stopped (StopRun honoured)."""
        return {e.stage for e in self.events if isinstance(e, StageStateChanged) and e.state == "Stopped"}


def text_so_far(process: subprocess.Popen[str], chars: int = 20) -> str:
    """The first ``chars`` characters of the headless CLI's output, once it has printed them."""
    assert process.stdout is not None
    seen = ""
    while len(seen) < chars:
        char = process.stdout.read(1)
        assert char, "the run ended before it produced text"
        seen += char
    return seen


def assert_recovered(saboteur: Saboteur, result: RunResult, model_path: Path, label: str) -> RunRecovered:
    """The run recovered from the loss of ``label`` once (40 greedy tokens,
    the unbroken run's, each streamed once); its RunRecovered."""
    assert saboteur.fired
    assert result.outcome == "completed", result.failure
    expected = whole_model_greedy(model_path, list(result.prompt_tokens), 40, n_ctx=512, n_ubatch=32)
    assert list(result.tokens) == expected, "the output differs from an unbroken run"
    streamed = [e.token for e in saboteur.events if isinstance(e, TokenStreamed) and e.sequence >= 0]
    assert streamed == list(result.tokens), "every token streamed once, in order"
    (recovered,) = [e for e in saboteur.events if isinstance(e, RunRecovered)]
    assert recovered.stages == label
    states = [e.state for e in saboteur.events if isinstance(e, StageRecovery)]
    assert states == ["Lost", "Recovering", "Ready"], states
    assert len([e for e in saboteur.events if isinstance(e, RunFinished)]) == 1
    return recovered


def signal_agent(stage: int, sig: int) -> Callable[[Pipeline], None]:
    def act(pipeline: Pipeline) -> None:
        hello = pipeline.links[stage].hello
        assert hello is not None
        os.kill(hello.pid, sig)  # the "host" is this machine

    return act


def on_state(stage: int, state: str) -> Callable[[Any], bool]:
    return lambda e: isinstance(e, StageStateChanged) and e.stage == stage and e.state == state


def on_token(sequence: int) -> Callable[[Any], bool]:
    return lambda e: isinstance(e, TokenStreamed) and e.sequence == sequence


async def run_with(saboteur: Saboteur, inventory: Path, prompt: str = LONG_PROMPT):
    pipeline = Pipeline(load_inventory(inventory), saboteur)
    saboteur.pipeline = pipeline
    try:
        await pipeline.start()
        return await pipeline.generate(prompt)
    finally:
        closing = time.monotonic()
        await pipeline.close()
        saboteur.close_seconds = time.monotonic() - closing


def assert_carried_on(events: list[Any], rebuilt: str) -> None:
    """The run was carried on in proportion (``rebuilt``: "stage 1 rebuilt"),
    or, where a stage was mid-step at the loss (its step aborted, its cache
    not to be trusted), it said why not and was replayed whole: the
    documented fallback (docs/recovery.md, "Replay in proportion"), which a
    kill's timing decides."""
    notices = [e.text for e in events if isinstance(e, Notice)]
    carried = [text for text in notices if " carries run " in text]
    if carried:
        assert rebuilt in carried[0], carried
    else:
        assert any("cannot carry the run on in proportion: stage" in text for text in notices), notices
