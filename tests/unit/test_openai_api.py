"""The OpenAI API's shapes without a server: requests checked (each refusal
names its field), stop strings applied to streaming text."""

from __future__ import annotations

import pytest

from ggufpipe_tui.server.fields import ApiError, StopScanner
from ggufpipe_tui.server.openai_api import parse_chat, parse_completion
from ggufpipe_tui.server.request import Message, Tool, ToolCall
from ggufpipe_tui.session.runs import RunOverrides

HELLO = [{"role": "user", "content": "Hi"}]


def test_a_chat_request_with_every_supported_field():
    request = parse_chat(
        {
            "model": "anything",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
                },
                {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": "Bye", "name": "ada"},
            ],
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 20,
            "seed": -3,
            "stop": ["\n\n", ""],
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "presence_penalty": 0,
            "user": "someone",
        }
    )
    assert request.messages == (
        Message("system", "Be brief."),
        Message("user", "Hello"),
        Message("assistant", "Hi!"),
        Message("user", "Bye"),
    )
    assert request.options == RunOverrides(
        max_tokens=7, temperature=0.5, top_k=20, top_p=0.9, seed=-3, extra=(("presence_penalty", 0),)
    )
    assert request.stop == ("\n\n",) and request.stream and request.include_usage
    assert request.shown == "Bye"


