"""OpenAI's chat and legacy completions requests, as the server's one request.

Pure: a request body in, a checked :class:`~ggufpipe_tui.server.request.Completion`
or an :class:`~ggufpipe_tui.server.fields.ApiError` naming the field out
(the answers' shapes: :mod:`ggufpipe_tui.server.openai_answer`).

Accepted: ``model`` (any string; the answer names the one model served),
``messages`` (system, developer, user, assistant with its ``tool_calls``, and
``tool`` turns; content a string or a list of text parts) or ``prompt`` (a
string, one string in a list, or token ids), ``tools`` and ``tool_choice``
(``auto``, ``none``, ``required`` or a named function; the legacy
``functions`` and ``function_call`` too), ``parallel_tool_calls``,
``response_format`` (text, json_object, json_schema), ``logprobs`` and
``top_logprobs`` (chat; an integer ``logprobs`` on completions), ``n``,
``echo`` (completions), ``max_tokens`` / ``max_completion_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, and llama-server's own fields
(:mod:`ggufpipe_tui.server.sampling`: ``top_k``, ``min_p``, the penalties,
DRY, mirostat, ``logit_bias``, ``grammar``, ``json_schema``, ...,
``ignore_eos``, ``cache_prompt``). Refused by name, with a 400: anything this
server cannot honour (``suffix``, ``best_of`` > 1, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ggufpipe_agent.wire.codec import MAX_PROMPT_TURNS
from ggufpipe_agent.wire.records import LOGPROBS_MAX, SEED_MAX, SEED_MIN, TOP_K_MAX
from ggufpipe_tui.server.fields import (
    INT64,
    MAX_STOPS,
    ApiError,
    bad,
    boolean,
    integer,
    is_int,
    number,
    shown,
    stops,
    text,
)
from ggufpipe_tui.server.request import Completion, Message, Tool, ToolCall
from ggufpipe_tui.server.sampling import reply_form, sampler_fields
from ggufpipe_tui.server.tools import schema_problem
from ggufpipe_tui.session.runs import RunOverrides

__all__ = ["MAX_STOPS", "ApiError", "parse_chat", "parse_completion", "tools_of", "tool_choice_of"]

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
#: The most choices one request may ask for (each a run in flight beside the others).
MAX_CHOICES = 16
#: The most tools one request may offer.
MAX_TOOLS = 512


def parse_chat(body: object) -> Completion:
    fields = _object(body)
    raw = fields.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "a non-empty list of messages is required")
    if len(raw) > MAX_PROMPT_TURNS:
        raise bad("messages", f"at most {MAX_PROMPT_TURNS} messages, not {len(raw)}")
    messages = tuple(_message(item, f"messages[{index}]") for index, item in enumerate(raw))
    check_tool_results(messages)
    tools = tools_of(fields)
    choice, name = tool_choice_of(fields, tools)
    logprobs = boolean(fields, "logprobs") or False
    top = integer(fields, "top_logprobs", 0, LOGPROBS_MAX)
    if top is not None and not logprobs:
        raise bad("top_logprobs", "only with logprobs: true")
    return _completion(
        fields,
        api="chat",
        chat=True,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        logprobs=logprobs,
        top_logprobs=top or 0,
    )


def parse_completion(body: object) -> Completion:
    fields = _object(body)
    if "prompt" not in fields:
        raise bad("prompt", "a prompt is required")
    prompt, tokens = _prompt(fields["prompt"])
    suffix = fields.get("suffix")
    if suffix not in (None, ""):
        raise bad("suffix", "fill-in-the-middle is not supported by this server")
    # The legacy API's logprobs is how many alternatives (0-5 at OpenAI); llama-server's n_probs too.
    given = fields.get("logprobs")
    if isinstance(given, bool):
        raise bad("logprobs", "an integer is required (alternatives per token)")
    top = integer(fields, "logprobs", 0, LOGPROBS_MAX)
    if top is None:
        top = integer(fields, "n_probs", 0, LOGPROBS_MAX)
    echo = boolean(fields, "echo") or False
    if echo and tokens is not None:
        raise bad("echo", "only with a prompt given as text")
    return _completion(
        fields,
        api="completions",
        chat=False,
        prompt=prompt,
        tokens=tokens,
        logprobs=top is not None,
        top_logprobs=top or 0,
        echo=echo,
    )


def _object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


# ------------------------------------------------------------------ messages


def _message(item: object, where: str) -> Message:
    if not isinstance(item, dict):
        raise bad(where, "a message is an object with a role and a content")
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(f"{where}.role", f"{shown(role)} is not one of {', '.join(ROLES)}")
    role = ROLES[role]
    calls: tuple[ToolCall, ...] = ()
    if role == "assistant":
        calls = _calls(item, where)
    elif item.get("tool_calls") or item.get("function_call"):
        raise bad(f"{where}.tool_calls", f"only an assistant turn makes tool calls, not a {role} turn")
    content = item.get("content")
    if content is None and (calls or role == "assistant"):
        content = ""  # an assistant turn of calls alone
    if role == "tool":
        call_id = item.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad(f"{where}.tool_call_id", "a tool message names the call it answers (tool_call_id)")
        name = item.get("name", "")
        return Message(
            "tool", _content(content, f"{where}.content"), tool_call_id=call_id, name=str(name or "")
        )
    return Message(role, _content(content, f"{where}.content"), calls)


def _calls(item: Mapping[str, Any], where: str) -> tuple[ToolCall, ...]:
    raw = item.get("tool_calls")
    legacy = item.get("function_call")
    if raw is None and legacy is not None:
        raw = [{"id": "call_0", "type": "function", "function": legacy}]
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad(f"{where}.tool_calls", "a list of tool calls is required")
    calls = []
    for index, call in enumerate(raw):
        at = f"{where}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(
                at, "a call is {'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': ...}}"
            )
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        ident = call.get("id") or f"call_{index}"
        if not isinstance(ident, str):
            raise bad(f"{at}.id", "a string is required")
        calls.append(ToolCall(ident, function["name"], text(arguments, f"{at}.function.arguments")))
    return tuple(calls)


def check_tool_results(messages: Sequence[Message]) -> None:
    """A 400 for a tool result that answers no call made before it."""
    made: set[str] = set()
    for index, message in enumerate(messages):
        made.update(call.id for call in message.tool_calls)
        if message.role == "tool" and message.tool_call_id not in made:
            raise bad(
                f"messages[{index}].tool_call_id",
                f"{shown(message.tool_call_id)} answers no tool call of an assistant turn before it",
            )


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return text(content, where)
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            piece = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(piece, str):
                raise bad(f"{where}[{index}]", "only text parts {'type': 'text', 'text': ...} are supported")
            parts.append(text(piece, f"{where}[{index}]"))
        return "".join(parts)
    raise bad(where, "a string or a list of text parts is required")


# -------------------------------------------------------------------- tools


def tools_of(fields: Mapping[str, Any]) -> tuple[Tool, ...]:
    """``tools`` ([{type: function, function: {name, description, parameters, strict}}])
    or the legacy ``functions``; each schema checked, a 400 naming the tool."""
    raw = fields.get("tools")
    where = "tools"
    if raw is None and fields.get("functions") is not None:
        raw = (
            [{"type": "function", "function": f} for f in fields["functions"]]
            if isinstance(fields["functions"], list)
            else fields["functions"]
        )
        where = "functions"
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad(where, "a list of tools is required")
    if len(raw) > MAX_TOOLS:
        raise bad(where, f"at most {MAX_TOOLS} tools, not {len(raw)}")
    tools: list[Tool] = []
    for index, item in enumerate(raw):
        at = f"{where}[{index}]"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            kind = item.get("type") if isinstance(item, dict) else item
            raise bad(f"{at}.type", f"{shown(kind)}: only function tools are supported")
        function = item.get("function")
        if not isinstance(function, dict):
            raise bad(f"{at}.function", "an object with a name is required")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 128:
            raise bad(f"{at}.function.name", "a name of 1 to 128 characters is required")
        if any(tool.name == name for tool in tools):
            raise bad(f"{at}.function.name", f"{name!r} is offered twice")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise bad(f"{at}.function.description", "a string is required")
        parameters = function.get("parameters") or {}
        problem = schema_problem(parameters)
        if problem:
            raise bad(f"{at}.function.parameters", f"tool {name!r}: {problem}")
        strict = function.get("strict") is True
        tools.append(Tool(name, text(description, f"{at}.function.description"), parameters, strict))
    return tuple(tools)


def tool_choice_of(fields: Mapping[str, Any], tools: Sequence[Tool]) -> tuple[str, str]:
    """(``tool_choice``, the function it names) of ``tool_choice`` or the legacy ``function_call``."""
    where = "tool_choice"
    value = fields.get("tool_choice")
    if value is None and fields.get("function_call") is not None:
        where, value = "function_call", fields["function_call"]
        if isinstance(value, dict) and "name" in value:
            value = {"type": "function", "function": {"name": value["name"]}}
    if value is None:
        return ("auto", "") if tools else ("none", "")
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise bad(where, f"{shown(value)} is not one of auto, none, required or a named function")
        if value == "required" and not tools:
            raise bad(where, "required, but the request offers no tools")
        return value, ""
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad(where, "{'type': 'function', 'function': {'name': ...}} is required for a named function")
    if not any(tool.name == name for tool in tools):
        offered = ", ".join(tool.name for tool in tools[:20]) or "none"
        raise bad(where, f"names the function {shown(name)}, which is not among the tools ({offered})")
    return "function", name


# ------------------------------------------------------------------- prompt


def _prompt(value: object) -> tuple[str, tuple[int, ...] | None]:
    if isinstance(value, str):
        return text(value, "prompt"), None
    if isinstance(value, list) and value and all(is_int(v) for v in value):
        return "", tuple(_token(v) for v in value)
    if isinstance(value, list) and len(value) == 1:
        return _prompt(value[0])
    raise bad("prompt", "a string, a list with one string, or a list of token ids is required")


def _token(value: int) -> int:
    if not 0 <= value < 1 << 31:
        raise bad("prompt", f"token id {value} is out of range")
    return value


# ----------------------------------------------------------------- the rest


def _completion(fields: Mapping[str, Any], **given: Any) -> Completion:
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
    grammar, schema = reply_form(fields)
    if grammar and given.get("tool_choice") in ("required", "function"):
        raise bad("tool_choice", "a required tool call and a response format at once: choose one")
    parallel = boolean(fields, "parallel_tool_calls")
    n = integer(fields, "n", 1, MAX_CHOICES) or 1
    cache_prompt = boolean(fields, "cache_prompt")
    return Completion(
        **given,
        options=run_overrides(fields),
        stop=stops(fields.get("stop")),
        stream=stream,
        include_usage=include_usage,
        cache_prompt=cache_prompt is not False,
        parallel_tool_calls=parallel is not False,
        grammar=grammar,
        schema=schema,
        n=n,
        model=model or "",
    )


def run_overrides(fields: Mapping[str, Any]) -> RunOverrides:
    """The run options a request sets: OpenAI's and llama-server's names."""
    max_tokens = integer(fields, "max_completion_tokens", 1, INT64 - 1)
    if max_tokens is None:
        max_tokens = integer(fields, "max_tokens", 1, INT64 - 1)
    if max_tokens is None:
        n_predict = integer(fields, "n_predict", -1, INT64 - 1)  # llama-server's; -1: no limit
        max_tokens = n_predict if n_predict not in (None, -1, 0) else None
    return RunOverrides(
        max_tokens=max_tokens,
        temperature=number(fields, "temperature", 0.0, 2.0),
        top_k=integer(fields, "top_k", 0, TOP_K_MAX),
        top_p=number(fields, "top_p", 0.0, 1.0, low_open=True),
        seed=_seed(fields),
        ignore_eos=boolean(fields, "ignore_eos"),
        extra=sampler_fields(fields),
    )


def _seed(fields: Mapping[str, Any]) -> int | None:
    seed = integer(fields, "seed", SEED_MIN, SEED_MAX)
    return None if seed == -1 else seed  # llama-server's -1: no seed of the request's own
