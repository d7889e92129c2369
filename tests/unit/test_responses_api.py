"""OpenAI's Responses API translation: request bodies into a Completion, the
store behind previous_response_id, and the run's pieces into the response and
its typed stream, read back by the real ``openai`` SDK from a small aiohttp
server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from ggufpipe_tui.server import responses_answer as answer
from ggufpipe_tui.server.openai_api import ApiError
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
from ggufpipe_tui.server.responses_api import ResponseStore, parse_responses

openai = pytest.importorskip("openai")


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **fields}


def refused(fields: dict[str, Any], named: str, store: ResponseStore | None = None) -> str:
    with pytest.raises(ApiError) as caught:
        parse_responses(fields, store)
    assert caught.value.status == 400
    assert named in caught.value.message
    return caught.value.message


TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "the weather",
        "parameters": {"type": "object"},
    },
    {"type": "function", "name": "get_time", "parameters": None, "strict": False},
]


# ------------------------------------------------------------------ parsing


def test_a_plain_request() -> None:
    completion = parse_responses(
        body(instructions="be brief", max_output_tokens=50, temperature=0.3, top_p=0.5, store=False, user="u")
    )
    assert completion.api == "responses" and completion.chat
    assert completion.messages == (Message("system", "be brief"), Message("user", "hi"))
    assert completion.options.max_tokens == 50
    assert (completion.options.temperature, completion.options.top_p) == (0.3, 0.5)
    assert completion.schema is None and completion.grammar == ""
    assert completion.metadata["store"] is False and completion.metadata["instructions"] == "be brief"


def test_input_items() -> None:
    completion = parse_responses(
        body(
            input=[
                {"role": "developer", "content": "rules"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Looking."}],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city":"Bern"}',
                },
                {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "9"}],
                },
            ]
        )
    )
    assert completion.messages == (
        Message("system", "rules"),
        Message("user", "weather?"),
        Message(
            "assistant",
            "Looking.",
            tool_calls=(ToolCall("c1", "get_weather", '{"city":"Bern"}'), ToolCall("c2", "get_time", "{}")),
        ),
        Message("tool", "sunny", tool_call_id="c1", name="get_weather"),
        Message("tool", "9", tool_call_id="c2", name="get_time"),
    )


def test_text_parts_are_joined_by_newlines() -> None:
    parts = [{"type": "input_text", "text": "<context>"}, {"type": "input_text", "text": "question"}]
    completion = parse_responses(body(input=[{"role": "user", "content": parts}]))
    assert completion.messages == (Message("user", "<context>\nquestion"),)


def test_tools_tool_choice_and_formats() -> None:
    completion = parse_responses(body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert completion.tools == (
        Tool("get_weather", "the weather", {"type": "object"}, strict=True),
        Tool("get_time", "", {"type": "object", "properties": {}}, strict=False),
    )
    assert (completion.tool_choice, completion.parallel_tool_calls) == ("required", False)
    named = parse_responses(body(tools=TOOLS, tool_choice={"type": "function", "name": "get_time"}))
    assert (named.tool_choice, named.tool_name) == ("function", "get_time")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    structured = parse_responses(
        body(text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    )
    assert structured.schema == schema and "root ::=" in structured.grammar  # the reply held to it
    assert parse_responses(body(text={"format": {"type": "json_object"}})).schema == {"type": "object"}
    assert parse_responses(body(text={"format": {"type": "text"}})).schema is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (body(tools=[{"type": "web_search"}]), "tools[0].type"),
        (body(tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice.name"),
        (body(tool_choice="required"), "tool_choice"),
        (body(reasoning={"effort": "high"}), "reasoning"),
        (body(truncation="auto"), "truncation"),
        (body(frobnicate=True), "frobnicate"),
        (body(include=["message.output_text.logprobs"]), "include[0]"),
        (body(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
        (body(text={"format": {"type": "grammar"}}), "text.format.type"),
        (body(input=[{"type": "input_image", "image_url": "x"}]), "input[0].type"),
        (body(input=[{"role": "user", "content": [{"type": "input_image"}]}]), "input[0].content[0].type"),
        (body(input=[{"type": "function_call_output", "call_id": "zz", "output": "x"}]), "zz"),
        (body(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]), "arguments"),
        (body(input=[]), "input"),
        (body(temperature=3), "temperature"),
        (body(stream=1), "stream"),
    ],
)
def test_refused_by_name(fields: dict[str, Any], named: str) -> None:
    refused(fields, named)


def test_previous_response_id_continues_the_conversation() -> None:
    store = ResponseStore(limit=2)
    first = parse_responses(body(instructions="old rules", tools=TOOLS), store)
    store.save("resp_1", first, [CallStart(0, "call_1", "get_time"), CallArguments(0, "{}"), FINISHED])
    follow = parse_responses(
        body(
            instructions="new rules",
            previous_response_id="resp_1",
            input=[{"type": "function_call_output", "call_id": "call_1", "output": "noon"}],
        ),
        store,
    )
    assert follow.messages == (
        Message("system", "new rules"),
        Message("user", "hi"),
        Message("assistant", "", tool_calls=(ToolCall("call_1", "get_time", "{}"),)),
        Message("tool", "noon", tool_call_id="call_1", name="get_time"),
    )
    assert follow.metadata["previous_response_id"] == "resp_1"


def test_the_store_is_bounded_and_store_false_keeps_nothing() -> None:
    store = ResponseStore(limit=2)
    for ident in ("a", "b", "c"):
        store.save(ident, parse_responses(body()), [Text("x"), FINISHED])
    assert "a" not in store and len(store) == 2
    said = refused(body(previous_response_id="a"), "a", store)
    assert said == "Previous response with id 'a' not found."
    store.conversation("b")  # used: now "c" is the oldest
    store.save("d", parse_responses(body()), [FINISHED])
    assert "c" not in store and "b" in store
    store.save("e", parse_responses(body(store=False)), [FINISHED])
    assert "e" not in store
    refused(body(previous_response_id="b"), "b", None)


# ---------------------------------------------------------------- answers

FINISHED = Finish("stop", Usage(9, 4, 3))


def test_the_response_object() -> None:
    completion = parse_responses(body(metadata={"k": "v"}))
    done = answer.response_object(completion, "resp_1", "served", [Text("Hi"), Text("!"), FINISHED])
    assert done["object"] == "response" and done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "Hi!"
    assert done["usage"] == {
        "input_tokens": 9,
        "input_tokens_details": {"cached_tokens": 3},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 13,
    }
    assert done["metadata"] == {"k": "v"}
    cut = answer.response_object(completion, "resp_1", "served", [Text("Hi"), Finish("length", Usage(9, 4))])
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_events_are_numbered_in_order() -> None:
    completion = parse_responses(body(tools=TOOLS))
    stream = answer.ResponseStream(completion, "resp_1", "served")
    events = stream.start()
    for piece in CALLED:
        events += stream.feed(piece)
    assert stream.feed(Text("late")) == []
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(data["type"] == name for name, data in events)
    assert events[-1][0] == "response.completed"
    assert stream.response is not None and [item["type"] for item in stream.response["output"]] == [
        "message",
        "function_call",
        "function_call",
    ]
    assert stream.pieces == CALLED


# --------------------------------------------------- the SDK reads them back

CALLED: list[Piece] = [
    Text("Let me "),
    Text("look."),
    CallStart(0, "call_1", "get_weather"),
    CallArguments(0, '{"city": "Zü'),
    CallArguments(0, 'rich"}'),
    CallStart(1, "call_2", "get_time"),
    CallArguments(1, "{}"),
    Finish("tool_calls", Usage(12, 9, 2)),
]
TEXT: list[Piece] = [Text("Hello"), Text(", wörld"), Finish("stop", Usage(7, 3))]
CUT: list[Piece] = [Text("Hello"), Finish("length", Usage(7, 1))]


def script(completion: Completion) -> list[Piece]:
    if completion.schema is not None:
        return [Text('{"city": "Bern", '), Text('"days": 3}'), Finish("stop", Usage(5, 8))]
    if completion.tools:
        return CALLED
    return CUT if completion.options.max_tokens == 1 else TEXT


def server(store: ResponseStore) -> web.Application:
    async def responses(request: web.Request) -> web.StreamResponse:
        try:
            completion = parse_responses(await request.json(), store)
        except ApiError as error:
            return web.json_response(error.body(), status=error.status)
        pieces, ident = script(completion), answer.new_id()
        if not completion.stream:
            store.save(ident, completion, pieces)
            return web.json_response(answer.response_object(completion, ident, "served", pieces))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        stream = answer.ResponseStream(completion, ident, "served")
        events = stream.start()
        failing = completion.options.max_tokens == 13
        for piece in pieces[:1] if failing else pieces:
            events += stream.feed(piece)
        if failing:
            events += stream.fail("a stage was lost")
            assert stream.fail("again") == [] and stream.feed(pieces[-1]) == []
        for name, data in events:
            await response.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        store.save(ident, completion, stream.pieces)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    return app


@pytest.fixture
async def client() -> AsyncIterator[Any]:
    runner = web.AppRunner(server(ResponseStore()))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        yield sdk
    finally:
        await sdk.close()
        await runner.cleanup()


async def test_sdk_reads_a_text_response(client: Any) -> None:
    response = await client.responses.create(model="m", input="hi", instructions="brief")
    assert response.output_text == "Hello, wörld"
    assert response.status == "completed" and response.model == "served"
    assert response.usage.input_tokens == 7 and response.usage.output_tokens == 3
    assert response.instructions == "brief"


async def test_sdk_reads_function_calls_and_follows_up(client: Any) -> None:
    tools: Any = TOOLS
    response = await client.responses.create(model="m", input="weather?", tools=tools)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("call_1", "get_weather", {"city": "Zürich"}),
        ("call_2", "get_time", {}),
    ]
    assert response.output_text == "Let me look."
    follow = await client.responses.create(
        model="m",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
    )
    assert follow.output_text == "Hello, wörld"
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="m", previous_response_id="resp_nope", input="x")
    assert "resp_nope" in str(caught.value)


async def test_sdk_streams_text(client: Any) -> None:
    async with client.responses.stream(model="m", input="hi") as stream:
        deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == "Hello, wörld"
    assert final.output_text == "Hello, wörld" and final.status == "completed"
    assert final.usage.total_tokens == 10


async def test_sdk_streams_function_calls(client: Any) -> None:
    tools: Any = TOOLS
    async with client.responses.stream(model="m", input="weather?", tools=tools) as stream:
        argument_deltas = [
            event.delta async for event in stream if event.type == "response.function_call_arguments.delta"
        ]
        final = await stream.get_final_response()
    assert "".join(argument_deltas) == '{"city": "Zürich"}{}'
    assert final.output_text == "Let me look."
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [
        ("call_1", "get_weather", '{"city": "Zürich"}'),
        ("call_2", "get_time", "{}"),
    ]


async def test_sdk_reads_a_raw_stream_and_a_cut_reply(client: Any) -> None:
    events = [event async for event in await client.responses.create(model="m", input="hi", stream=True)]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response.output_text == "Hello, wörld"
    cut = [
        e
        async for e in await client.responses.create(model="m", input="hi", max_output_tokens=1, stream=True)
    ]
    assert cut[-1].type == "response.incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"
    whole = await client.responses.create(model="m", input="hi", max_output_tokens=1)
    assert whole.status == "incomplete" and whole.output_text == "Hello"


async def test_sdk_reads_a_stream_that_failed(client: Any) -> None:
    stream = await client.responses.create(model="m", input="hi", max_output_tokens=13, stream=True)
    events = [event async for event in stream]
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed"
    assert events[-1].response.error.message == "a stage was lost"
    assert [item.status for item in events[-1].response.output] == ["incomplete"]


async def test_sdk_parses_structured_output(client: Any) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Forecast(pydantic.BaseModel):
        city: str
        days: int

    response = await client.responses.parse(model="m", input="forecast?", text_format=Forecast)
    assert response.output_parsed == Forecast(city="Bern", days=3)
    assert response.text.format.type == "json_schema" and response.text.format.name == "Forecast"
