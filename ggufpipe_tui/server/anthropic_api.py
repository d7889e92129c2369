"""Anthropic's Messages API (``POST /v1/messages``), as a translation.

Pure: :func:`parse_messages` turns a request body into a
:class:`~ggufpipe_tui.server.request.Completion` (or raises
:class:`~ggufpipe_tui.server.openai_api.ApiError`, whose status and message
:func:`error_body` puts in Anthropic's error shape); :func:`message_answer`
and :class:`MessageStream` turn the run's pieces into the answer, whole or as
the server-sent events the Anthropic SDK reads.

Accepted: ``model``, ``max_tokens`` (required, as Anthropic requires it),
``messages`` (user and assistant turns; content a string or ``text``,
``tool_use`` and ``tool_result`` blocks), ``system`` (a string or text
blocks), ``tools`` (custom tools: ``name``, ``description``,
``input_schema``), ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``;
``disable_parallel_tool_use``), ``stop_sequences``, ``stream``,
``temperature`` (0 to 1, Anthropic's range), ``top_p``, ``top_k``,
``output_config.format`` (a JSON schema the reply is held to), and what
changes nothing here: ``metadata``, ``service_tier``, ``cache_control`` on
blocks (the stages keep the longest common prefix of the prompt by
themselves), ``thinking`` ``{"type": "disabled"}``. The text blocks of a
turn are joined by newlines, the system's one after the other (as
llama-server does), and Claude Code's per-request ``cch`` stamp is blanked
so that the stages keep the prompt from one request to the next. Refused by
name, with a 400: any other field, image and document blocks, server tools,
extended thinking, a ``tool_result`` that answers no earlier ``tool_use``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ggufpipe_agent.wire.codec import MAX_PROMPT_TURNS
from ggufpipe_agent.wire.records import TOP_K_MAX
from ggufpipe_tui.server import api_common as common
from ggufpipe_tui.server.fields import INT64, ApiError, bad, integer, number
from ggufpipe_tui.server.request import (
    CallArguments,
    CallStart,
    Completion,
    Finish,
    Message,
    Piece,
    Text,
    Tool,
    ToolCall,
    Usage,
)
from ggufpipe_tui.server.sampling import schema_grammar
from ggufpipe_tui.session.runs import RunOverrides

FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "metadata",
        "thinking",
        "service_tier",
        "output_config",
    }
)
TOOL_FIELDS = frozenset(
    {"type", "name", "description", "input_schema", "cache_control", "strict", "eager_input_streaming"}
)
RESULT_FIELDS = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"})
#: Text blocks of a turn are joined as llama-server joins content parts.
JOIN = "\n"
#: Claude Code's billing header, whose ``cch`` stamp changes with each request.
STAMP = re.compile(r"\A(x-anthropic-billing-header:[^\n]*?cch=)[0-9A-Za-z]{5};")
#: Anthropic's error ``type`` for each HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error answer in Anthropic's shape (also the data of a stream's ``error`` event)."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ------------------------------------------------------------------ parsing


def parse_messages(body: object) -> Completion:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    common.unknown(body, FIELDS)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "a string is required")
    if body.get("max_tokens") is None:
        raise bad("max_tokens", "is required")
    max_tokens = integer(body, "max_tokens", 1, INT64 - 1)
    _thinking(body.get("thinking"))
    service_tier = body.get("service_tier")
    if service_tier not in (None, "auto", "standard_only"):
        raise bad("service_tier", "'auto' or 'standard_only' is required")
    if body.get("metadata") is not None:
        common.obj(body["metadata"], "metadata")
    tools = _tools(body.get("tools"))
    choice, name, parallel = _tool_choice(body.get("tool_choice"), tools)
    messages = _system(body.get("system")) + _conversation(body.get("messages"))
    if len(messages) > MAX_PROMPT_TURNS:
        raise bad("messages", f"at most {MAX_PROMPT_TURNS} turns, not {len(messages)}")
    options = RunOverrides(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 1.0),
        top_k=integer(body, "top_k", 0, TOP_K_MAX),
        top_p=number(body, "top_p", 0.0, 1.0, low_open=True),
    )
    # The schema holds the reply by a grammar, as response_format's does.
    schema = _output_schema(body.get("output_config"))
    grammar = schema_grammar(schema, "output_config.format.schema") if schema is not None else ""
    if grammar and choice in ("required", "function"):
        raise bad("tool_choice", "a required tool call and output_config.format at once: choose one")
    return Completion(
        api="messages",
        chat=True,
        messages=messages,
        options=options,
        stop=common.strings(body.get("stop_sequences"), "stop_sequences"),
        stream=common.flag(body, "stream", False),
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=parallel,
        grammar=grammar,
        schema=schema,
        model=model or "",
    )


def _output_schema(value: object) -> Mapping[str, Any] | None:
    """``output_config.format``'s JSON schema, which the reply is held to."""
    if value is None:
        return None
    fields = common.obj(value, "output_config")
    common.unknown(fields, frozenset({"format", "effort"}), "output_config.")
    if fields.get("effort") is not None:
        raise bad("output_config.effort", "is not supported by this server")
    form = fields.get("format")
    if form is None:
        return None
    form = common.obj(form, "output_config.format")
    common.unknown(form, frozenset({"type", "schema"}), "output_config.format.")
    if form.get("type") != "json_schema":
        raise bad(
            "output_config.format.type", f"'json_schema' is required, not {common.shown(form.get('type'))}"
        )
    schema = form.get("schema")
    if not isinstance(schema, dict):
        raise bad("output_config.format.schema", "a JSON schema object is required")
    return schema


