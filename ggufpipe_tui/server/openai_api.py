"""The OpenAI API's shapes, for the server (:mod:`ggufpipe_tui.server.http`).

Pure: request bodies in, checked :class:`Request` records or
:class:`ApiError` out; answers, stream chunks and error bodies as plain dicts
shaped as the OpenAI API (and llama.cpp's server) shape them; and
:class:`StopScanner`, which applies ``stop`` strings to text as it streams.

Accepted: ``model`` (any string; the answer names the one model served),
``messages`` (system, developer, user and assistant turns; content a string
or a list of text parts) or ``prompt`` (a string, one string in a list, or
token ids), ``max_tokens`` / ``max_completion_tokens``, ``temperature``,
``top_p``, ``top_k`` (as llama.cpp), ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, ``n`` = 1, llama-server's ``ignore_eos``
(generate ``max_tokens`` past the end of text) and ``cache_prompt`` (false:
compute the whole prompt, keeping nothing of earlier requests), and fields that change nothing
at their default (``user``, ``presence_penalty`` 0, ...). Refused by name,
with a 400: anything this server cannot honour (tools, logprobs, n > 1, ...).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ggufpipe_agent.errors import GgufpipeError
from ggufpipe_agent.wire.codec import MAX_PROMPT_TURNS, text_problem
from ggufpipe_agent.wire.protocol import ChatMessage
from ggufpipe_agent.wire.records import SEED_MAX, SEED_MIN, TOP_K_MAX
from ggufpipe_tui.session.runs import RunOverrides

#: The most stop strings a request may give (OpenAI allows 4).
MAX_STOPS = 16
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
INT64 = 1 << 63

#: Fields that change nothing as long as they have their default value:
#: anything else is refused by name instead of silently ignored.
DEFAULTS: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logprobs": (False, None),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
}


class ApiError(GgufpipeError):
    """An answer that is an error: HTTP status and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}  # e.g. Retry-After on a 503 while the pipeline recovers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True, slots=True)
class Request:
    """A checked completion request."""

    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    messages: tuple[ChatMessage, ...]
    prompt: str
    tokens: tuple[int, ...] | None  # /v1/completions with token ids
    options: RunOverrides
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    cache_prompt: bool = True  # llama-server's: False keeps nothing the stages hold

    @property
    def shown(self) -> str:
        """What the run log and the views show of the prompt."""
        if self.chat:
            users = [m.content for m in self.messages if m.role == "user"]
            return users[-1] if users else self.messages[-1].content
        return self.prompt if self.tokens is None else f"{len(self.tokens)} token ids"


# ------------------------------------------------------------------ parsing


def parse_chat(body: object) -> Request:
    fields = _object(body)
    raw = fields.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "a non-empty list of messages is required")
    if len(raw) > MAX_PROMPT_TURNS:
        raise bad("messages", f"at most {MAX_PROMPT_TURNS} messages, not {len(raw)}")
    messages = tuple(_message(item, f"messages[{index}]") for index, item in enumerate(raw))
    return _request(fields, chat=True, messages=messages, prompt="", tokens=None)


def parse_completion(body: object) -> Request:
    fields = _object(body)
    if "prompt" not in fields:
        raise bad("prompt", "a prompt is required")
    prompt, tokens = _prompt(fields["prompt"])
    return _request(fields, chat=False, messages=(), prompt=prompt, tokens=tokens)


def _object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, allowed in DEFAULTS.items():
        if name in body and body[name] is not None and not _same(body[name], allowed):
            raise bad(name, f"{body[name]!r} is not supported by this server")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad("response_format", "only {'type': 'text'} is supported by this server")
    return body


def _same(value: object, allowed: tuple[object, ...]) -> bool:
    for choice in allowed:
        if isinstance(choice, bool) or isinstance(value, bool):
            if value is choice:  # True == 1 in Python: a bool only matches a bool
                return True
        elif value == choice:
            return True
    return False


def _message(item: object, where: str) -> ChatMessage:
    if not isinstance(item, dict):
        raise bad(where, "a message is an object with a role and a content")
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
    if item.get("tool_calls") or item.get("function_call"):
        raise bad(f"{where}.tool_calls", "tool calls are not supported by this server")
    return ChatMessage(ROLES[role], _content(item.get("content"), f"{where}.content"))


def _text(text: str, where: str) -> str:
    """Text that can reach the stages, or a 400 naming the field."""
    problem = text_problem(text)
    if problem:
        raise bad(where, problem)
    return text


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return _text(content, where)
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise bad(f"{where}[{index}]", "only text parts {'type': 'text', 'text': ...} are supported")
            parts.append(_text(text, f"{where}[{index}]"))
        return "".join(parts)
    raise bad(where, "a string or a list of text parts is required")


def _prompt(value: object) -> tuple[str, tuple[int, ...] | None]:
    if isinstance(value, str):
        return _text(value, "prompt"), None
    if isinstance(value, list) and value and all(_is_int(v) for v in value):
        return "", tuple(_token(v) for v in value)
    if isinstance(value, list) and len(value) == 1:
        return _prompt(value[0])
    raise bad("prompt", "a string, a list with one string, or a list of token ids is required")


