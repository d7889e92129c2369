"""OpenAI's Responses API (``POST /v1/responses``), as a translation.

Pure but for :class:`ResponseStore`: :func:`parse_responses` turns a request
body into a :class:`~ggufpipe_tui.server.request.Completion` (or raises
:class:`~ggufpipe_tui.server.openai_api.ApiError`, answered in OpenAI's
error shape as the other OpenAI routes are); the answers are in
:mod:`ggufpipe_tui.server.responses_answer` (``response_object``,
``ResponseStream``).

Accepted: ``model``, ``input`` (a string, or message, ``function_call`` and
``function_call_output`` items), ``instructions``, ``tools`` (function tools),
``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``, ``text.format`` (``text``,
``json_schema``, ``json_object``), ``previous_response_id`` (from the
:class:`ResponseStore`), and what changes nothing here: ``store``,
``metadata`` (echoed), ``user``, ``safety_identifier``, ``prompt_cache_key``,
``service_tier``, ``truncation`` "disabled", ``reasoning`` null. Refused by
name, with a 400: any other field, hosted tools (``web_search``, ...), image,
file and reasoning items, a ``function_call_output`` that answers no earlier
``function_call``.

:attr:`Completion.metadata` carries what the response echoes back (the keys
of :data:`ECHOED`), and ``instructions`` is how the store knows which system
message not to carry into a follow-up (OpenAI does not carry it either).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from ggufpipe_agent.wire.codec import MAX_PROMPT_TURNS
from ggufpipe_tui.server import api_common as common
from ggufpipe_tui.server.fields import INT64, ApiError, bad, integer, number
from ggufpipe_tui.server.request import (
    Completion,
    Message,
    Piece,
    Tool,
    ToolCall,
)
from ggufpipe_tui.server.sampling import schema_grammar
from ggufpipe_tui.session.runs import RunOverrides

#: Fields that change nothing here, at any value (beyond their type).
HARMLESS = frozenset(
    {
        "store",
        "metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "service_tier",
    }
)
FIELDS = HARMLESS | {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "text",
    "previous_response_id",
    "reasoning",
    "truncation",
    "include",
    "background",
    "top_logprobs",
    "max_tool_calls",
}
#: Fields that change nothing at these values only.
DEFAULTS: dict[str, tuple[object, ...]] = {
    "reasoning": (None,),
    "truncation": (None, "disabled"),
    "background": (None, False),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}
#: ``include`` entries that ask for nothing this server would leave out.
INCLUDES = frozenset({"reasoning.encrypted_content"})
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
#: What :attr:`Completion.metadata` holds for the answer to echo.
ECHOED = ("instructions", "previous_response_id", "store", "metadata", "user", "text", "max_output_tokens")
NOT_FOUND = "Previous response with id '{}' not found."


class ResponseStore:
    """The conversations ``previous_response_id`` continues: a response's id
    to its whole conversation (the input's messages and the reply's output
    items as messages). Per server process, in memory and bounded: it keeps
    the ``limit`` responses used last (a follow-up counts as a use), so a
    restart, or 256 newer conversations, forget one."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self.conversations: OrderedDict[str, tuple[Message, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.conversations)

    def __contains__(self, ident: object) -> bool:
        return ident in self.conversations

    def conversation(self, ident: str) -> tuple[Message, ...]:
        """The conversation response ``ident`` ended, or a 400 saying it is not known."""
        found = self.conversations.get(ident)
        if found is None:
            raise ApiError(400, NOT_FOUND.format(ident), param="previous_response_id")
        self.conversations.move_to_end(ident)
        return found

    def save(self, ident: str, completion: Completion, pieces: Sequence[Piece]) -> None:
        """Keeps response ``ident``'s conversation, unless it asked ``store: false``."""
        if completion.metadata.get("store") is False:
            return
        messages = completion.messages
        if completion.metadata.get("instructions") and messages and messages[0].role == "system":
            messages = messages[1:]
        reply = common.collect(pieces)
        calls = tuple(ToolCall(call.id, call.name, call.arguments) for call in reply.calls)
        self.conversations[ident] = (*messages, Message("assistant", reply.text, tool_calls=calls))
        self.conversations.move_to_end(ident)
        while len(self.conversations) > self.limit:
            self.conversations.popitem(last=False)


# ------------------------------------------------------------------ parsing


