"""A request's run on the pipeline: the prompts it makes, and each choice's
reply as :data:`~ggufpipe_tui.server.request.Piece` s.

:func:`prompts_for` renders what the API said into what the pipeline runs:
the conversation and its tools through the model's chat template (the tools
as the template renders them, or described in a system message for a
template that knows none), the grammar the reply is held to (a request's
form, or the call a ``required`` or named ``tool_choice`` forces), the
logprobs asked, one prompt per choice (``n``, run in flight side by side,
each with its own seed). :class:`ChoiceRun` follows one choice's run: stop
strings, then the family's tool-call parser over the text, and each token's
logprobs with the text it made.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from ggufpipe_agent.wire.records import ChatMessage
from ggufpipe_tui.core.events import Event, RunFinished, RunResult, TokenStreamed
from ggufpipe_tui.server.fields import StopScanner
from ggufpipe_tui.server.json_grammar import ChatFormText, chat_form
from ggufpipe_tui.server.request import (
    Alternative,
    CallStart,
    Completion,
    Finish,
    Message,
    Piece,
    Text,
    TokenLogprob,
    Usage,
)
from ggufpipe_tui.server.tools import Family, Parser, family_for
from ggufpipe_tui.server.tools.render import object_arguments, template_messages, template_tools
from ggufpipe_tui.session.runs import REFUSE, SHORTEN, Prompt, RunHandle


class Faulted(Exception):
    """A choice's run faulted: what the pipeline said."""


class Vocabulary(Protocol):
    """What a choice's reply needs of the model: token pieces."""

    pieces: tuple[bytes, ...]
    special_pieces: dict[int, bytes]


def prompts_for(c: Completion, template: str, base_seed: int) -> tuple[list[Prompt], Family | None]:
    """The prompts of ``c`` (one per choice) and the tool-call family its
    reply is parsed by (None: no tools in play). ``template``: the chat
    template in use; ``base_seed``: the inventory's, for choices past the first."""
    family = None
    messages = list(c.messages)
    tools = ""
    grammar = c.grammar
    with_calls = any(m.tool_calls or m.role == "tool" for m in messages)
    if (c.tools and c.tool_choice != "none") or with_calls:
        family = family_for(template)
    if c.tools and c.tool_choice != "none" and family is not None:
        if family.native:
            tools = json.dumps(template_tools(c.tools), ensure_ascii=False)
        else:
            described = family.system_prompt(c.tools, c.tool_choice, c.tool_name, c.parallel_tool_calls)
            messages = _with_system(messages, described)
        if c.tool_choice in ("required", "function"):
            grammar = family.call_grammar(c.tools, c.tool_name or None, c.parallel_tool_calls)
        elif not grammar:
            grammar = family.auto_grammar(c.tools, c.parallel_tool_calls)
    elif c.tool_choice == "none":
        family = None if not with_calls else family
    extra = dict(c.options.extra)
    if grammar and chat_form_of(c):
        # llama-server's chat under a schema: the JSON, or the JSON in a ```json fence
        # (unwrapped as it streams: ChoiceRun), so a greedy reply is llama-server's.
        grammar = chat_form(grammar)
    if grammar:
        extra["grammar"] = grammar
    if c.logprobs:
        extra["logprobs"] = c.top_logprobs
    options = replace(c.options, extra=tuple(extra.items()))
    wire = _wire_messages(messages, family, template) if c.chat else ()
    prompts = []
    for index in range(c.n):
        seeded = options
        if index:  # each choice its own draw (greedy ones are alike, as llama-server's)
            seed = (options.seed if options.seed is not None else base_seed) + index
            seeded = replace(options, seed=seed)
        prompts.append(
            Prompt(
                text=c.shown,
                tokens=c.tokens,
                chat=c.chat,
                messages=wire,
                options=seeded,
                # An explicit max_tokens that cannot fit is an error, as OpenAI says;
                # without one, the reply takes the room the context has left.
                overflow=REFUSE if c.options.max_tokens is not None else SHORTEN,
                cache_prompt=c.cache_prompt,
                tools=tools,
            )
        )
    # The parser only where tools are offered: a reply to a request without
    # them is text, whatever it looks like.
    return prompts, family if c.tools and c.tool_choice != "none" else None


def chat_form_of(c: Completion) -> bool:
    """Whether ``c``'s reply is a chat reply held to a schema (not a raw grammar, not a call)."""
    return c.chat and c.schema is not None and not (c.tools and c.tool_choice != "none")