def test_a_completion_prompt_is_text_or_token_ids():
    assert parse_completion({"prompt": "Once"}).prompt == "Once"
    assert parse_completion({"prompt": ["Once"]}).prompt == "Once"
    assert parse_completion({"prompt": [[5, 6]]}).tokens == (5, 6), "a batch of one"
    request = parse_completion({"prompt": [1, 2, 3], "max_tokens": 4, "stop": "."})
    assert request.tokens == (1, 2, 3) and request.options.max_tokens == 4 and request.stop == (".",)
    assert request.options.temperature is None, "not given: the inventory's"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ([], None, "must be a JSON object"),
        ({}, "messages", "non-empty list"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": ["hi"]}, "messages[0]", "an object"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'robot' is not one of"),
        (
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c1"}]},
            "messages[0].tool_call_id",
            "answers no tool call",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "names the call"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "a string or a list"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
            "text parts",
        ),
        ({"messages": HELLO, "temperature": "hot"}, "temperature", "a number is required"),
        ({"messages": HELLO, "temperature": 3}, "temperature", "not in [0, 2]"),
        ({"messages": HELLO, "top_p": 0}, "top_p", "not in (0, 1]"),
        ({"messages": HELLO, "max_tokens": 0}, "max_tokens", "not in [1,"),
        ({"messages": HELLO, "max_tokens": True}, "max_tokens", "an integer is required"),
        ({"messages": HELLO, "seed": 1.5}, "seed", "an integer is required"),
        ({"messages": HELLO, "n": 17}, "n", "not in [1, 16]"),
        ({"messages": HELLO, "n": True}, "n", "an integer is required"),
        ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools[0].function", "an object with a name"),
        ({"messages": HELLO, "tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
        (
            {
                "messages": HELLO,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
            },
            "tools[0].function.parameters",
            "tool 'f'",
        ),
        (
            {
                "messages": HELLO,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
            "not among the tools (f)",
        ),
        ({"messages": HELLO, "tool_choice": "required"}, "tool_choice", "offers no tools"),
        ({"messages": HELLO, "top_logprobs": 2}, "top_logprobs", "only with logprobs"),
        ({"messages": HELLO, "response_format": {"type": "xml"}}, "response_format.type", "not one of"),
        (
            {
                "messages": HELLO,
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
            },
            "response_format.json_schema.schema.type",
            "not a valid JSON schema",
        ),
        ({"messages": HELLO, "grammar": "root ::= ("}, "grammar", "cannot parse"),
        ({"messages": HELLO, "min_p": 2}, "min_p", "not in [0, 1]"),
        ({"messages": HELLO, "mirostat": 3}, "mirostat", "not an integer in [0, 2]"),
        ({"messages": HELLO, "logit_bias": {"x": 1}}, "logit_bias", "give token ids"),
        ({"messages": HELLO, "post_sampling_probs": True}, "post_sampling_probs", "not supported"),
        ({"messages": HELLO, "stop": [1]}, "stop", "list of strings"),
        ({"messages": HELLO, "stop": ["a"] * 17}, "stop", "at most 16"),
        ({"messages": HELLO, "stream": "yes"}, "stream", "true or false"),
        (
            {"messages": HELLO, "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed with stream",
        ),
        ({"messages": HELLO, "model": 3}, "model", "a string"),
        # What the stages refuse is refused here, by the same definition.
        ({"messages": HELLO, "temperature": float("nan")}, "temperature", "a finite number"),
        ({"messages": HELLO, "top_p": float("inf")}, "top_p", "a finite number"),
        ({"messages": HELLO, "top_k": 1 << 31}, "top_k", "not in [0, 2147483647]"),
        ({"messages": HELLO, "seed": 1 << 63}, "seed", "is not in"),
        # Text that UTF-8 cannot carry to a stage.
        (
            {"messages": [{"role": "user", "content": "a \ud800 b"}]},
            "messages[0].content",
            "lone surrogate U+D800",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
            "messages[0].content[0]",
            "lone surrogate U+DFFF at character 0",
        ),
        ({"messages": HELLO, "stop": ["ok", "\udc80"]}, "stop", "is not UTF-8"),
    ],
)
def test_a_malformed_chat_request_is_refused_by_name(body, param, words):
    with pytest.raises(ApiError) as refused:
        parse_chat(body)
    error = refused.value
    assert error.status == 400 and error.param == param and words in error.message
    assert error.body() == {
        "error": {"message": error.message, "type": "invalid_request_error", "param": param, "code": None}
    }


@pytest.mark.parametrize(
    "prompt", [None, 5, [], ["a", "b"], [[1], [2]], [-1], [1, "a"], "x \udfff y", ["\ud800"]]
)
def test_a_malformed_completion_prompt_is_refused(prompt):
    body = {} if prompt is None else {"prompt": prompt}
    with pytest.raises(ApiError, match="prompt"):
        parse_completion(body)


def stream(scanner: StopScanner, pieces: list[str]) -> str:
    return "".join(scanner.feed(piece) for piece in pieces) + scanner.flush()


def test_stop_strings_cut_the_text_where_one_appears_even_across_pieces():
    scanner = StopScanner(["\n\n", "END"])
    out = [scanner.feed(p) for p in ["one E", "N", "Dtwo"]]
    assert out == ["one ", "", ""] and scanner.stopped == "END" and scanner.flush() == ""
    assert stream(StopScanner(["Paris"]), ["The capital is Par", "is."]) == "The capital is "
    assert stream(StopScanner(["."]), ["a", "b.c"]) == "ab"


def test_a_tail_that_only_looks_like_a_stop_string_goes_out_in_the_end():
    scanner = StopScanner(["END"])
    assert scanner.feed("the E") == "the " and scanner.held == "E"
    assert scanner.feed("ND?") == "" and scanner.stopped
    loose = StopScanner(["END"])
    assert stream(loose, ["the E", "nd", " EN"]) == "the End EN" and not loose.stopped
    assert stream(StopScanner([]), ["a", "b"]) == "ab"


def test_llama_servers_ignore_eos_and_cache_prompt():
    """llama-server's options: generate past the end of text; keep nothing of earlier requests."""
    plain = parse_completion({"prompt": "Hi"})
    assert plain.options.ignore_eos is None and plain.cache_prompt is True
    given = parse_completion({"prompt": "Hi", "ignore_eos": True, "cache_prompt": False})
    assert given.options.ignore_eos is True and given.cache_prompt is False
    for name in ("ignore_eos", "cache_prompt"):
        with pytest.raises(ApiError, match=f"{name}: true or false is required, not 'yes'") as refused:
            parse_chat({"messages": HELLO, name: "yes"})
        assert refused.value.status == 400 and refused.value.param == name


def test_tools_calls_and_their_results_are_taken():
    request = parse_chat(
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [
                {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
            ],
            "tool_choice": {"type": "function", "function": {"name": "weather"}},
            "logprobs": True,
            "top_logprobs": 3,
            "n": 2,
            "min_p": 0.1,
            "repeat_penalty": 1.1,
            "logit_bias": {"42": -100},
        }
    )
    assert request.messages[1] == Message("assistant", "", (ToolCall("c1", "weather", '{"city": "Paris"}'),))
    assert request.messages[2] == Message("tool", "sunny", tool_call_id="c1")
    assert request.tools == (Tool("weather", "", {"type": "object"}),)
    assert (request.tool_choice, request.tool_name) == ("function", "weather")
    assert request.logprobs and request.top_logprobs == 3 and request.n == 2
    assert dict(request.options.extra) == {"min_p": 0.1, "repeat_penalty": 1.1, "logit_bias": ((42, -100.0),)}


def test_a_schema_becomes_a_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    request = parse_chat(
        {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    )
    assert request.schema == schema and "root ::=" in request.grammar
    assert parse_chat({"messages": HELLO, "response_format": {"type": "json_object"}}).schema == {
        "type": "object"
    }


def test_an_error_names_a_large_field_without_its_whole_value():
    with pytest.raises(ApiError) as refused:
        parse_chat({"messages": HELLO, "temperature": "x" * 10_000})
    assert len(refused.value.message) < 200 and "10002 characters" in refused.value.message
