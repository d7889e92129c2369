"""The one request every front door translates into, and the pieces of its reply.

The server speaks several APIs (OpenAI's chat and legacy completions,
Anthropic's Messages, OpenAI's Responses); each is a translation: a request
body into a :class:`Completion`, and the run's :data:`Piece` stream back into
that API's answer or its server-sent events. The run itself (the pipeline,
tools, grammar, stop strings, logprobs) knows only these records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ggufpipe_tui.session.runs import RunOverrides

#: ``tool_choice`` values other than a named function.
TOOL_CHOICES = ("auto", "none", "required")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the assistant made: ``arguments`` is JSON text, as OpenAI carries it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of a conversation. ``role``: system, user, assistant or tool;
    an assistant turn may hold ``tool_calls``; a tool turn answers the call
    ``tool_call_id`` (of the function ``name``)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call; ``parameters`` is its JSON schema."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    strict: bool = False


@dataclass(frozen=True, slots=True)
class Completion:
    """A checked request, whichever API it came by.

    ``api``: "chat", "completions", "messages" or "responses" (how to answer).
    ``tool_choice``: one of :data:`TOOL_CHOICES`, or "function" with
    ``tool_name`` the function that must be called. ``grammar``: GBNF the
    reply is held to (from ``grammar``, ``json_schema`` or ``response_format``),
    ``schema`` the JSON schema it came from (the reply is checked against it).
    ``top_logprobs``: how many alternatives each token's logprobs name (with
    ``logprobs``). ``n``: choices, run in flight side by side.
    """

    api: str
    chat: bool
    messages: tuple[Message, ...] = ()
    prompt: str = ""
    tokens: tuple[int, ...] | None = None
    options: RunOverrides = field(default_factory=RunOverrides)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    cache_prompt: bool = True
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"
    tool_name: str = ""
    parallel_tool_calls: bool = True
    grammar: str = ""
    schema: Mapping[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    echo: bool = False
    model: str = ""  # as the client named it
    metadata: Mapping[str, Any] = field(default_factory=dict)  # what an API echoes back (Responses)

    @property
    def shown(self) -> str:
        """What the run log and the views show of the prompt."""
        if self.chat:
            users = [m.content for m in self.messages if m.role == "user"]
            return users[-1] if users else (self.messages[-1].content if self.messages else "")
        return self.prompt if self.tokens is None else f"{len(self.tokens)} token ids"


# ------------------------------------------------------------- the reply


@dataclass(frozen=True, slots=True)
class Alternative:
    """A token the model weighed at one place: its text, bytes and logprob."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    id: int = -1


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's logprob and the ``top`` alternatives at its place."""

    chosen: Alternative
    top: tuple[Alternative, ...] = ()


@dataclass(frozen=True, slots=True)
class Text:
    """Reply text, with the logprobs of the tokens it came from (when asked)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class CallStart:
    """The ``index``-th tool call of the reply begins: its id and function."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    """More of the ``index``-th call's arguments (JSON text, in pieces)."""

    index: int
    arguments: str


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Finish:
    """The reply's end: ``reason`` is "stop", "length" or "tool_calls";
    ``stop`` the stop string that ended it, if one did."""

    reason: str
    usage: Usage
    stop: str = ""


#: What a run's reply is made of, in order.
Piece = Text | CallStart | CallArguments | Finish