def _token(value: int) -> int:
    if not 0 <= value < 1 << 31:
        raise bad("prompt", f"token id {value} is out of range")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(
    fields: Mapping[str, Any], name: str, low: float, high: float, low_open: bool = False
) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(name, f"a number is required, not {value!r}")
    try:
        finite = math.isfinite(value)  # Python's JSON reads NaN and Infinity, and integers of any size
    except OverflowError:
        finite = False
    if not finite:
        raise bad(name, f"a finite number is required, not {value!r}")
    if value < low or value > high or (low_open and value == low):
        bound = "(" if low_open else "["
        raise bad(name, f"{value!r} is not in {bound}{low:g}, {high:g}]")
    return float(value)


def _integer(fields: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad(name, f"an integer is required, not {value!r}")
    if not low <= value <= high:
        raise bad(name, f"{value} is not in [{low}, {high}]")
    return int(value)


def _stops(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "a string or a list of strings is required")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop strings, not {len(stops)}")
    for stop in stops:
        _text(stop, "stop")
    return tuple(s for s in stops if s)  # an empty stop string stops nothing (as llama.cpp)


def _request(
    fields: Mapping[str, Any],
    chat: bool,
    messages: tuple[ChatMessage, ...],
    prompt: str,
    tokens: tuple[int, ...] | None,
) -> Request:
    model = fields.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "a string is required")
    stream = fields.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", "true or false is required")
    include_usage = False
    stream_options = fields.get("stream_options")
    if stream_options is not None:
        wanted = stream_options.get("include_usage", False) if isinstance(stream_options, dict) else None
        if not isinstance(wanted, bool):
            raise bad("stream_options", "an object with include_usage true or false is required")
        if not stream:
            raise bad("stream_options", "only allowed with stream: true")
        include_usage = wanted
    max_tokens = _integer(fields, "max_completion_tokens", 1, INT64 - 1)
    if max_tokens is None:
        max_tokens = _integer(fields, "max_tokens", 1, INT64 - 1)
    options = RunOverrides(
        max_tokens=max_tokens,
        temperature=_number(fields, "temperature", 0.0, 2.0),
        top_k=_integer(fields, "top_k", 0, TOP_K_MAX),
        top_p=_number(fields, "top_p", 0.0, 1.0, low_open=True),
        seed=_integer(fields, "seed", SEED_MIN, SEED_MAX),
        ignore_eos=_boolean(fields, "ignore_eos"),
    )
    cache_prompt = _boolean(fields, "cache_prompt")
    stops = _stops(fields.get("stop"))
    return Request(
        chat, messages, prompt, tokens, options, stops, stream, include_usage, cache_prompt is not False
    )


def _boolean(fields: Mapping[str, Any], name: str) -> bool | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(name, f"true or false is required, not {value!r}")
    return value


# ---------------------------------------------------------------- answers


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The answer's ``usage``; ``cached_tokens``: leading prompt tokens the
    stages kept from the previous run instead of computing them (prefix
    reuse), where OpenAI reports its prompt caching."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
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


def answer(
    request: Request, ident: str, created: int, model: str, text: str, finish: str, counts: dict[str, Any]
) -> dict[str, Any]:
    """The whole answer of a request that is not streamed."""
    if request.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {
        "id": ident,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": counts,
    }


def chunk(
    request: Request,
    ident: str,
    created: int,
    model: str,
    text: str | None = None,
    finish: str | None = None,
    role: bool = False,
) -> dict[str, Any]:
    """One server-sent event of a streamed answer: text, or the first (the
    role) or last (the finish reason) of a chat answer."""
    if request.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}


def usage_chunk(
    request: Request, ident: str, created: int, model: str, counts: dict[str, Any]
) -> dict[str, Any]:
    """The last event when ``stream_options.include_usage``: no choices, the usage."""
    kind = "chat.completion.chunk" if request.chat else "text_completion"
    return {"id": ident, "object": kind, "created": created, "model": model, "choices": [], "usage": counts}


# -------------------------------------------------------------- stop strings


class StopScanner:
    """Applies stop strings to text as it streams: :meth:`feed` returns the
    text that can go out now and holds back any tail that may be the start of
    a stop string; once one appears, :attr:`stopped` is set and neither it
    nor anything after it is returned."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = ""  # the stop string that ended the text

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        if not self.stops:
            self.held = ""
            return text
        found = [(text.find(stop), stop) for stop in self.stops]
        hits = [(at, stop) for at, stop in found if at >= 0]
        if hits:
            at, stop = min(hits)
            self.stopped, self.held = stop, ""
            return text[:at]
        keep = max((self._overlap(text, stop) for stop in self.stops), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The end of the text: what was held back goes out."""
        held, self.held = self.held, ""
        return "" if self.stopped else held

    @staticmethod
    def _overlap(text: str, stop: str) -> int:
        """The longest tail of ``text`` that begins ``stop`` (shorter than it)."""
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                return length
        return 0