def _with_system(messages: list[Message], text: str) -> list[Message]:
    if not text:
        return messages
    if messages and messages[0].role == "system":
        first = messages[0]
        return [
            replace(first, content=f"{first.content}\n\n{text}" if first.content else text),
            *messages[1:],
        ]
    return [Message("system", text), *messages]


def _wire_messages(
    messages: Sequence[Message], family: Family | None, template: str
) -> tuple[ChatMessage, ...]:
    if family is None:
        return tuple(ChatMessage(m.role, m.content) for m in messages)
    rendered = template_messages(messages, family, object_arguments(template))
    out = []
    for turn in rendered:
        role, content = turn.pop("role"), turn.pop("content")
        out.append(ChatMessage(role, content, json.dumps(turn, ensure_ascii=False) if turn else ""))
    return tuple(out)


class ChoiceRun:
    """One choice's run, its text turned into pieces as it streams."""

    def __init__(
        self, c: Completion, handle: RunHandle, vocabulary: Vocabulary, family: Family | None, index: int = 0
    ) -> None:
        self.c, self.handle, self.index = c, handle, index
        self.vocabulary = vocabulary
        self.scanner = StopScanner(c.stop)
        self.form = ChatFormText() if chat_form_of(c) else None
        self.parser: Parser | None = family.parser(c.tools, stream=c.stream) if family is not None else None
        self.special: Mapping[int, bytes] = vocabulary.special_pieces if family is not None else {}
        self.counted = 0  # tokens streamed (what the usage counts)
        self._held: list[str] = []  # a reply not streamed: its text, parsed at the end
        self.calls = 0
        self._logprobs: list[TokenLogprob] = []
        self.result: RunResult | None = None

    async def pieces(self, events: AsyncIterator[Event]) -> AsyncIterator[Piece]:
        """The reply's pieces, ending with its :class:`Finish`; raises
        :class:`Faulted` (after what was produced) when the run faulted."""
        scanner = self.scanner
        async for event in events:
            if isinstance(event, TokenStreamed) and not scanner.stopped:
                self.counted += event.sequence >= 0
                if event.logprobs is not None:
                    self._logprobs.append(self._logprob(event.token, *event.logprobs))
                text = event.text
                if event.token in self.special:
                    text = self.special[event.token].decode("utf-8", "replace")
                if self.form is not None:
                    text = self.form.feed(text)
                out = scanner.feed(text)
                if scanner.stopped:
                    self.handle.stop(f"stop string {scanner.stopped!r}")
                for piece in self._parse(out):
                    yield piece
            elif isinstance(event, RunFinished):
                break
        result = self.result = await self.handle.result()
        tail = scanner.feed(self.form.end()) if self.form is not None and not scanner.stopped else ""
        for piece in self._parse(tail + scanner.flush(), end=True):
            yield piece
        if self._logprobs:
            yield Text("", tuple(self._logprobs))
            self._logprobs.clear()
        if result.outcome == "faulted":
            raise Faulted(result.failure)
        if not (scanner.stopped or result.stop_reason == "eos"):
            reason = "length"  # cut, calls or not: its last call may be unfinished
        elif self.calls:
            reason = "tool_calls"
        else:
            reason = "stop"
        usage = Usage(len(result.prompt_tokens), self.counted, result.prompt_reused)
        yield Finish(reason, usage, scanner.stopped)

    def _parse(self, text: str, end: bool = False) -> list[Piece]:
        if self.parser is None:
            pieces: list[Piece] = [Text(text)] if text else []
        elif not self.c.stream:
            # Whole at the end: the parser gives the same pieces however the
            # text is cut, and read once a long call is not scanned per token.
            self._held.append(text)
            if not end:
                return []
            whole = "".join(self._held)
            pieces = (self.parser.feed(whole) if whole else []) + self.parser.close()
        else:
            pieces = self.parser.feed(text) if text else []
            if end:
                pieces += self.parser.close()
        out: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, CallStart):
                self.calls += 1
            if isinstance(piece, Text) and self._logprobs:
                piece = Text(piece.text, tuple(self._logprobs))
                self._logprobs.clear()
            out.append(piece)
        return out

    def _logprob(self, token: int, logprob: float, top: tuple[tuple[int, float], ...]) -> TokenLogprob:
        return TokenLogprob(self._alternative(token, logprob), tuple(self._alternative(t, v) for t, v in top))

    def _alternative(self, token: int, logprob: float) -> Alternative:
        pieces = self.vocabulary.pieces
        raw = pieces[token] if 0 <= token < len(pieces) else b""
        if not raw:
            raw = self.vocabulary.special_pieces.get(token, b"")
        return Alternative(raw.decode("utf-8", "replace"), logprob, tuple(raw), token)
