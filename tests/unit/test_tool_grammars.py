"""The call grammars compile in llama.cpp, accept the calls they are for and
nothing else, and what they accept parses back to the same call; and the
schema checks the server refuses a tool or a call by."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import llama_cpp
import pytest

from ggufpipe_tui.server.request import CallArguments, CallStart, Tool
from ggufpipe_tui.server.tools import family_for, schema_problem, validate_arguments
from tests.support.gbnf import Grammar
from tests.support.tool_templates import TEMPLATES
from tests.unit.test_tool_calls import TIME, TOOLS, WEATHER, WRITE, counter, merged

Args = Mapping[str, Any]


def _raw(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _xml(fmt: str, args: Args) -> str:
    return "".join(fmt.format(k=k, v=_raw(v)) for k, v in args.items())


#: key -> (one call as the grammar writes it, the calls put together)
Writer = tuple[Callable[[str, Args], str], Callable[[list[str]], str]]
WRITERS: dict[str, Writer] = {
    "hermes": (
        lambda n, a: f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>',
        "\n".join,
    ),
    "qwen3-coder": (
        lambda n, a: (
            f"<tool_call>\n<function={n}>\n"
            + _xml("<parameter={k}>\n{v}\n</parameter>\n", a)
            + "</function>\n</tool_call>"
        ),
        "\n".join,
    ),
    "glm": (
        lambda n, a: (
            f"<tool_call>{n}\n"
            + _xml("<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n", a)
            + "</tool_call>"
        ),
        "\n".join,
    ),
    "minimax": (
        lambda n, a: (
            f'<invoke name="{n}">\n' + _xml('<parameter name="{k}">{v}</parameter>\n', a) + "</invoke>\n"
        ),
        lambda calls: "<minimax:tool_call>\n" + "".join(calls) + "</minimax:tool_call>",
    ),
    "kimi": (
        lambda n, a: (
            f"<|tool_call_begin|>functions.{n}:0<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
        ),
        lambda calls: "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>",
    ),
    "deepseek-v31": (
        lambda n, a: f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>",
        lambda calls: "<｜tool▁calls▁begin｜>" + "".join(calls) + "<｜tool▁calls▁end｜>",
    ),
    "deepseek-r1": (
        lambda n, a: (
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```<｜tool▁call▁end｜>"
        ),
        lambda calls: "<｜tool▁calls▁begin｜>" + "".join(calls) + "<｜tool▁calls▁end｜>",
    ),
    "mistral-list": (
        lambda n, a: f'{{"name": "{n}", "arguments": {json.dumps(a)}, "id": "abcDEF123"}}',
        lambda calls: "[TOOL_CALLS][" + ", ".join(calls) + "]",
    ),
    "mistral-args": (lambda n, a: f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}", "".join),
    "mistral-call-id": (lambda n, a: f"[TOOL_CALLS]{n}[CALL_ID]abcDEF123[ARGS]{json.dumps(a)}", "".join),
    "llama3": (lambda n, a: f'{{"name": "{n}", "parameters": {json.dumps(a)}}}', "; ".join),
    "harmony": (
        lambda n, a: f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{json.dumps(a)}",
        "".join,
    ),
    "plain": (
        lambda n, a: f'{{"name": "{n}", "arguments": {json.dumps(a)}}}',
        lambda calls: '{"tool_calls": [' + ", ".join(calls) + "]}",
    ),
}
KEYS = sorted(WRITERS)
GOOD = {"city": 'Pa"ris\n</x>', "days": 3}
XML_GOOD = {"city": "Paris </arg_value x> <tool_call>", "days": 3, "unit": "f"}


def grammar(key: str, name: str | None = None, parallel: bool = False, thinking: bool = False) -> Grammar:
    return Grammar.parse(family_for(TEMPLATES[key][0]).call_grammar(TOOLS, name, parallel, thinking))


def write(key: str, *calls: tuple[str, Args]) -> str:
    one, together = WRITERS[key]
    return together([one(n, a) for n, a in calls])


def compiles(gbnf: str) -> bool:
    sampler = llama_cpp.llama_sampler_init_grammar(None, gbnf.encode(), b"root")
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("name", [None, "get_weather", "write"])
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("thinking", [False, True])
def test_every_call_grammar_compiles_in_llama_cpp(
    key: str, name: str | None, parallel: bool, thinking: bool
) -> None:
    gbnf = family_for(TEMPLATES[key][0]).call_grammar(TOOLS, name, parallel, thinking)
    assert compiles(gbnf), gbnf
    Grammar.parse(gbnf)  # and every rule it names is defined


def test_the_generic_auto_grammar_compiles_and_takes_a_call_or_an_answer() -> None:
    family = family_for(TEMPLATES["plain"][0])
    gbnf = family.auto_grammar(TOOLS, True)
    assert compiles(gbnf)
    g = Grammar.parse(gbnf)
    assert g.accepts('{"response": "It is \\"sunny\\"."}')
    assert g.accepts(write("plain", ("get_weather", {"city": "Paris"}), ("get_time", {})))
    assert not g.accepts('{"tool_calls": []}')
    assert not g.accepts("It is sunny.")
    assert family_for(TEMPLATES["hermes"][0]).auto_grammar(TOOLS) == ""


@pytest.mark.parametrize("key", KEYS)
def test_a_grammar_accepts_a_valid_call_and_it_parses_back(key: str) -> None:
    xml = key in ("qwen3-coder", "glm", "minimax")
    args = XML_GOOD if xml else GOOD
    text = write(key, ("get_weather", args))
    assert grammar(key).accepts(text)
    assert grammar(key, "get_weather").accepts(text)
    parser = family_for(TEMPLATES[key][0]).parser(TOOLS, ids=counter())
    pieces = merged(parser.feed(text) + parser.close())
    assert [p.name for p in pieces if isinstance(p, CallStart)] == ["get_weather"]
    assert [json.loads(p.arguments) for p in pieces if isinstance(p, CallArguments)] == [args]


@pytest.mark.parametrize("key", KEYS)
def test_a_grammar_refuses_calls_the_schema_refuses(key: str) -> None:
    g = grammar(key)
    assert not g.accepts(write(key, ("get_weather", {"days": 3})))  # city is required
    assert not g.accepts(write(key, ("get_weather", {"city": "Paris", "days": "three"})))
    assert not g.accepts(write(key, ("get_weather", {"city": "Paris", "unit": "kelvin"})))
    assert not g.accepts(write(key, ("no_such_tool", {})))
    assert not grammar(key, "get_time").accepts(write(key, ("get_weather", {"city": "Paris"})))
    assert grammar(key, "get_time").accepts(write(key, ("get_time", {})))


@pytest.mark.parametrize("key", sorted(set(KEYS) - {"harmony"}))
def test_parallel_calls_only_when_asked(key: str) -> None:
    two = write(key, ("get_weather", {"city": "Paris"}), ("write", {"path": "x", "data": {"k": [1]}}))
    assert grammar(key, parallel=True).accepts(two)
    assert not grammar(key).accepts(two)


@pytest.mark.parametrize("key", ["hermes", "qwen3-coder", "glm", "minimax", "kimi", "deepseek-r1"])
def test_reasoning_may_come_before_the_call(key: str) -> None:
    call = write(key, ("get_time", {}))
    assert grammar(key).accepts("<think>I need the time.</think>\n" + call)
    assert grammar(key, thinking=True).accepts("I need the time.</think>\n" + call)
    assert not grammar(key).accepts("Sure! " + call)


def test_harmony_may_reason_on_the_analysis_channel_first() -> None:
    call = write("harmony", ("get_time", {}))
    assert grammar("harmony").accepts("<|channel|>analysis<|message|>time?<|end|><|start|>assistant" + call)


def test_a_schema_with_references_gives_the_same_grammar_every_time() -> None:
    tool = Tool(
        "move",
        parameters={
            "type": "object",
            "$defs": {
                "point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
            },
            "properties": {"to": {"$ref": "#/$defs/point"}},
            "required": ["to"],
        },
    )
    hermes = family_for(TEMPLATES["hermes"][0])
    first = hermes.call_grammar([tool])
    assert hermes.call_grammar([tool]) == first and compiles(first)
    assert Grammar.parse(first).accepts(write("hermes", ("move", {"to": {"x": 1}})))
    assert not Grammar.parse(first).accepts(write("hermes", ("move", {"to": {"y": 1}})))
    assert schema_problem(tool.parameters) is None


def test_a_grammar_needs_a_tool_to_call() -> None:
    hermes = family_for(TEMPLATES["hermes"][0])
    with pytest.raises(ValueError, match="no tool named 'nope'"):
        hermes.call_grammar(TOOLS, "nope")
    with pytest.raises(ValueError, match="no tools"):
        hermes.call_grammar([])


# --------------------------------------------------------------- schemas


def test_validate_arguments() -> None:
    assert validate_arguments(WEATHER, '{"city": "Paris", "days": 2}') is None
    assert validate_arguments(TIME, "{}") is None
    assert "city" in (validate_arguments(WEATHER, '{"days": 2}') or "")
    assert "days" in (validate_arguments(WEATHER, '{"city": "P", "days": "x"}') or "")
    assert "not JSON" in (validate_arguments(WEATHER, "{city") or "")
    assert "object" in (validate_arguments(WEATHER, "[1]") or "")
    assert validate_arguments(Tool("any"), '{"x": 1}') is None


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({}, None),
        (WEATHER.parameters, None),
        (WRITE.parameters, None),
        ([], "must be a JSON object"),
        ({"type": "string"}, 'type "object"'),
        ({"type": "objekt"}, "unknown type"),
        ({"type": "object", "required": "city"}, "required"),
        ({"type": "object", "properties": []}, "properties"),
        ({"type": "object", "properties": {"a": {"type": "nosuch"}}}, "parameters.properties/a"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "grammar"),
        ({"type": "object", "properties": {"a": {"$ref": "other.json"}}}, "grammar"),
    ],
)
def test_schema_problem(schema: Any, problem: str | None) -> None:
    found = schema_problem(schema)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found, found
