"""Bad input from an agent on a real ``--serve`` (two stages of SmolLM2, our
Hermes-style tool template): a schema the grammar cannot express, a tool
whose parameters are no JSON schema, a ``tool_choice`` naming no such tool,
a ``tool`` message answering no call. Each is a 400 naming the field, and
the server then answers the same good requests exactly as before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.support.agent_served import PARIS, WEATHER, agent_server
from tests.support.served import KEY, Served

pytestmark = [pytest.mark.model, pytest.mark.slow]

ASK = [{"role": "user", "content": PARIS}]
REMOTE = {"$ref": "https://example.com/x.json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[Served]:
    with agent_server(tmp_path_factory.mktemp("bad"), model_path) as served:
        yield served


def good(client: openai.OpenAI) -> tuple[str, str, str]:
    """Greedy answers: a text, a forced call's arguments, a schema's JSON."""
    text = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Name three rivers."}],
        max_tokens=24,
        temperature=0,
    )
    call = client.chat.completions.create(
        model="smol", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80, temperature=0
    )
    schema = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "A person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "p",
                "schema": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}},
                    "required": ["name"],
                },
            },
        },
        max_tokens=40,
        temperature=0,
    )
    calls = call.choices[0].message.tool_calls or []
    return (
        text.choices[0].message.content or "",
        "".join(c.function.arguments for c in calls),
        schema.choices[0].message.content or "",
    )


@pytest.fixture(scope="module")
def before(server: Served) -> tuple[str, str, str]:
    answers = good(server.client())
    assert all(answers), answers
    return answers


BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "a remote $ref in response_format": (
        {
            "messages": ASK,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": REMOTE}},
        },
        "response_format.json_schema.schema",
        "grammar cannot express",
    ),
    "a remote $ref in llama-server's json_schema": (
        {"messages": ASK, "extra_body": {"json_schema": REMOTE}},
        "json_schema",
        "grammar cannot express",
    ),
    "a tool's parameters of an unknown type": (
        {
            "messages": ASK,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ],
        },
        "tools[0].function.parameters",
        "'f'",
    ),
    "a tool's parameters that are no object": (
        {"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": [1, 2]}}]},
        "tools[0].function.parameters",
        "",
    ),
    "tool_choice naming no such tool": (
        {
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        "tool_choice",
        "'nope'",
    ),
    "a tool message answering no call": (
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
        "messages[1].tool_call_id",
        "call_1",
    ),
    "a tool message after a turn with other calls": (
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_a",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_b", "content": "sunny"},
            ],
            "tools": [WEATHER],
        },
        "messages[2].tool_call_id",
        "call_b",
    ),
}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_input_is_a_400_naming_it_and_changes_nothing(
    server: Served, before: tuple[str, str, str], what: str
) -> None:
    body, param, says = BAD[what]
    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smol", max_tokens=16, **body)
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == param, error
    assert says in error["message"] and len(error["message"]) < 400, error
    assert good(client) == before


def test_anthropic_tool_choice_naming_no_such_tool(server: Served, before: tuple[str, str, str]) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model="smol",
            max_tokens=16,
            messages=[{"role": "user", "content": PARIS}],
            tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
            tool_choice={"type": "tool", "name": "nope"},
        )
    assert "tool_choice" in str(refused.value) and "nope" in str(refused.value)
    assert good(server.client()) == before


def test_responses_tool_choice_naming_no_such_tool(server: Served, before: tuple[str, str, str]) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().responses.create(
            model="smol",
            input=PARIS,
            tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "nope"},
            max_output_tokens=16,
        )
    error = refused.value.body
    assert isinstance(error, dict) and "tool_choice" in str(error.get("param")), error
    assert good(server.client()) == before


def test_a_bad_tool_among_thirty_is_named_not_quoted(server: Served, before: tuple[str, str, str]) -> None:
    """A 30-tool agent's error names the one tool, not the whole list."""
    tools: list[Any] = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "Does one thing well. " * 20,
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
            },
        }
        for i in range(30)
    ]
    tools[17]["function"]["parameters"] = {"type": "object", "properties": {"x": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().chat.completions.create(model="smol", messages=ASK, tools=tools, max_tokens=8)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "tools[17].function.parameters", error
    assert "tool_17" in error["message"] and "Does one thing" not in error["message"]
    assert good(server.client()) == before


def test_a_schema_the_grammar_cannot_express_in_the_other_apis(
    server: Served, before: tuple[str, str, str]
) -> None:
    """output_config.format (Anthropic) and text.format (Responses) hold the
    reply to their schema by a grammar, so a remote $ref is their 400 too."""
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model="smol",
            max_tokens=16,
            messages=[{"role": "user", "content": "A person."}],
            output_config={"format": {"type": "json_schema", "schema": REMOTE}},
        )
    assert "output_config.format.schema" in str(refused.value) and "grammar cannot express" in str(
        refused.value
    )
    with pytest.raises(openai.BadRequestError) as refused_too:
        server.client().responses.create(
            model="smol",
            input="A person.",
            text={"format": {"type": "json_schema", "name": "p", "schema": REMOTE}},
            max_output_tokens=16,
        )
    error = refused_too.value.body
    assert isinstance(error, dict) and error.get("param") == "text.format.schema", error
    assert good(server.client()) == before


def test_the_server_logged_no_fault(server: Served) -> None:
    log = "".join(server.lines)
    assert "Traceback" not in log and "fault" not in log.lower(), log[-3000:]
