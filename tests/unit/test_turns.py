"""The TUI's typed prompts as conversation turns, without Textual or agents:
a prompt is submitted when the one before has ended, with every kept turn."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ggufpipe_agent.wire.protocol import ChatMessage
from ggufpipe_tui.core.events import RunResult, Timings
from ggufpipe_tui.session.runs import REFUSE, ContextOverflow, Prompt, RunHandle
from ggufpipe_tui.session.stages import PipelineError
from ggufpipe_tui.views.rows import ExchangeView
from ggufpipe_tui.views.turns import Turns
from tests.support.fakes import FACTS


@dataclass
class Queue:
    stopped: str = ""


@dataclass
class SubmittedPrompts:
    """What a turn hands the session: only its submits, recorded (the queue
    fake, tests/support/fakes.FakePipeline, runs them; these tests must not)."""

    queue: Queue = field(default_factory=Queue)
    prompts: list[Prompt] = field(default_factory=list)

    def submit(self, prompt: Prompt, stream: bool = False) -> RunHandle:
        self.prompts.append(prompt)
        return RunHandle(prompt, len(self.prompts), stream)


def result(run_id: int, text: str, outcome: str = "completed") -> RunResult:
    return RunResult(run_id, outcome, "eos", "", (1, 2), (3, 4), text, Timings())


def started(turns: Turns, run_id: int) -> None:
    """The session gave the turn in flight a run (as the queue does)."""
    assert turns.in_flight is not None and turns.in_flight.handle is not None
    turns.in_flight.handle.run_id = run_id
    turns.in_flight.handle.driver = object()  # type: ignore[assignment]


async def test_a_prompt_waits_for_the_one_before_and_carries_its_reply():
    turns = Turns(raw=False)
    turns.facts = replace(FACTS, chat_template="{{ messages }}")
    pipeline = SubmittedPrompts()
    turns.add(ExchangeView("France?"))
    turns.add(ExchangeView("Italy?"))
    assert turns.feed(None) is None, "no pipeline yet: they wait"
    first = turns.feed(pipeline)  # type: ignore[arg-type]
    assert first is not None and turns.feed(pipeline) is None, "one at a time"  # type: ignore[arg-type]
    assert pipeline.prompts[0].messages == (ChatMessage("user", "France?"),)
    assert pipeline.prompts[0].overflow == REFUSE
    assert turns.waiting() == 2, "the second, and the first until its run starts"
    started(turns, 7)
    assert turns.waiting() == 1
    assert turns.ended(result(7, "Paris.")) == ""
    assert turns.feed(pipeline) is not None  # type: ignore[arg-type]
    assert pipeline.prompts[1].messages == (
        ChatMessage("user", "France?"),
        ChatMessage("assistant", "Paris."),
        ChatMessage("user", "Italy?"),
    )
    assert turns.hint() == ""  # no context known yet
    turns.context = 2048
    assert turns.hint() == "conversation: 1 turn, 4/2048 tokens (ctrl+n: new)"


async def test_ctrl_n_gives_the_prompts_not_sent_a_new_conversation():
    turns = Turns(raw=False)
    turns.facts = replace(FACTS, chat_template="t")
    pipeline = SubmittedPrompts()
    turns.add(ExchangeView("one"))
    turns.feed(pipeline)  # type: ignore[arg-type]
    started(turns, 1)
    turns.add(ExchangeView("two"))
    fresh = turns.new_conversation()
    turns.ended(result(1, "reply one"))
    assert turns.conversation is fresh and fresh.number == 2
    turns.feed(pipeline)  # type: ignore[arg-type]
    assert pipeline.prompts[1].messages == (ChatMessage("user", "two"),), "no history in the new one"


async def test_a_refused_or_orphaned_prompt():
    turns = Turns(raw=False)
    turns.facts = replace(FACTS, chat_template="t")
    pipeline = SubmittedPrompts()
    turns.conversation.record("before", result(1, "kept"))
    turns.add(ExchangeView("too long"))
    turn = turns.feed(pipeline)  # type: ignore[arg-type]
    assert turn is not None
    said = turns.failed(turn, ContextOverflow(2000, 256, 2048))
    assert said is not None and "this conversation is 2000 tokens" in said.plain and "ctrl+n" in said.plain
    assert turns.in_flight is None and not turns.pending

    turns.add(ExchangeView("orphan"))
    turn = turns.feed(pipeline)  # type: ignore[arg-type]
    assert turn is not None
    pipeline.queue.stopped = "stage 1 lost"
    assert turns.failed(turn, PipelineError("not run: stage 1 lost")) is None
    assert list(turns.pending) == [turn], "it runs in the next session, first in line"
    assert turns.feed(pipeline) is None, "not into a stopped session"  # type: ignore[arg-type]


async def test_without_a_chat_template_each_prompt_stands_alone():
    turns = Turns(raw=False)
    turns.facts = FACTS  # no chat template
    pipeline = SubmittedPrompts()
    turns.add(ExchangeView("alone"))
    turns.feed(pipeline)  # type: ignore[arg-type]
    assert pipeline.prompts[0].messages == () and pipeline.prompts[0].text == "alone"
    assert (
        turns.no_chat_reason() == "the model has no chat template: each prompt stands alone, no conversation"
    )
    started(turns, 3)
    assert turns.ended(result(3, "x")) == "" and not turns.conversation.turns
