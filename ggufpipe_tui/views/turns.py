"""The TUI's typed prompts as the turns of a conversation.

A prompt is sent with every kept turn before it, and the reply of the turn
before is part of it, so typed prompts wait here and the next is submitted
only when the one before has ended. Each typed prompt remembers the
conversation it continues; ``ctrl+n`` gives the prompts not sent yet a new
one. A prompt whose conversation and reply would not fit the context is
refused by the session before it runs (:data:`~ggufpipe_tui.session.runs.REFUSE`);
a prompt that never ran because the session stopped first runs in the next
session. No widgets here: the app shows what these return.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rich.text import Text

from ggufpipe_agent.wire.protocol import ModelFacts
from ggufpipe_tui.core.conversation import Conversation
from ggufpipe_tui.core.events import RunResult
from ggufpipe_tui.session.runs import REFUSE, ContextOverflow, Prompt
from ggufpipe_tui.session.stages import PipelineError
from ggufpipe_tui.views.rows import ExchangeView
from ggufpipe_tui.views.threaded import AppHandle, AppPipeline


@dataclass(eq=False)
class Turn:
    """A typed prompt on its way: its exchange on screen, the conversation it
    continues, and its handle once it is submitted."""

    view: ExchangeView
    conversation: Conversation
    handle: AppHandle | None = None
    pipeline: AppPipeline | None = None

    @property
    def started(self) -> bool:
        return self.handle is not None and self.handle.started


class Turns:
    def __init__(self, raw: bool) -> None:
        self.raw = raw  # the inventory sends prompts as they are (no chat template)
        self.conversation = Conversation(1)  # the one new prompts continue
        self.pending: deque[Turn] = deque()  # typed, not submitted (or to run in the next session)
        self.in_flight: Turn | None = None  # submitted, not ended
        self.facts: ModelFacts | None = None  # this session's model (its chat template)
        self.context = 0  # the plan's context in tokens

    @property
    def chat(self) -> bool:
        """Whether prompts are conversation turns: the model has a chat
        template and the inventory does not send prompts raw."""
        return not self.raw and self.facts is not None and bool(self.facts.chat_template)

    def no_chat_reason(self) -> str:
        why = "prompts go raw" if self.raw else "the model has no chat template"
        return f"{why}: each prompt stands alone, no conversation"

    def waiting(self) -> int:
        """Typed prompts that wait for their turn."""
        turn = self.in_flight
        return len(self.pending) + (turn is not None and not turn.started)

    def add(self, view: ExchangeView) -> None:
        self.pending.append(Turn(view, self.conversation))

    def feed(self, pipeline: AppPipeline | None) -> Turn | None:
        """Submit the next typed prompt if the one before has ended; returns
        it (the app watches its handle)."""
        if self.in_flight is not None or not self.pending or self.facts is None:
            return None
        if pipeline is None or pipeline.queue.stopped:
            return None
        turn = self.pending.popleft()
        text = turn.view.prompt
        messages = turn.conversation.messages(text) if self.chat else ()
        prompt = Prompt(text=text, messages=messages, overflow=REFUSE, submitted=turn.view.submitted)
        turn.handle, turn.pipeline = pipeline.submit(prompt), pipeline
        self.in_flight = turn
        return turn

    def failed(self, turn: Turn, error: PipelineError) -> Text | None:
        """A submitted prompt failed without a run. Returns what its exchange
        says, or None when there is nothing to say (it was no longer ours,
        or it runs in the next session)."""
        if self.in_flight is not turn or turn.started:
            return None  # ended by a restart, or its run's RunFinished says the rest
        self.in_flight = None
        stopped = turn.pipeline is not None and bool(turn.pipeline.queue.stopped)
        if stopped and not isinstance(error, ContextOverflow):
            self.pending.appendleft(turn)  # the session stopped first: it runs in the next one
            return None
        if not isinstance(error, ContextOverflow):
            return Text(f"not run: {error}", style="bold red")
        if turn.conversation.turns:
            said = (
                f"not run: this conversation is {error.prompt_tokens} tokens and a reply may take "
                f"{error.max_tokens} more; the context holds {error.context}. ctrl+n starts a new "
                "conversation (the prompt is back in the input)"
            )
        else:
            said = (
                f"not run: the prompt is {error.prompt_tokens} tokens and a reply may take "
                f"{error.max_tokens} more; the context holds {error.context} (raise run.context "
                "or --context, or lower max_tokens)"
            )
        return Text(said, style="yellow")

    def ended(self, result: RunResult) -> str:
        """A run finished; if it was ours, what it leaves in its conversation
        (what the transcript says of it, "" for nothing)."""
        turn = self.in_flight
        if turn is None or turn.handle is None or turn.handle.run_id != result.run_id:
            return ""
        self.in_flight = None
        return turn.conversation.record(turn.view.prompt, result) if self.chat else ""

    def new_session(self) -> Turn | None:
        """A restart: a prompt not started yet runs in the next session (put
        back first in line); one that was running ends with the old pipeline
        and leaves nothing. Returns that one, for its exchange to say so."""
        turn, self.in_flight = self.in_flight, None
        self.facts = None
        if turn is None:
            return None
        if not turn.started:
            self.pending.appendleft(turn)
            return None
        return turn

    def new_conversation(self) -> Conversation:
        """The next prompt starts fresh; prompts typed but not sent yet go with it."""
        self.conversation = Conversation(self.conversation.number + 1)
        for turn in self.pending:
            turn.conversation = self.conversation
        return self.conversation

    def hint(self) -> str:
        """How full the conversation is, for the status line ("" when empty)."""
        conversation = self.conversation
        if not conversation.turns or not self.context:
            return ""
        turns = conversation.exchanges
        return (
            f"conversation: {turns} turn{'s' if turns != 1 else ''}, "
            f"{conversation.tokens}/{self.context} tokens (ctrl+n: new)"
        )
