"""Anthropic's Messages API translation: request bodies into a Completion,
the run's pieces into the answer and its stream, read back by the real
``anthropic`` SDK from a small aiohttp server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from aiohttp import web

from ggufpipe_tui.server import anthropic_api as api
from ggufpipe_tui.server.openai_api import ApiError
from ggufpipe_tui.server.request import (
    CallArguments,
    CallStart,
    Finish,
    Message,
    Piece,
    Text,
    Tool,
    ToolCall,
    Usage,
)

anthropic = pytest.importorskip("anthropic")


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **fields}


def refused(fields: dict[str, Any], named: str) -> str:
    with pytest.raises(ApiError) as caught:
        api.parse_messages(fields)
    assert caught.value.status == 400
    assert named in caught.value.message
    return caught.value.message


# ------------------------------------------------------------------ parsing


def test_a_plain_request() -> None:
    completion = api.parse_messages(
        body(system="be brief", temperature=0.5, top_p=0.9, top_k=20, stop_sequences=["\n\n", ""])
    )
    assert completion.api == "messages" and completion.chat
    assert completion.messages == (Message("system", "be brief"), Message("user", "hi"))
    assert completion.options.max_tokens == 64
    assert completion.options.temperature == 0.5
    assert completion.options.top_p == 0.9 and completion.options.top_k == 20
    assert completion.stop == ("\n\n",)
    assert not completion.stream and completion.model == "m"
    assert completion.tool_choice == "auto" and completion.tools == ()


def test_system_blocks_and_text_blocks() -> None:
    completion = api.parse_messages(
        body(
            system=[
                {"type": "text", "text": "a "},
                {"type": "text", "text": "b", "cache_control": {"type": "x"}},
            ],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}
            ],
            metadata={"user_id": "u"},
            thinking={"type": "disabled"},
            stream=True,
        )
    )
    assert completion.messages == (Message("system", "a b"), Message("user", "x\ny"))
    assert completion.stream


def test_claude_codes_stamp_leaves_the_prompt_cacheable() -> None:
    stamped = "x-anthropic-billing-header: cc_version=2.1; cc_entrypoint=cli; cch=a5145;"
    blocks = [{"type": "text", "text": stamped}, {"type": "text", "text": "You are a CLI."}]
    completion = api.parse_messages(body(system=blocks))
    said = "x-anthropic-billing-header: cc_version=2.1; cc_entrypoint=cli; cch=fffff;You are a CLI."
    assert completion.messages[0] == Message("system", said)
    assert (
        api.parse_messages(body(system="keep cch=a5145; here")).messages[0].content == "keep cch=a5145; here"
    )


def test_output_config_holds_the_reply_to_a_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    completion = api.parse_messages(body(output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert completion.schema == schema and "root ::=" in completion.grammar  # the reply held to it
    refused(
        body(output_config={"format": {"type": "json_schema", "schema": {"$ref": "https://example.com/x"}}}),
        "output_config.format.schema",
    )
    assert api.parse_messages(body(output_config={})).schema is None
    refused(body(output_config={"effort": "high"}), "output_config.effort")
    refused(body(output_config={"format": {"type": "json_schema"}}), "output_config.format.schema")
    strict = api.parse_messages(
        body(tools=[{"name": "f", "input_schema": {"type": "object"}, "strict": True}])
    )
    assert strict.tools[0].strict


def test_max_tokens_is_required() -> None:
    fields = body()
    del fields["max_tokens"]
    refused(fields, "max_tokens")
    refused(body(max_tokens=0), "max_tokens")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (body(temperature=1.5), "temperature"),
        (body(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
        (body(stop_sequences="x"), "stop_sequences"),
        (body(frobnicate=1), "frobnicate"),
        (body(mcp_servers=[]), "mcp_servers"),
        (body(stream="yes"), "stream"),
        (body(messages=[]), "messages"),
        (body(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
        (
            body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            "messages[0].content[0]",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
            "document",
        ),
        (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
        (body(tools=[{"name": "f"}]), "tools[0].input_schema"),
        (body(tools=[{"name": "f", "input_schema": {"type": "string"}}]), "tools[0].input_schema"),
        (body(tools=[{"name": "a b", "input_schema": {}}]), "tools[0].name"),
        (body(tool_choice={"type": "any"}), "tool_choice"),
        (body(tool_choice={"type": "sometimes"}), "tool_choice.type"),
    ],
)
def test_refused_by_name(fields: dict[str, Any], named: str) -> None:
    refused(fields, named)


def test_a_large_value_is_named_not_quoted() -> None:
    said = refused(body(tools=[{"name": "x" * 5000, "input_schema": {}}]), "tools[0].name")
    assert len(said) < 200


TOOLS = [
    {
        "name": "get_weather",
        "description": "the weather",
        "input_schema": {"type": "object", "properties": {}},
    },
    {"name": "get_time", "input_schema": {"type": "object"}},
]


def test_tools_and_tool_choice() -> None:
    completion = api.parse_messages(body(tools=TOOLS))
    assert completion.tools == (
        Tool("get_weather", "the weather", {"type": "object", "properties": {}}),
        Tool("get_time", "", {"type": "object"}),
    )
    assert (completion.tool_choice, completion.parallel_tool_calls) == ("auto", True)
    choice = api.parse_messages(
        body(tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    )
    assert (choice.tool_choice, choice.parallel_tool_calls) == ("required", False)
    named = api.parse_messages(body(tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"}))
    assert (named.tool_choice, named.tool_name) == ("function", "get_time")
    assert api.parse_messages(body(tools=TOOLS, tool_choice={"type": "none"})).tool_choice == "none"
    refused(body(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name")
    refused(body(tools=[*TOOLS, TOOLS[0]]), "tools[2].name")


def test_tool_use_and_tool_results_in_place() -> None:
    completion = api.parse_messages(
        body(
            tools=TOOLS,
            messages=[
                {"role": "user", "content": "weather and time?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {
                            "type": "tool_use",
                            "id": "tu_1",
                            "name": "get_weather",
                            "input": {"city": "Zürich"},
                        },
                        {"type": "tool_use", "id": "tu_2", "name": "get_time", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "tu_1", "content": "sunny"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "tu_2",
                            "content": [{"type": "text", "text": "no clock"}],
                            "is_error": True,
                        },
                        {"type": "text", "text": "and?"},
                    ],
                },
            ],
        )
    )
    assert completion.messages == (
        Message("user", "weather and time?"),
        Message(
            "assistant",
            "Checking.",
            tool_calls=(
                ToolCall("tu_1", "get_weather", '{"city": "Zürich"}'),
                ToolCall("tu_2", "get_time", "{}"),
            ),
        ),
        Message("tool", "sunny", tool_call_id="tu_1", name="get_weather"),
        Message("tool", "Error: no clock", tool_call_id="tu_2", name="get_time"),
        Message("user", "and?"),
    )


def test_a_tool_result_without_its_tool_use() -> None:
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_9", "content": "x"}]}
    refused(body(messages=[result]), "tu_9")
    use = {"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}
    refused(body(messages=[use]), "messages[0].content[0].type")


def test_error_body_in_anthropics_shape() -> None:
    assert api.error_body(400, "x: bad") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "x: bad"},
    }
    assert api.error_body(503, "busy")["error"]["type"] == "overloaded_error"
    assert api.error_body(404, "no")["error"]["type"] == "not_found_error"


# ---------------------------------------------------------------- answers


def test_stop_reasons() -> None:
    usage = Usage(10, 3, 4)
    answer = api.message_answer(
        api.parse_messages(body()), "msg_1", "m", [Text("a"), Text("b"), Finish("stop", usage, stop="\n\n")]
    )
    assert answer["content"] == [{"type": "text", "text": "ab"}]
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("stop_sequence", "\n\n")
    assert answer["usage"] == {
        "input_tokens": 6,
        "output_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
    }
    cut = api.message_answer(api.parse_messages(body()), "msg_1", "m", [Text("a"), Finish("length", usage)])
    assert cut["stop_reason"] == "max_tokens" and cut["stop_sequence"] is None
    plain = api.message_answer(api.parse_messages(body()), "msg_1", "m", [Finish("stop", usage)])
    assert plain["stop_reason"] == "end_turn" and plain["content"] == [{"type": "text", "text": ""}]


def test_a_stream_closes_each_block_before_the_next() -> None:
    stream = api.MessageStream(api.parse_messages(body()), "msg_1", "m")
    events = stream.start(5)
    for piece in CALLED:
        events += stream.feed(piece)
    assert stream.feed(Text("late")) == []
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    assert [data["index"] for name, data in events if name == "content_block_start"] == [0, 1, 2]


# --------------------------------------------------- the SDK reads them back

CALLED: list[Piece] = [
    Text("Let me "),
    Text("look."),
    CallStart(0, "toolu_1", "get_weather"),
    CallArguments(0, '{"city": "Zü'),
    CallArguments(0, 'rich", "days": 2}'),
    CallStart(1, "toolu_2", "get_time"),
    CallArguments(1, ""),
    Finish("tool_calls", Usage(12, 9, 2)),
]
SCRIPTS: dict[str, list[Piece]] = {
    "text": [Text("Hello"), Text(", wörld"), Finish("stop", Usage(7, 3))],
    "tools": CALLED,
    "json": [Text('{"city": "Bern", '), Text('"days": 3}'), Finish("stop", Usage(5, 8))],
}


async def messages(request: web.Request) -> web.StreamResponse:
    try:
        completion = api.parse_messages(await request.json())
    except ApiError as error:
        return web.json_response(api.error_body(error.status, error.message), status=error.status)
    pieces = SCRIPTS["tools" if completion.tools else "json" if completion.schema else "text"]
    failing = completion.options.max_tokens == 13
    ident = api.new_id()
    if not completion.stream:
        return web.json_response(api.message_answer(completion, ident, "served", pieces))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    stream = api.MessageStream(completion, ident, "served")
    events = stream.start(pieces[-1].usage.prompt_tokens if isinstance(pieces[-1], Finish) else 0)
    for piece in pieces[:1] if failing else pieces:
        events += stream.feed(piece)
    if failing:
        events += stream.fail(503, "a stage was lost")
        assert stream.fail(503, "again") == [] and stream.feed(pieces[-1]) == []
    for name, data in events:
        await response.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
    await response.write_eof()
    return response


@pytest.fixture
async def client() -> AsyncIterator[Any]:
    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    sdk = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0)
    try:
        yield sdk
    finally:
        await sdk.close()
        await runner.cleanup()


def weather_tools() -> Sequence[dict[str, Any]]:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    return [
        {"name": "get_weather", "input_schema": schema},
        {"name": "get_time", "input_schema": {"type": "object"}},
    ]


async def test_sdk_reads_a_text_answer(client: Any) -> None:
    message = await client.messages.create(
        model="m", max_tokens=32, system="brief", messages=[{"role": "user", "content": "hi"}]
    )
    assert message.content[0].type == "text" and message.content[0].text == "Hello, wörld"
    assert message.stop_reason == "end_turn" and message.model == "served"
    assert message.usage.input_tokens == 7 and message.usage.output_tokens == 3


async def test_sdk_reads_a_tool_use_answer(client: Any) -> None:
    message = await client.messages.create(
        model="m",
        max_tokens=32,
        tools=weather_tools(),
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "weather?"}],
    )
    assert message.stop_reason == "tool_use"
    text, first, second = message.content
    assert text.text == "Let me look."
    assert (first.type, first.id, first.name, first.input) == (
        "tool_use",
        "toolu_1",
        "get_weather",
        {"city": "Zürich", "days": 2},
    )
    assert second.input == {}
    assert message.usage.cache_read_input_tokens == 2 and message.usage.input_tokens == 10


async def test_sdk_streams_text(client: Any) -> None:
    async with client.messages.stream(
        model="m", max_tokens=32, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        said = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(said) == "Hello, wörld"
    assert final.content[0].text == "Hello, wörld"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 3


async def test_sdk_streams_tool_use(client: Any) -> None:
    async with client.messages.stream(
        model="m",
        max_tokens=32,
        tools=weather_tools(),
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t0", "name": "get_time", "input": {}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t0", "content": "noon"}]},
        ],
    ) as stream:
        final = await stream.get_final_message()
    assert [block.type for block in final.content] == ["text", "tool_use", "tool_use"]
    assert final.content[0].text == "Let me look."
    assert final.content[1].input == {"city": "Zürich", "days": 2}
    assert final.content[2].name == "get_time" and final.content[2].input == {}
    assert final.stop_reason == "tool_use"
    assert final.usage.input_tokens == 10 and final.usage.output_tokens == 9


async def test_sdk_reads_an_error(client: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(
            model="m",
            max_tokens=32,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
        )
    assert "messages[0].content[0]" in caught.value.message
    assert caught.value.body["error"]["type"] == "invalid_request_error"


async def test_sdk_raises_a_stream_that_failed(client: Any) -> None:
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with client.messages.stream(
            model="m", max_tokens=13, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            await stream.get_final_message()
    assert "a stage was lost" in str(caught.value)


async def test_sdk_parses_structured_output(client: Any) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Forecast(pydantic.BaseModel):
        city: str
        days: int

    message = await client.messages.parse(
        model="m", max_tokens=32, messages=[{"role": "user", "content": "forecast?"}], output_format=Forecast
    )
    assert message.parsed_output == Forecast(city="Bern", days=3)
