"""The OpenAI API's shapes without a server: requests checked (each refusal
names its field), stop strings applied to streaming text."""

from __future__ import annotations

import pytest

from ggufpipe_agent.wire.protocol import ChatMessage
from ggufpipe_tui.server.openai_api import ApiError, StopScanner, parse_chat, parse_completion
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
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Hello"),
        ChatMessage("assistant", "Hi!"),
        ChatMessage("user", "Bye"),
    )
    assert request.options == RunOverrides(max_tokens=7, temperature=0.5, top_k=20, top_p=0.9, seed=-3)
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
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "'tool' is not one of"),
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
        ({"messages": HELLO, "n": 2}, "n", "not supported"),
        ({"messages": HELLO, "n": True}, "n", "not supported"),
        ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools", "not supported"),
        ({"messages": HELLO, "logprobs": True}, "logprobs", "not supported"),
        ({"messages": HELLO, "response_format": {"type": "json_object"}}, "response_format", "only"),
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
