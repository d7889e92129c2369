"""A conversation: the turns so far, what the next prompt sends, and what a
finished turn leaves in it. Pure: no I/O, no Textual.

Each prompt is the next user turn: the prompt sent is every kept turn (user
and assistant, the reply text exactly as the model produced it) plus the new
user message, which the model's chat template renders whole. What a turn
leaves depends on how its run ended:

* completed (end of text or max tokens): the prompt and the reply are kept;
* stopped by the user after some text: kept, the reply as far as it got (the
  user saw it and may say "go on");
* stopped before any text, faulted, or never run: nothing is kept, and the
  transcript says so; the next prompt continues from the turns before.
"""

from __future__ import annotations

from ggufpipe_agent.wire.protocol import ChatMessage
from ggufpipe_tui.core.events import RunResult

LEFT_OUT = "left out of the conversation"


class Conversation:
    """The kept turns of one conversation (state, so a plain class)."""

    def __init__(self, number: int = 1) -> None:
        self.number = number
        self.turns: list[ChatMessage] = []
        #: Tokens of the conversation after its last kept turn (that turn's
        #: prompt and reply): what the next prompt starts from.
        self.tokens = 0

    @property
    def exchanges(self) -> int:
        return sum(1 for turn in self.turns if turn.role == "user")

    def messages(self, text: str) -> tuple[ChatMessage, ...]:
        """What the next prompt sends: every kept turn, then ``text``."""
        return (*self.turns, ChatMessage("user", text))

    def record(self, text: str, result: RunResult) -> str:
        """Keep the turn of ``text`` as its run's end says; returns what the
        transcript should say about it ("" when it was kept whole)."""
        if result.outcome == "completed" and (result.stop_reason != "stopped" or result.tokens):
            self.turns += [ChatMessage("user", text), ChatMessage("assistant", result.text)]
            self.tokens = len(result.prompt_tokens) + len(result.tokens)
            if result.stop_reason == "stopped":
                return "stopped: the reply so far stays in the conversation"
            return ""
        if result.outcome == "completed":
            return f"stopped before a reply: this prompt is {LEFT_OUT}"
        if result.outcome == "faulted":
            return f"faulted: this turn is {LEFT_OUT}"
        return f"not run: this prompt is {LEFT_OUT}"
