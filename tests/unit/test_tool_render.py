"""A conversation with calls and results as templates take it
(ggufpipe_tui/server/tools/render.py), rendered with our own templates."""

from __future__ import annotations

import json

import pytest

from ggufpipe_tui.server.request import CallArguments, CallStart, Message, Text, ToolCall
from ggufpipe_tui.server.tools import Family, family_for
from ggufpipe_tui.server.tools.render import object_arguments, template_messages, template_tools
from tests.support.tool_templates import TEMPLATES, render
from tests.unit.test_tool_calls import TOOLS, WEATHER, parse

HISTORY = (
    Message("user", "Weather in Paris?"),
    Message("assistant", "", (ToolCall("call_0123456789abcdef", "get_weather", '{"city": "Paris"}'),)),
    Message("tool", "17C and sunny", tool_call_id="call_0123456789abcdef"),
)


def family(key: str) -> Family:
    return family_for(TEMPLATES[key][0])


def test_tools_take_the_openai_shape() -> None:
    (weather, time, _) = template_tools(TOOLS)
    assert weather == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": WEATHER.description,
            "parameters": dict(WEATHER.parameters),
        },
    }
    assert time["function"]["parameters"] == {"type": "object", "properties": {}}


def test_a_call_and_its_result_keep_one_id_and_the_result_gets_the_name() -> None:
    call, result = template_messages(HISTORY, family("hermes"))[1:]
    assert call["tool_calls"] == [
        {
            "id": "call_0123456789abcdef",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ]
    assert result == {
        "role": "tool",
        "content": "17C and sunny",
        "tool_call_id": "call_0123456789abcdef",
        "name": "get_weather",
    }


def test_arguments_as_json_text_when_asked() -> None:
    call = template_messages(HISTORY, family("hermes"), object_args=False)[1]
    assert call["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize("key", ["mistral-list", "mistral-call-id"])
def test_mistral_gets_nine_character_ids(key: str) -> None:
    _, call, result = template_messages(HISTORY, family(key))
    new = call["tool_calls"][0]["id"]
    assert len(new) == 9 and new.isalnum() and result["tool_call_id"] == new
    assert template_messages(HISTORY, family(key))[1]["tool_calls"][0]["id"] == new  # stable
    kept = (Message("assistant", "", (ToolCall("abcDEF123", "get_time", "{}"),)),)
    assert template_messages(kept, family(key))[0]["tool_calls"][0]["id"] == "abcDEF123"
    assert "17C and sunny" in render(
        TEMPLATES[key][0], template_messages(HISTORY, family(key)), template_tools(TOOLS)
    )


def test_kimi_gets_its_own_id_form() -> None:
    _, call, result = template_messages(HISTORY, family("kimi"))
    assert call["tool_calls"][0]["id"] == "functions.get_weather:0" == result["tool_call_id"]
    kept = (Message("assistant", "", (ToolCall("functions.get_time:4", "get_time", "{}"),)),)
    assert template_messages(kept, family("kimi"))[0]["tool_calls"][0]["id"] == "functions.get_time:4"


def test_templates_that_join_arguments_as_text_are_told() -> None:
    joins = "{{ '<call>' + tc['function']['arguments'] + '</call>' }}"
    assert not object_arguments(joins)
    assert object_arguments(TEMPLATES["hermes"][0])
    assert object_arguments(
        "{% if a.arguments is string %}{{ a.arguments }}{% else %}{{ a.arguments | tojson }}{% endif %}"
    )
    rendered = render(
        "{% for m in messages %}{% for tc in m.tool_calls or [] %}" + joins + "{% endfor %}{% endfor %}",
        template_messages(HISTORY, family("hermes"), object_args=object_arguments(joins)),
    )
    assert rendered == '<call>{"city": "Paris"}</call>'


@pytest.mark.parametrize("key", sorted(k for k in TEMPLATES if k != "plain"))
def test_every_template_renders_a_history_with_calls_and_results(key: str) -> None:
    prompt = render(TEMPLATES[key][0], template_messages(HISTORY, family(key)), template_tools(TOOLS))
    assert "17C and sunny" in prompt and "Paris" in prompt


# --------------------------------------------------- our templates, rendered

CALLS = [
    {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    },
    {
        "id": "functions.write:1",
        "type": "function",
        "function": {"name": "write", "arguments": {"path": 'a "b"', "data": {"k": [1, {"x": "}"}]}}},
    },
]
MISTRAL_IDS = ["abcDEF123", "XYZ987abc"]


def openai_tools() -> list[dict[str, object]]:
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)},
        }
        for t in TOOLS
    ]


def calls_for(key: str) -> list[dict[str, object]]:
    if key.startswith("mistral"):
        return [dict(c, id=i) for c, i in zip(CALLS, MISTRAL_IDS, strict=True)]
    return CALLS


@pytest.mark.parametrize("key", sorted(k for k in TEMPLATES if k != "plain"))
@pytest.mark.parametrize("size", (1, 3, 10_000))
def test_calls_our_template_writes_are_read_back(key: str, size: int) -> None:
    template = TEMPLATES[key][0]
    user = [{"role": "user", "content": "Weather in Paris, and write it down"}]
    asked = render(template, user, openai_tools(), add_generation_prompt=True)
    said = render(
        template,
        [*user, {"role": "assistant", "content": "", "tool_calls": calls_for(key)}],
        openai_tools(),
        add_generation_prompt=False,
    )
    assert said.startswith(asked), "the generation prompt is where the reply begins"
    pieces = parse(family(key), said[len(asked) :], size)
    calls = [(p.name, p.id) for p in pieces if isinstance(p, CallStart)]
    args = [json.loads(p.arguments) for p in pieces if isinstance(p, CallArguments)]
    assert [name for name, _ in calls] == ["get_weather", "write"]
    assert args == [c["function"]["arguments"] for c in CALLS]  # type: ignore[index]
    text = "".join(p.text for p in pieces if isinstance(p, Text))
    assert "get_weather" not in text and "Paris" not in text
    if key == "kimi" or key in ("mistral-list", "mistral-call-id"):
        assert [i for _, i in calls] == [c["id"] for c in calls_for(key)]


@pytest.mark.parametrize("key", sorted(TEMPLATES))
def test_our_templates_render_the_tools_and_the_tool_results(key: str) -> None:
    template, name = TEMPLATES[key]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": calls_for(key)[:1]},
        {
            "role": "tool",
            "tool_call_id": calls_for(key)[0]["id"],
            "name": "get_weather",
            "content": "RESULT-17C",
        },
    ]
    if name == "generic":
        messages = [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "RESULT-17C"}]
    prompt = render(template, messages, openai_tools() if name != "generic" else None)
    assert "RESULT-17C" in prompt
    if name != "generic":
        assert all(t.name in prompt for t in TOOLS)
