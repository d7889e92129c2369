"""How each API writes a run's pieces: streamed (server-sent events) or whole.

One :class:`Renderer` per front door, over the translations of
:mod:`openai_answer`, :mod:`anthropic_api` and :mod:`responses_answer`;
the server's run loop (ggufpipe_tui/server/http.py) knows only this
interface, so a new API is a new renderer and a parser, not a new path.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ggufpipe_tui.server import anthropic_api, openai_answer, responses_answer
from ggufpipe_tui.server.api_common import collect
from ggufpipe_tui.server.request import (
    CallArguments,
    CallStart,
    Completion,
    Finish,
    Piece,
    Text,
    TokenLogprob,
    Usage,
)
from ggufpipe_tui.server.responses_api import ResponseStore


def sse(data: dict[str, Any], event: str = "") -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class Renderer:
    """A request's answer: :meth:`start`, a :meth:`piece` per piece of each
    choice, then :meth:`end` (streamed); or :meth:`whole`."""

    def __init__(self, c: Completion, ident: str, created: int, model: str) -> None:
        self.c, self.ident, self.created, self.model = c, ident, created, model
        self.timings: dict[str, float] | None = None  # llama-server's, when one choice ran

    def start(self) -> list[bytes]:
        return []

    def piece(self, index: int, piece: Piece) -> list[bytes]:
        raise NotImplementedError

    def end(self, usage: Usage) -> list[bytes]:
        return []

    def failed(self, status: int, message: str) -> list[bytes]:
        raise NotImplementedError

    def whole(self, choices: Sequence[Sequence[Piece]], usage: Usage) -> dict[str, Any]:
        raise NotImplementedError

    def error_body(self, status: int, message: str, kind: str) -> dict[str, Any]:
        from ggufpipe_tui.server.fields import error_body

        return error_body(message, kind)


class OpenAIRenderer(Renderer):
    """Chat and legacy completions, ``n`` choices."""

    def __init__(self, c: Completion, ident: str, created: int, model: str, prefix: str = "") -> None:
        super().__init__(c, ident, created, model)
        self.chunks = openai_answer.ChunkWriter(c, ident, created, model)
        self.prefix = prefix  # the prompt, with echo
        self.calls: set[int] = set()  # choices that made a call

    def start(self) -> list[bytes]:
        out = []
        for index in range(self.c.n):
            if self.c.chat:
                out.append(sse(self.chunks.role(index)))
            elif self.prefix:
                out.append(sse(self.chunks.text(index, self.prefix)))
        return out

    def piece(self, index: int, piece: Piece) -> list[bytes]:
        if isinstance(piece, Text):
            if not piece.text and not piece.logprobs:
                return []
            return [sse(self.chunks.text(index, piece.text, piece.logprobs))]
        if isinstance(piece, CallStart | CallArguments):
            self.calls.add(index)
            return [sse(self.chunks.call(index, piece))]
        assert isinstance(piece, Finish)
        reason = openai_answer.FINISH.get(piece.reason, "length")
        if index in self.calls and reason != "length":  # a cut reply says so, calls or not
            reason = "tool_calls"
        return [sse(self.chunks.finish(index, reason))]

    def end(self, usage: Usage) -> list[bytes]:
        out = []
        if self.c.include_usage:
            last = self.chunks.usage(usage)
            if self.timings is not None:
                last["timings"] = self.timings
            out.append(sse(last))
        return [*out, b"data: [DONE]\n\n"]

    def failed(self, status: int, message: str) -> list[bytes]:
        """An error object mid-stream, as llama-server and OpenAI send one
        (the SDK raises it), then the end; no choice gets a finish."""
        kind = {503: "unavailable_error"}.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        return [sse(self.error_body(status, message, kind)), b"data: [DONE]\n\n"]

    def whole(self, choices: Sequence[Sequence[Piece]], usage: Usage) -> dict[str, Any]:
        replies = [collect(pieces) for pieces in choices]
        logprobs = [_logprobs(pieces) for pieces in choices]
        body = openai_answer.answer(
            self.c, self.ident, self.created, self.model, replies, logprobs, usage, self.prefix
        )
        if self.timings is not None:
            body["timings"] = self.timings
        return body


def _logprobs(pieces: Sequence[Piece]) -> list[TokenLogprob]:
    return [entry for piece in pieces if isinstance(piece, Text) for entry in piece.logprobs]


class AnthropicRenderer(Renderer):
    """Anthropic's Messages API (one choice)."""

    def __init__(self, c: Completion, ident: str, created: int, model: str) -> None:
        super().__init__(c, ident, created, model)
        self.stream = anthropic_api.MessageStream(c, ident, model)

    def start(self) -> list[bytes]:
        return [sse(data, name) for name, data in self.stream.start(0)]

    def piece(self, index: int, piece: Piece) -> list[bytes]:
        return [sse(data, name) for name, data in self.stream.feed(piece)]

    def failed(self, status: int, message: str) -> list[bytes]:
        return [sse(data, name) for name, data in self.stream.fail(status, message)]

    def whole(self, choices: Sequence[Sequence[Piece]], usage: Usage) -> dict[str, Any]:
        return anthropic_api.message_answer(self.c, self.ident, self.model, choices[0])

    def error_body(self, status: int, message: str, kind: str) -> dict[str, Any]:
        return anthropic_api.error_body(status, message)


class ResponsesRenderer(Renderer):
    """OpenAI's Responses API (one choice); a finished answer is kept for
    ``previous_response_id``."""

    def __init__(self, c: Completion, ident: str, created: int, model: str, store: ResponseStore) -> None:
        super().__init__(c, ident, created, model)
        self.store = store
        self.stream = responses_answer.ResponseStream(c, ident, model)

    def start(self) -> list[bytes]:
        return [sse(data, name) for name, data in self.stream.start()]

    def piece(self, index: int, piece: Piece) -> list[bytes]:
        out = [sse(data, name) for name, data in self.stream.feed(piece)]
        if isinstance(piece, Finish):
            self.store.save(self.ident, self.c, self.stream.pieces)
        return out

    def failed(self, status: int, message: str) -> list[bytes]:
        return [sse(data, name) for name, data in self.stream.fail(message)]

    def whole(self, choices: Sequence[Sequence[Piece]], usage: Usage) -> dict[str, Any]:
        self.store.save(self.ident, self.c, choices[0])
        return responses_answer.response_object(
            self.c, self.ident, self.model, choices[0], created=self.created
        )
