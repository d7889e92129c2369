"""OpenAI's answers, from a run's pieces: chat and legacy completions, whole
or as stream chunks, with tool calls, logprobs and ``n`` choices. Pure."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from ggufpipe_tui.server.api_common import Reply
from ggufpipe_tui.server.request import CallArguments, CallStart, Completion, TokenLogprob, Usage

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(counts: Usage) -> dict[str, Any]:
    """The answer's ``usage``; ``cached_tokens``: leading prompt tokens the
    stages kept from the previous run instead of computing them (prefix
    reuse), where OpenAI reports its prompt caching."""
    return {
        "prompt_tokens": counts.prompt_tokens,
        "completion_tokens": counts.completion_tokens,
        "total_tokens": counts.prompt_tokens + counts.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": counts.cached_tokens},
    }


def timings(
    prompt_tokens: int, prompt_ms: float, predicted: int, predicted_ms: float, cached_tokens: int = 0
) -> dict[str, float]:
    """llama.cpp's server's ``timings``: prefill and decode, as measured here;
    ``cache_n`` prompt tokens were kept, ``prompt_n`` computed."""
    return {
        "cache_n": cached_tokens,
        "prompt_n": prompt_tokens - cached_tokens,
        "prompt_ms": round(prompt_ms, 3),
        "predicted_n": predicted,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_second": round((predicted - 1) / (predicted_ms / 1000.0), 3)
        if predicted > 1 and predicted_ms > 0
        else 0.0,
    }


# ------------------------------------------------------------------ logprobs


def _alternative(token: str, logprob: float, raw: Sequence[int], ident: int) -> dict[str, Any]:
    """One token's logprob record; ``id`` as llama-server gives it."""
    return {"id": ident, "token": token, "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's ``logprobs``: ``content``, a record per token with its alternatives."""
    content = []
    for entry in entries:
        chosen = entry.chosen
        record = _alternative(chosen.token, chosen.logprob, chosen.bytes, chosen.id)
        record["top_logprobs"] = [_alternative(a.token, a.logprob, a.bytes, a.id) for a in entry.top]
        content.append(record)
    return {"content": content, "refusal": None}


def legacy_logprobs(entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions' ``logprobs``: tokens, their logprobs, the
    alternatives as {token: logprob}, and each token's offset in the text
    (from ``offset``, where the reply's text begins)."""
    tokens, values, tops, offsets = [], [], [], []
    for entry in entries:
        tokens.append(entry.chosen.token)
        values.append(entry.chosen.logprob)
        tops.append({a.token: a.logprob for a in entry.top})
        offsets.append(offset)
        offset += len(entry.chosen.token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


# ------------------------------------------------------------------- answers


def _calls(reply: Reply) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in reply.calls
    ]


def finish_reason(reply: Reply) -> str:
    if reply.finish is not None and reply.finish.reason == "length":
        return "length"  # a reply cut by max_tokens says so, calls or not (as OpenAI's)
    if reply.calls:
        return "tool_calls"
    return FINISH.get(reply.finish.reason if reply.finish else "length", "length")


def answer(
    c: Completion,
    ident: str,
    created: int,
    model: str,
    replies: Sequence[Reply],
    logprobs: Sequence[Sequence[TokenLogprob]],
    counts: Usage,
    prefix: str = "",
) -> dict[str, Any]:
    """The whole answer of a request that is not streamed: a choice per reply.
    ``prefix``: the prompt's text, with ``echo``."""
    choices = []
    for index, (reply, entries) in enumerate(zip(replies, logprobs, strict=True)):
        if c.chat:
            message: dict[str, Any] = {"role": "assistant", "content": reply.text}
            if reply.calls:
                message["content"] = reply.text.strip() or None
                message["tool_calls"] = _calls(reply)
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "logprobs": chat_logprobs(entries) if c.logprobs else None,
                "finish_reason": finish_reason(reply),
            }
        else:
            choice = {
                "index": index,
                "text": prefix + reply.text,
                "logprobs": legacy_logprobs(entries, len(prefix)) if c.logprobs else None,
                "finish_reason": finish_reason(reply),
            }
        choices.append(choice)
    kind = "chat.completion" if c.chat else "text_completion"
    body = {"id": ident, "object": kind, "created": created, "model": model, "choices": choices}
    return body | {"usage": usage(counts)}


class ChunkWriter:
    """One request's stream chunks, choice by choice."""

    def __init__(self, c: Completion, ident: str, created: int, model: str) -> None:
        self.c, self.ident, self.created, self.model = c, ident, created, model
        self.offsets: dict[int, int] = {}  # legacy logprobs: where each choice's text is

    def _chunk(
        self, index: int, delta: dict[str, Any] | None, text: str, finish: str | None, logprobs: Any
    ) -> dict:
        c = self.c
        if c.chat:
            choice: dict[str, Any] = {"index": index, "delta": delta or {}, "logprobs": logprobs}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs}
            kind = "text_completion"
        choice["finish_reason"] = finish
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def role(self, index: int) -> dict[str, Any]:
        return self._chunk(index, {"role": "assistant", "content": ""}, "", None, None)

    def text(self, index: int, text: str, entries: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        logprobs = None
        if self.c.logprobs:
            if self.c.chat:
                logprobs = chat_logprobs(entries)
            else:
                at = self.offsets.get(index, 0)
                logprobs = legacy_logprobs(entries, at)
        self.offsets[index] = self.offsets.get(index, 0) + len(text)
        return self._chunk(index, {"content": text}, text, None, logprobs)

    def call(self, index: int, piece: CallStart | CallArguments) -> dict[str, Any]:
        if isinstance(piece, CallStart):
            call: dict[str, Any] = {"index": piece.index, "id": piece.id, "type": "function"}
            call["function"] = {"name": piece.name, "arguments": ""}
        else:
            call = {"index": piece.index, "function": {"arguments": piece.arguments}}
        return self._chunk(index, {"tool_calls": [call]}, "", None, None)

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        return self._chunk(index, {}, "", reason, None)

    def usage(self, counts: Usage) -> dict[str, Any]:
        """The last event when ``stream_options.include_usage``: no choices, the usage."""
        kind = "chat.completion.chunk" if self.c.chat else "text_completion"
        body = {"id": self.ident, "object": kind, "created": self.created, "model": self.model, "choices": []}
        return body | {"usage": usage(counts)}