def _thinking(value: object) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind != "disabled":
        raise bad("thinking", "extended thinking is not supported by this server (only {'type': 'disabled'})")


def _system(value: object) -> tuple[Message, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        said = _unstamped(common.text(value, "system"))
    elif isinstance(value, list):
        # one after the other, as llama-server joins them
        said = "".join(_unstamped(_text_block(block, f"system[{i}]")) for i, block in enumerate(value))
    else:
        raise bad("system", "a string or a list of text blocks is required")
    return (Message("system", said),) if said else ()


def _unstamped(text: str) -> str:
    """A system text without Claude Code's per-request stamp: its billing
    header's ``cch=`` changes with every request, and the stages could keep
    nothing of a prompt past it (llama-server blanks it the same way)."""
    return STAMP.sub(r"\1fffff;", text, count=1)


def _text_block(block: object, where: str) -> str:
    fields = common.obj(block, where)
    if fields.get("type") != "text":
        raise bad(f"{where}.type", f"only text blocks are supported here, not {fields.get('type')!r}")
    common.unknown(fields, frozenset({"type", "text", "cache_control", "citations"}), f"{where}.")
    return common.text(fields.get("text"), f"{where}.text")


def _tools(value: object) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad("tools", "a list of tools is required")
    tools: list[Tool] = []
    for index, item in enumerate(value):
        where = f"tools[{index}]"
        fields = common.obj(item, where)
        kind = fields.get("type")
        if kind not in (None, "custom"):
            raise bad(f"{where}.type", f"{kind!r}: server tools are not supported by this server")
        common.unknown(fields, TOOL_FIELDS, f"{where}.")
        name = common.tool_name(fields.get("name"), f"{where}.name")
        if any(tool.name == name for tool in tools):
            raise bad(f"{where}.name", f"{name!r} is named by an earlier tool too")
        description = fields.get("description") or ""
        if "input_schema" not in fields:
            raise bad(f"{where}.input_schema", "is required")
        tools.append(
            Tool(
                name=name,
                description=common.text(description, f"{where}.description"),
                parameters=common.schema(fields["input_schema"], f"{where}.input_schema"),
                strict=common.flag(fields, "strict", False),
            )
        )
    return tuple(tools)


def _tool_choice(value: object, tools: Sequence[Tool]) -> tuple[str, str, bool]:
    """``tool_choice``, ``tool_name`` and ``parallel_tool_calls`` of the Completion."""
    if value is None:
        return "auto", "", True
    fields = common.obj(value, "tool_choice")
    kind = fields.get("type")
    if kind not in TOOL_CHOICES:
        raise bad("tool_choice.type", f"one of {', '.join(TOOL_CHOICES)} is required, not {kind!r}")
    allowed = {"type"} if kind == "none" else {"type", "disable_parallel_tool_use"}
    common.unknown(fields, frozenset(allowed | ({"name"} if kind == "tool" else set())), "tool_choice.")
    parallel = not common.flag(fields, "disable_parallel_tool_use", False)
    if kind in ("any", "tool") and not tools:
        raise bad("tool_choice", f"{kind!r} needs tools to choose from")
    name = ""
    if kind == "tool":
        name = common.tool_name(fields.get("name"), "tool_choice.name")
        if all(tool.name != name for tool in tools):
            raise bad("tool_choice.name", f"no tool is named {name!r}")
    return TOOL_CHOICES[kind], name, parallel


def _conversation(value: object) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise bad("messages", "a non-empty list of messages is required")
    if len(value) > MAX_PROMPT_TURNS:
        raise bad("messages", f"at most {MAX_PROMPT_TURNS} messages, not {len(value)}")
    calls: dict[str, str] = {}  # tool_use id -> its tool's name
    messages: list[Message] = []
    for index, item in enumerate(value):
        where = f"messages[{index}]"
        fields = common.obj(item, where)
        common.unknown(fields, frozenset({"role", "content"}), f"{where}.")
        role = fields.get("role")
        content = fields.get("content")
        if role == "user":
            messages.extend(_user(content, f"{where}.content", calls))
        elif role == "assistant":
            messages.append(_assistant(content, f"{where}.content", calls))
        else:
            raise bad(f"{where}.role", f"'user' or 'assistant' is required, not {role!r}")
    return tuple(messages)


def _blocks(content: object, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(where, "a string or a list of content blocks is required")
    blocks = [common.obj(block, f"{where}[{i}]") for i, block in enumerate(content)]
    for index, block in enumerate(blocks):
        kind = block.get("type")
        if kind in ("image", "document"):
            raise bad(f"{where}[{index}]", f"{kind} blocks are not supported by this server")
        if kind not in ("text", "tool_use", "tool_result"):
            raise bad(f"{where}[{index}].type", f"{kind!r} blocks are not supported by this server")
    return blocks


def _user(content: object, where: str, calls: Mapping[str, str]) -> list[Message]:
    """A user turn: its text, and a tool message for each tool result, in order."""
    messages: list[Message] = []
    texts: list[str] = []
    for index, block in enumerate(_blocks(content, where)):
        at = f"{where}[{index}]"
        if block["type"] == "text":
            texts.append(_text_block(block, at))
            continue
        if block["type"] == "tool_use":
            raise bad(f"{at}.type", "tool_use blocks belong in an assistant turn")
        if texts:
            messages.append(Message("user", JOIN.join(texts)))
            texts = []
        messages.append(_tool_result(block, at, calls))
    if texts or not messages:
        messages.append(Message("user", JOIN.join(texts)))
    return messages


def _tool_result(block: Mapping[str, Any], where: str, calls: Mapping[str, str]) -> Message:
    common.unknown(block, RESULT_FIELDS, f"{where}.")
    ident = block.get("tool_use_id")
    if not isinstance(ident, str) or ident not in calls:
        raise bad(f"{where}.tool_use_id", f"{ident!r} answers no earlier tool_use")
    content = block.get("content")
    if content is None:
        said = ""
    elif isinstance(content, str):
        said = common.text(content, f"{where}.content")
    elif isinstance(content, list):
        said = JOIN.join(_text_block(part, f"{where}.content[{i}]") for i, part in enumerate(content))
    else:
        raise bad(f"{where}.content", "a string or a list of text blocks is required")
    if common.flag(block, "is_error", False):
        said = f"Error: {said}"  # the model reads that the call failed
    return Message("tool", said, tool_call_id=ident, name=calls[ident])


def _assistant(content: object, where: str, calls: dict[str, str]) -> Message:
    texts: list[str] = []
    made: list[ToolCall] = []
    for index, block in enumerate(_blocks(content, where)):
        at = f"{where}[{index}]"
        if block["type"] == "text":
            texts.append(_text_block(block, at))
        elif block["type"] == "tool_use":
            common.unknown(block, frozenset({"type", "id", "name", "input", "cache_control"}), f"{at}.")
            ident = block.get("id")
            if not isinstance(ident, str) or not ident:
                raise bad(f"{at}.id", "a string is required")
            if ident in calls:
                raise bad(f"{at}.id", f"{ident!r} is the id of an earlier tool_use too")
            name = common.tool_name(block.get("name"), f"{at}.name")
            arguments = common.obj(block.get("input"), f"{at}.input")
            calls[ident] = name
            made.append(ToolCall(ident, name, json.dumps(arguments, ensure_ascii=False)))
        else:
            raise bad(f"{at}.type", "tool_result blocks belong in a user turn")
    return Message("assistant", JOIN.join(texts), tool_calls=tuple(made))


# ---------------------------------------------------------------- answers


def new_id() -> str:
    return common.new_id("msg_")


def stop_reason(finish: Finish | None, calls: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a run's end
    (``max_tokens`` for a cut one, whose last call may be unfinished)."""
    if finish is not None and finish.reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if finish is None:
        return "end_turn", None
    if finish.reason == "stop" and finish.stop:
        return "stop_sequence", finish.stop
    return STOP_REASONS.get(finish.reason, "end_turn"), None


def usage(counts: Usage) -> dict[str, int]:
    """Anthropic counts the prompt tokens read from the cache apart from ``input_tokens``."""
    return {
        "input_tokens": counts.prompt_tokens - counts.cached_tokens,
        "output_tokens": counts.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": counts.cached_tokens,
    }


def message_answer(completion: Completion, ident: str, model: str, pieces: Sequence[Piece]) -> dict[str, Any]:
    """The whole answer of a request that is not streamed."""
    reply = common.collect(pieces)
    content: list[dict[str, Any]] = []
    if reply.text or not reply.calls:
        content.append({"type": "text", "text": reply.text})
    for call in reply.calls:
        content.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.name,
                "input": common.arguments_object(call.arguments),
            }
        )
    reason, sequence = stop_reason(reply.finish, bool(reply.calls))
    return {
        "id": ident,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(reply.usage),
    }


Event = tuple[str, dict[str, Any]]


class MessageStream:
    """The server-sent events of a streamed answer, as the Anthropic SDK
    reads them: :meth:`start` gives ``message_start`` (and a ``ping``),
    each :meth:`feed` the events its piece makes; the :class:`Finish` piece
    closes the open block and gives ``message_delta`` and ``message_stop``.
    Each event is written as ``event: NAME`` and ``data: JSON``."""

    def __init__(self, completion: Completion, ident: str, model: str) -> None:
        self.completion, self.ident, self.model = completion, ident, model
        self.blocks = 0  # content blocks begun; the last one may be open
        self.open = self.text_open = False
        self.calls: dict[int, int] = {}  # a tool call's index -> its block's index
        self.done = False

    def start(self, prompt_tokens: int, cached_tokens: int = 0) -> list[Event]:
        message: dict[str, Any] = {
            "id": self.ident,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(Usage(prompt_tokens, 0, cached_tokens)),
        }
        return [_event("message_start", message=message), _event("ping")]

    def feed(self, piece: Piece) -> list[Event]:
        if self.done:
            return []
        if isinstance(piece, Text):
            if not piece.text:
                return []
            events: list[Event] = []
            if not self.text_open:
                events, index = self._begin()
                self.text_open = True
                events.append(
                    _event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                )
            delta = {"type": "text_delta", "text": piece.text}
            return [*events, _event("content_block_delta", index=self.blocks - 1, delta=delta)]
        if isinstance(piece, CallStart):
            events, index = self._begin()
            self.calls[piece.index] = index
            block = {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
            return [*events, _event("content_block_start", index=index, content_block=block)]
        if isinstance(piece, CallArguments):
            at = self.calls.get(piece.index)
            if at is None or not piece.arguments:
                return []
            delta = {"type": "input_json_delta", "partial_json": piece.arguments}
            return [_event("content_block_delta", index=at, delta=delta)]
        self.done = True
        events = self._close()
        reason, sequence = stop_reason(piece, bool(self.calls))
        events.append(
            _event(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": sequence},
                usage=usage(piece.usage),
            )
        )
        events.append(_event("message_stop"))
        return events

    def fail(self, status: int, message: str) -> list[Event]:
        """The last event of a stream whose run failed: Anthropic's ``error``
        event (the SDK raises it as an API error)."""
        if self.done:
            return []
        self.done = True
        return [("error", error_body(status, message))]

    def _begin(self) -> tuple[list[Event], int]:
        """Closes the open block, if any; the index of the next one."""
        events = self._close()
        self.blocks += 1
        self.open = True
        return events, self.blocks - 1

    def _close(self) -> list[Event]:
        if not self.open:
            return []
        self.open = self.text_open = False
        return [_event("content_block_stop", index=self.blocks - 1)]


def _event(name: str, **data: Any) -> Event:
    return name, {"type": name, **data}