def parse_responses(body: object, store: ResponseStore | None = None) -> Completion:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    common.unknown(body, FIELDS)
    for name, allowed in DEFAULTS.items():
        if body.get(name) not in allowed:
            raise bad(name, f"{common.shown(body[name])} is not supported by this server")
    for name in (
        "model",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "instructions",
        "previous_response_id",
    ):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad(name, "a string is required")
    _include(body.get("include"))
    if body.get("stream_options") is not None:
        common.unknown(
            common.obj(body["stream_options"], "stream_options"), frozenset({"include_obfuscation"})
        )
    if body.get("metadata") is not None:
        common.obj(body["metadata"], "metadata")
    tools = _tools(body.get("tools"))
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    instructions = body.get("instructions") or None
    history: tuple[Message, ...] = ()
    previous = body.get("previous_response_id") or None
    if previous is not None:
        if store is None:
            raise ApiError(400, NOT_FOUND.format(previous), param="previous_response_id")
        history = store.conversation(previous)
    messages: tuple[Message, ...] = ()
    if instructions:
        messages = (Message("system", common.text(instructions, "instructions")),)
    messages += _input(body.get("input"), history)
    if len(messages) > MAX_PROMPT_TURNS:
        raise bad("input", f"at most {MAX_PROMPT_TURNS} turns, not {len(messages)}")
    text, schema = _text_format(body.get("text"))
    # The schema holds the reply by a grammar, as chat's response_format does.
    grammar = schema_grammar(schema, "text.format.schema") if schema is not None else ""
    if grammar and choice in ("required", "function"):
        raise bad("tool_choice", "a required tool call and text.format at once: choose one")
    max_tokens = integer(body, "max_output_tokens", 1, INT64 - 1)
    options = RunOverrides(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 2.0),
        top_p=number(body, "top_p", 0.0, 1.0, low_open=True),
    )
    echoed = {
        "instructions": instructions,
        "previous_response_id": previous,
        "store": common.flag(body, "store", True),
        "metadata": body.get("metadata") or {},
        "user": body.get("user"),
        "text": text,
        "max_output_tokens": max_tokens,
    }
    return Completion(
        api="responses",
        chat=True,
        messages=messages,
        options=options,
        stream=common.flag(body, "stream", False),
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=common.flag(body, "parallel_tool_calls", True),
        grammar=grammar,
        schema=schema,
        model=body.get("model") or "",
        metadata=echoed,
    )


def _include(value: object) -> None:
    if value is None:
        return
    if not isinstance(value, list):
        raise bad("include", "a list is required")
    for index, item in enumerate(value):
        if item not in INCLUDES:
            raise bad(f"include[{index}]", f"{common.shown(item)} is not supported by this server")


def _tools(value: object) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad("tools", "a list of tools is required")
    tools: list[Tool] = []
    for index, item in enumerate(value):
        where = f"tools[{index}]"
        fields = common.obj(item, where)
        if fields.get("type") != "function":
            raise bad(
                f"{where}.type", f"{common.shown(fields.get('type'))} tools are not supported by this server"
            )
        common.unknown(
            fields, frozenset({"type", "name", "description", "parameters", "strict"}), f"{where}."
        )
        name = common.tool_name(fields.get("name"), f"{where}.name")
        if any(tool.name == name for tool in tools):
            raise bad(f"{where}.name", f"{name!r} is named by an earlier tool too")
        tools.append(
            Tool(
                name=name,
                description=common.text(fields.get("description") or "", f"{where}.description"),
                parameters=common.schema(fields.get("parameters"), f"{where}.parameters"),
                strict=common.flag(fields, "strict", True),  # the Responses API's default
            )
        )
    return tuple(tools)


def _tool_choice(value: object, tools: Sequence[Tool]) -> tuple[str, str]:
    if value is None:
        return "auto", ""
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise bad(
                "tool_choice",
                f"'auto', 'none', 'required' or a function is required, not {common.shown(value)}",
            )
        if value == "required" and not tools:
            raise bad("tool_choice", "'required' needs tools to choose from")
        return value, ""
    fields = common.obj(value, "tool_choice")
    if fields.get("type") != "function":
        raise bad("tool_choice.type", f"{common.shown(fields.get('type'))} is not supported by this server")
    common.unknown(fields, frozenset({"type", "name"}), "tool_choice.")
    name = common.tool_name(fields.get("name"), "tool_choice.name")
    if all(tool.name != name for tool in tools):
        raise bad("tool_choice.name", f"no tool is named {name!r}")
    return "function", name


