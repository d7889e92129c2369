"""The clients agents are built on, against a real ``--serve`` (two stages
of SmolLM2, our Hermes-style tool template): LangChain's ChatOpenAI
(``bind_tools`` with ``tool_choice``, ``with_structured_output`` by each of
its three methods), LiteLLM with tools, the ``anthropic`` SDK (text,
streaming, a forced ``tool_use``, count_tokens) and OpenAI's Responses API
(text, a forced function call, streaming, ``previous_response_id``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import pydantic
import pytest

from tests.support.agent_served import PARIS, TIME, WEATHER, WEATHER_PARAMETERS, agent_server
from tests.support.served import KEY, Served

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[Served]:
    with agent_server(tmp_path_factory.mktemp("clients"), model_path) as served:
        yield served


class Person(pydantic.BaseModel):
    """A person: their name and age."""

    name: str
    age: int


def chat_openai(server: Served, **options: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=f"{server.url}/v1", api_key=KEY, model="smol", temperature=0, max_retries=0, **options
    )


# ------------------------------------------------------------------ LangChain


@pytest.mark.parametrize("tool_choice", ["get_weather", "required", "any"])
def test_langchain_bind_tools_gives_tool_calls(server: Served, tool_choice: str) -> None:
    model = chat_openai(server, max_tokens=80).bind_tools(
        [WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=False
    )
    message = model.invoke(PARIS)
    assert len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    if tool_choice == "get_weather":
        assert call["name"] == "get_weather"
    assert call["name"] in ("get_weather", "get_time") and call["id"]
    if call["name"] == "get_weather":
        jsonschema.validate(call["args"], WEATHER_PARAMETERS)
    assert message.response_metadata["finish_reason"] == "tool_calls"


ADA = 'Reply with a JSON object with the keys "name" and "age" for: Ada, 36 years old.'


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(server: Served, method: str) -> None:
    """function_calling forces a call of the tool "Person", json_schema holds
    the reply to Person's schema: either way a Person, whatever the model."""
    model = chat_openai(server, max_tokens=80).with_structured_output(Person, method=method)
    assert isinstance(model.invoke("Ada is 36 years old. Who is she?"), Person)
    assert model.invoke(ADA) == Person(name="Ada", age=36)


def test_langchain_structured_output_json_mode(server: Served) -> None:
    """json_mode holds the reply to a JSON object only, not to Person's
    fields: the prompt names them, and greedy SmolLM2 writes them."""
    model = chat_openai(server, max_tokens=80).with_structured_output(
        Person, method="json_mode", include_raw=True
    )
    out = model.invoke(ADA)
    assert isinstance(json.loads(out["raw"].content), dict)
    assert out["parsing_error"] is None and out["parsed"] == Person(name="Ada", age=36), out


def test_langchain_streams_a_bound_tool_s_call(server: Served) -> None:
    model = chat_openai(server, max_tokens=80).bind_tools(
        [WEATHER], tool_choice="get_weather", parallel_tool_calls=False
    )
    merged: Any = None
    for chunk in model.stream(PARIS):
        merged = chunk if merged is None else merged + chunk
    (call,) = merged.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_PARAMETERS)
    assert merged.response_metadata["finish_reason"] == "tool_calls"


# -------------------------------------------------------------------- LiteLLM


def test_litellm_completion_with_tools(server: Served) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the internet
    import litellm

    reply = litellm.completion(
        model="openai/smol",
        api_base=f"{server.url}/v1",
        api_key=KEY,
        messages=[{"role": "user", "content": PARIS}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call, *_) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


# ------------------------------------------------------------------ anthropic


#: This SDK's create() takes no sampling fields; the API still does.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(server: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_anthropic_text(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model="smol",
        max_tokens=20,
        system="You are terse.",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body=GREEDY,
    )
    assert message.role == "assistant" and message.type == "message"
    assert message.content[0].type == "text" and message.content[0].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_anthropic_streaming_equals_the_whole_message(claude: anthropic.Anthropic) -> None:
    ask: dict[str, Any] = {
        "model": "smol",
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "Name three fruits."}],
        "extra_body": GREEDY,
    }
    whole = claude.messages.create(**ask)
    texts = []
    with claude.messages.stream(**ask) as stream:
        for text in stream.text_stream:
            texts.append(text)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason


def test_anthropic_forced_tool_use(claude: anthropic.Anthropic) -> None:
    tool = {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "input_schema": WEATHER_PARAMETERS,
    }
    message = claude.messages.create(
        model="smol",
        max_tokens=80,
        messages=[{"role": "user", "content": PARIS}],
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert len(uses) >= 1 and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, WEATHER_PARAMETERS)
    # The result goes back as a tool_result block, and is answered.
    answer = claude.messages.create(
        model="smol",
        max_tokens=30,
        messages=[
            {"role": "user", "content": PARIS},
            {"role": "assistant", "content": message.content},  # type: ignore[typeddict-item]
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 degrees"}
                    for use in uses
                ],
            },
        ],
        tools=[tool],  # type: ignore[list-item]
        extra_body=GREEDY,
    )
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_anthropic_streamed_tool_use(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model="smol",
        max_tokens=80,
        messages=[{"role": "user", "content": PARIS}],
        tools=[{"name": "get_weather", "input_schema": WEATHER_PARAMETERS}],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_message()
    assert "input_json" in kinds, "the input streams as input_json_delta"
    assert final.stop_reason == "tool_use"
    (use,) = final.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_PARAMETERS)


def test_anthropic_parse_holds_the_reply_to_the_schema(claude: anthropic.Anthropic) -> None:
    """messages.parse sends output_config.format: the reply is held to it."""
    parsed = claude.messages.parse(
        model="smol",
        max_tokens=60,
        messages=[{"role": "user", "content": "Ada is 36."}],
        output_format=Person,
        extra_body=GREEDY,
    )
    assert isinstance(parsed.parsed_output, Person)


def test_anthropic_count_tokens(claude: anthropic.Anthropic) -> None:
    short = claude.messages.count_tokens(model="smol", messages=[{"role": "user", "content": "Hi"}])
    longer = claude.messages.count_tokens(
        model="smol", messages=[{"role": "user", "content": "Hi there, how are you doing today?"}]
    )
    assert 0 < short.input_tokens < longer.input_tokens


# ---------------------------------------------------------- OpenAI Responses


def test_responses_text(server: Served) -> None:
    response = server.client().responses.create(
        model="smol", input="What is the capital of France?", max_output_tokens=20, temperature=0
    )
    assert response.status in ("completed", "incomplete")
    assert response.output_text.strip()


def test_responses_forced_function_call(server: Served) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS, "strict": True}
    response = server.client().responses.create(
        model="smol",
        input=PARIS,
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
        temperature=0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMETERS)


def test_responses_parse_holds_the_reply_to_the_schema(server: Served) -> None:
    """responses.parse sends text.format's json_schema: the reply is held to it."""
    response = server.client().responses.parse(
        model="smol", input="Ada is 36.", text_format=Person, max_output_tokens=60, temperature=0
    )
    assert isinstance(response.output_parsed, Person)


def test_responses_streamed_call_and_its_output_continued(server: Served) -> None:
    client = server.client()
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}
    kinds, final = [], None
    for event in client.responses.create(
        model="smol",
        input=PARIS,
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
        stream=True,
    ):
        kinds.append(event.type)
        if event.type == "response.completed":
            final = event.response
    assert "response.function_call_arguments.delta" in kinds and final is not None
    (call,) = [item for item in final.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    answer = client.responses.create(
        model="smol",
        previous_response_id=final.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 degrees"}],
        tools=[tool],  # type: ignore[list-item]
        max_output_tokens=20,
        temperature=0,
    )
    assert answer.status in ("completed", "incomplete") and answer.output


def test_responses_streaming(server: Served) -> None:
    client = server.client()
    whole = client.responses.create(
        model="smol", input="Name three fruits.", max_output_tokens=20, temperature=0
    )
    kinds, deltas, final = [], [], None
    for event in client.responses.create(
        model="smol", input="Name three fruits.", max_output_tokens=20, temperature=0, stream=True
    ):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[0] == "response.created" and final is not None
    assert "response.output_text.delta" in kinds
    assert "".join(deltas) == final.output_text == whole.output_text


def test_responses_previous_response_id_continues(server: Served) -> None:
    client = server.client()
    first = client.responses.create(
        model="smol", input="My name is Ada. Remember it.", max_output_tokens=16, temperature=0
    )
    second = client.responses.create(
        model="smol",
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=16,
        temperature=0,
    )
    assert second.output_text.strip()
    assert second.usage and first.usage
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens, (
        "the first exchange is in the second's prompt"
    )
