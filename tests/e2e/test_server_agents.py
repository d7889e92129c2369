"""Agents drive a real ``--serve`` (two stages of SmolLM2, our Hermes-style
tool template) through the official ``openai`` SDK: tool calls named,
required and streamed, a tool's result in the history, structured output,
logprobs, ``n``, legacy completions' logprobs; then CORS and /metrics.

SmolLM2-135M is tiny: a ``required`` or named ``tool_choice`` and a schema
are grammar-forced, so they hold whatever it writes; ``auto`` may or may
not call, and nothing here asserts that it does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest

from tests.support.agent_served import (
    ORIGIN,
    PARIS,
    TIME,
    TIME_PARAMETERS,
    WEATHER,
    WEATHER_PARAMETERS,
    agent_server,
)
from tests.support.prometheus import parse
from tests.support.served import KEY, Served

pytestmark = [pytest.mark.model, pytest.mark.slow]

ASK = [{"role": "user", "content": PARIS}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[Served]:
    with agent_server(tmp_path_factory.mktemp("agents"), model_path) as served:
        yield served


@pytest.fixture(scope="module")
def client(server: Served) -> openai.OpenAI:
    return server.client()


def check_call(call: Any, name: str, schema: dict[str, Any]) -> dict[str, Any]:
    assert call.type == "function" and call.function.name == name and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    return arguments


@pytest.mark.parametrize(
    "choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_a_forced_tool_call_is_valid_against_its_schema(client: openai.OpenAI, choice: Any) -> None:
    reply = client.chat.completions.create(
        model="smol",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    (only,) = reply.choices
    assert only.finish_reason == "tool_calls"
    calls = only.message.tool_calls or []
    assert len(calls) == 1, only.message
    if choice == "required":
        name = calls[0].function.name
        assert name in ("get_weather", "get_time")
        check_call(calls[0], name, WEATHER_PARAMETERS if name == "get_weather" else TIME_PARAMETERS)
    else:
        check_call(calls[0], "get_weather", WEATHER_PARAMETERS)
    assert not only.message.content, "the call's markup is not left in the content"


def test_a_streamed_call_comes_in_delta_tool_calls_chunks(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model="smol",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    stream = client.chat.completions.create(
        model="smol",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    pieces, finishes = 0, []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                pieces += 1
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                if delta.id:
                    call["id"] = delta.id
                if delta.function and delta.function.name:
                    call["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    assert finishes == ["tool_calls"]
    assert list(calls) == [0] and pieces > 2, "the arguments come in pieces"
    (call,) = calls.values()
    assert call["id"] and call["name"] == "get_weather"
    arguments = json.loads(call["arguments"])
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    (whole_call,) = whole.choices[0].message.tool_calls or []
    assert arguments == json.loads(whole_call.function.arguments), "streamed as the whole reply's"


def test_a_tool_result_in_the_history_is_answered(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="smol", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80, temperature=0
    )
    message = first.choices[0].message
    calls = message.tool_calls or []
    assert calls
    history: list[Any] = [
        *ASK,
        message.model_dump(exclude_none=True),
        *(
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny", "degrees": 21})}
            for call in calls
        ),
    ]
    answer = client.chat.completions.create(
        model="smol", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=40, temperature=0
    )
    (only,) = answer.choices
    assert only.message.content and only.message.content.strip()
    assert not only.message.tool_calls and only.finish_reason in ("stop", "length")


def test_auto_answers_in_text_or_a_valid_call(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="smol", messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=60, temperature=0
    )
    (only,) = reply.choices
    for call in only.message.tool_calls or []:
        check_call(call, "get_weather", WEATHER_PARAMETERS)
    assert only.message.tool_calls or only.message.content


def test_json_schema_output_parses_and_validates(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Describe a person called Ada, aged 36, as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        max_tokens=80,
        temperature=0,
    )
    (only,) = reply.choices
    assert only.finish_reason == "stop", "a schema's object ends by itself"
    jsonschema.validate(json.loads(only.message.content or ""), PERSON)


def test_json_object_output_is_an_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="smol",
        messages=[
            {
                "role": "user",
                "content": 'Reply with a JSON object with the keys "name" and "age" for: Ada, 36 years old.',
            }
        ],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    (only,) = reply.choices
    assert only.finish_reason == "stop"
    assert isinstance(json.loads(only.message.content or ""), dict)


def test_chat_logprobs_name_the_reply_s_tokens(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        logprobs=True,
        top_logprobs=3,
        max_tokens=12,
        temperature=0,
    )
    (only,) = reply.choices
    entries = only.logprobs.content if only.logprobs else None
    assert entries and len(entries) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert all(top.logprob <= 0 for top in entry.top_logprobs)
        # Greedy: the chosen token is the likeliest of its alternatives.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert b"".join(bytes(entry.bytes or b"") for entry in entries).decode() == only.message.content
    assert "".join(entry.token for entry in entries) == only.message.content


def test_streamed_logprobs_come_with_their_text(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        logprobs=True,
        top_logprobs=2,
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    text, tokens = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for entry in (choice.logprobs.content or []) if choice.logprobs else []:
                assert len(entry.top_logprobs) == 2
                tokens += entry.token
    assert text and tokens == text


def test_n_gives_that_many_choices(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Name a colour."}],
        n=2,
        max_tokens=10,
        temperature=0.9,
        seed=7,
    )
    assert [choice.index for choice in reply.choices] == [0, 1]
    assert all(choice.message.content for choice in reply.choices)
    again = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Name a colour."}],
        n=2,
        max_tokens=10,
        temperature=0.9,
        seed=7,
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_legacy_completion_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="smol", prompt="The capital of France is", logprobs=2, max_tokens=8, temperature=0
    )
    (only,) = reply.choices
    logprobs = only.logprobs
    assert logprobs and logprobs.tokens and logprobs.token_logprobs and logprobs.text_offset
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 8
    assert "".join(logprobs.tokens) == only.text
    assert all(value <= 0 for value in logprobs.token_logprobs)
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    assert logprobs.top_logprobs and all(len(top) == 2 for top in logprobs.top_logprobs)


def test_a_reply_cut_inside_a_character_ends_before_it(client: openai.OpenAI) -> None:
    """The reply's tokens end inside a character (their bytes say so): the
    text ends before it, never with U+FFFD."""
    cut_inside = 0
    for prompt in (
        "Translate 'good morning' to Japanese.",
        "Write three emoji: a cat, a dog and a smiling face.",
    ):
        for max_tokens in (2, 3, 5, 12):
            reply = client.chat.completions.create(
                model="smol",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                logprobs=True,
                temperature=0,
            )
            (only,) = reply.choices
            content = only.message.content or ""
            assert "\ufffd" not in content, (prompt, max_tokens, content)
            raw = b"".join(bytes(entry.bytes or b"") for entry in only.logprobs.content or [])  # type: ignore[union-attr]
            whole = raw.decode("utf-8", "ignore")
            assert content == whole, "all the whole characters, no more"
            cut_inside += len(raw) > len(whole.encode())
    assert cut_inside, "some reply was cut inside a character"


def test_a_preflight_and_the_metrics_after_the_requests(server: Served) -> None:
    async def main() -> None:
        preflight = {
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        async with aiohttp.ClientSession(base_url=server.url) as bare:
            async with bare.options("/v1/chat/completions", headers=preflight) as reply:
                assert reply.status == 204
                assert reply.headers["Access-Control-Allow-Origin"] == ORIGIN
                assert "POST" in reply.headers["Access-Control-Allow-Methods"]
                assert reply.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
            async with bare.options(
                "/v1/chat/completions", headers=dict(preflight, Origin="http://elsewhere.test")
            ) as reply:
                assert "Access-Control-Allow-Origin" not in reply.headers
            async with bare.get("/health", headers={"Origin": ORIGIN}) as reply:
                assert reply.headers["Access-Control-Allow-Origin"] == ORIGIN
        async with (
            aiohttp.ClientSession(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as http,
            http.get("/metrics") as reply,
        ):
            assert reply.status == 200
            assert reply.headers["Content-Type"].startswith("text/plain")
            samples = parse(await reply.text())
        chats = sum(
            value
            for (name, labels), value in samples.items()
            if name == "ggufpipe_requests_total" and ("endpoint", "/v1/chat/completions") in labels
        )
        assert chats >= 10, "the chat requests before this one are counted"
        counted = {name: value for (name, _), value in samples.items()}
        assert counted.get("llamacpp:tokens_predicted_total", 0) > 0, sorted(counted)
        assert counted.get("llamacpp:prompt_tokens_total", 0) > 0
        assert samples[("ggufpipe_stages", ())] == 2

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("max_tokens", [20, 60])
def test_a_call_cut_by_max_tokens_ends_with_length(
    client: openai.OpenAI, stream: bool, max_tokens: int
) -> None:
    """20 tokens cut the first call, 60 a second one (parallel calls are on):
    the reply says it was cut ("length", as OpenAI and llama-server say), not
    "tool_calls", so no agent runs a call whose arguments never ended."""
    ask: dict[str, Any] = {
        "model": "smol",
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        finishes = [
            choice.finish_reason
            for chunk in client.chat.completions.create(**ask, stream=True)
            for choice in chunk.choices
            if choice.finish_reason
        ]
    else:
        reply = client.chat.completions.create(**ask)
        finishes = [choice.finish_reason for choice in reply.choices]
        assert reply.usage and reply.usage.completion_tokens == max_tokens
    assert finishes == ["length"]


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    """The SDK's chat.completions.parse sends the model's strict json_schema."""
    import pydantic

    class Person(pydantic.BaseModel):
        name: str
        age: int

    reply = client.chat.completions.parse(
        model="smol",
        messages=[{"role": "user", "content": "Ada is 36."}],
        response_format=Person,
        max_tokens=60,
        temperature=0,
    )
    assert isinstance(reply.choices[0].message.parsed, Person)