def _text_format(value: object) -> tuple[dict[str, Any], Mapping[str, Any] | None]:
    """The ``text`` config to echo, and the schema the reply is held to."""
    if value is None:
        return {"format": {"type": "text"}}, None
    fields = common.obj(value, "text")
    common.unknown(fields, frozenset({"format", "verbosity"}), "text.")
    if fields.get("verbosity") not in (None, "medium"):
        raise bad("text.verbosity", f"{common.shown(fields['verbosity'])} is not supported by this server")
    form = common.obj(fields.get("format") or {"type": "text"}, "text.format")
    kind = form.get("type")
    if kind == "text":
        return {"format": {"type": "text"}}, None
    if kind == "json_object":
        return {"format": {"type": "json_object"}}, {"type": "object"}
    if kind != "json_schema":
        raise bad(
            "text.format.type",
            f"'text', 'json_schema' or 'json_object' is required, not {common.shown(kind)}",
        )
    common.unknown(form, frozenset({"type", "name", "schema", "strict", "description"}), "text.format.")
    name = common.tool_name(form.get("name"), "text.format.name")
    schema = form.get("schema")
    if not isinstance(schema, dict):
        raise bad("text.format.schema", "a JSON schema object is required")
    strict = common.flag(form, "strict", False)
    return {"format": {"type": "json_schema", "name": name, "schema": schema, "strict": strict}}, schema


def _input(value: object, history: tuple[Message, ...]) -> tuple[Message, ...]:
    if isinstance(value, str):
        return (*history, Message("user", common.text(value, "input")))
    if not isinstance(value, list) or not (value or history):
        raise bad("input", "a string or a non-empty list of input items is required")
    calls = {call.id: call.name for message in history for call in message.tool_calls}
    messages = list(history)
    for index, item in enumerate(value):
        where = f"input[{index}]"
        fields = common.obj(item, where)
        kind = fields.get("type", "message" if "role" in fields else None)
        if kind == "message":
            messages.append(_message(fields, where))
        elif kind == "function_call":
            call = _call(fields, where)
            if call.id in calls:
                raise bad(f"{where}.call_id", f"{call.id!r} is the id of an earlier function_call too")
            calls[call.id] = call.name
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # one assistant turn
                messages[-1] = Message("assistant", last.content, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(Message("assistant", "", tool_calls=(call,)))
        elif kind == "function_call_output":
            ident = fields.get("call_id")
            if not isinstance(ident, str) or ident not in calls:
                raise bad(f"{where}.call_id", f"{common.shown(ident)} answers no earlier function_call")
            output = _content(fields.get("output"), f"{where}.output")
            messages.append(Message("tool", output, tool_call_id=ident, name=calls[ident]))
        else:
            raise bad(f"{where}.type", f"{common.shown(kind)} items are not supported by this server")
    return tuple(messages)


def _message(fields: Mapping[str, Any], where: str) -> Message:
    role = fields.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"one of {', '.join(ROLES)} is required, not {common.shown(role)}")
    return Message(ROLES[role], _content(fields.get("content"), f"{where}.content"))


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return common.text(content, where)
    if not isinstance(content, list):
        raise bad(where, "a string or a list of text parts is required")
    texts = []
    for index, part in enumerate(content):
        fields = common.obj(part, f"{where}[{index}]")
        if fields.get("type") not in TEXT_PARTS:
            said = common.shown(fields.get("type"))
            raise bad(f"{where}[{index}].type", f"{said} parts are not supported by this server")
        texts.append(common.text(fields.get("text"), f"{where}[{index}].text"))
    return "\n".join(texts)  # as llama-server joins content parts


def _call(fields: Mapping[str, Any], where: str) -> ToolCall:
    ident = fields.get("call_id")
    if not isinstance(ident, str) or not ident:
        raise bad(f"{where}.call_id", "a string is required")
    name = common.tool_name(fields.get("name"), f"{where}.name")
    arguments = common.text(fields.get("arguments"), f"{where}.arguments")
    try:
        json.loads(arguments)
    except ValueError:
        raise bad(f"{where}.arguments", "JSON text is required") from None
    return ToolCall(ident, name, arguments)
