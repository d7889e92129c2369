"""Property-based fuzzing of the OpenAI request parser (Hypothesis; no model,
no server: :func:`parse_chat` and :func:`parse_completion` take the body as
``json.loads`` gives it, NaN, infinities, huge integers and lone surrogates
such as ``"\\udfff"`` included, since Python's JSON reads them all).

The contract: any body gives a :class:`Request` or an :class:`ApiError` with
status 400 (whose body the server can write as JSON), never another
exception; and an accepted request is one the pipeline can run: its
sampling, over the inventory's defaults (:class:`RunOptions`) where the
request leaves a value out, is what a stage accepts
(``sampling_problem(...) == ("", "")``), and all of its text (message
contents, prompt, stop strings) can travel on the wire
(``text_problem(text) == ""``; its messages do go through a Tokenize
message). Each property and its budget (``max_examples``; the whole file takes
about 10 s on two cores); the ``@example`` inputs are what the fuzzing found
and the cases around them, kept so that they are always tried:

* ``test_any_json_body`` (400): any JSON value (nested objects and arrays of
  null, booleans, integers of any size, floats with NaN and infinities,
  strings with lone surrogates), to both parsers.
* ``test_any_json_body_in_an_object`` (300): the same inside a JSON object
  whose keys are the real field names.
* ``test_request_shaped_bodies`` (800): bodies built from the real fields
  (messages, prompt, max_tokens, max_completion_tokens, temperature, top_p,
  top_k, seed, stop, stream, stream_options, n, logprobs, tools,
  response_format, the penalties, ...), each value valid, borderline or of
  the wrong type, to both parsers.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from ggufpipe_agent.wire.codec import text_problem
from ggufpipe_agent.wire.protocol import Tokenize, decode_message, encode_message
from ggufpipe_agent.wire.records import SEED_MAX, SEED_MIN, TOP_K_MAX, ChatMessage, sampling_problem
from ggufpipe_tui.core.inventory import RunOptions
from ggufpipe_tui.server.openai_api import (
    MAX_STOPS,
    ApiError,
    parse_chat,
    parse_completion,
)
from ggufpipe_tui.server.request import Completion as Request
from ggufpipe_tui.server.sampling import REFUSED

DEFAULT_RUN = RunOptions()
ROLES = ("system", "developer", "user", "assistant")


def parses_or_refuses(parse: Any, body: Any) -> Request | None:
    """``parse(body)``: the Request, checked, or None for a 400; any other
    exception fails the test."""
    try:
        request = parse(body)
    except ApiError as error:
        assert error.status == 400, (error.status, error.message)
        assert error.message
        json.dumps(error.body())  # what the server writes back (ensure_ascii: surrogates escaped)
        event(f"{parse.__name__}: 400")
        return None
    event(f"{parse.__name__}: accepted")
    check_accepted(request, chat=parse is parse_chat)
    return request


def check_accepted(request: Request, chat: bool) -> None:
    """What the server and the run queue take for granted of a parsed request."""
    assert isinstance(request, Request)
    assert request.chat is chat
    texts = [request.prompt, *request.stop]
    if chat:
        assert request.messages and request.tokens is None and request.prompt == ""
        for message in request.messages:
            assert message.role in ("system", "user", "assistant", "tool")
            assert isinstance(message.content, str)
            texts.append(message.content)
    else:
        assert not request.messages
        if request.tokens is not None:
            assert request.tokens and request.prompt == ""
            assert all(type(t) is int and 0 <= t < 1 << 31 for t in request.tokens)
    for text in texts:
        assert isinstance(text, str)
        assert text_problem(text) == "", text_problem(text)
    assert all(request.stop) and len(request.stop) <= MAX_STOPS
    assert isinstance(request.stream, bool) and isinstance(request.include_usage, bool)
    assert request.stream or not request.include_usage
    options = request.options
    assert options.max_tokens is None or (
        type(options.max_tokens) is int and 1 <= options.max_tokens < 1 << 63
    )
    sampling = (
        DEFAULT_RUN.temperature if options.temperature is None else options.temperature,
        DEFAULT_RUN.top_k if options.top_k is None else options.top_k,
        DEFAULT_RUN.top_p if options.top_p is None else options.top_p,
        DEFAULT_RUN.seed if options.seed is None else options.seed,
    )
    assert sampling_problem(*sampling) == ("", ""), sampling
    assert isinstance(request.shown, str)
    # The text reaches the stages in a Tokenize message: it encodes and decodes.
    turns = tuple(ChatMessage(m.role, m.content) for m in request.messages)
    tokenize = Tokenize(1, "/m.gguf", request.prompt, chat, turns)
    assert decode_message(encode_message(tokenize)) == tokenize


# --------------------------------------------------------------- strategies

surrogate = st.integers(0xD800, 0xDFFF).map(chr)
lone_surrogates = st.one_of(
    st.lists(st.characters() | surrogate, min_size=1, max_size=8).map("".join),
    st.sampled_from(["\udfff", "\ud800", "a\udc80b", "\ud83d\ude00"]),
)
json_text = st.one_of(st.text(max_size=12), lone_surrogates, st.sampled_from(["", "text", "😀"]))
huge = st.sampled_from(
    [
        -(1 << 63) - 1,
        -(1 << 63),
        -1,
        0,
        1,
        (1 << 31) - 1,
        1 << 31,
        (1 << 63) - 1,
        1 << 63,
        10**400,
        -(10**400),
    ]
)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), huge, st.floats(), json_text)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(json_text, inner, max_size=4),
    max_leaves=16,
)


def mostly(
    valid: st.SearchStrategy[Any], odd: st.SearchStrategy[Any] | None = None, one_in: int = 5
) -> st.SearchStrategy[Any]:
    """A valid value, but one time in ``one_in`` an odd one (borderline, or
    any JSON value). Hypothesis favours an integer's bounds: the odd draw is
    the one in the middle."""
    unusual = json_values if odd is None else odd | json_values
    return st.integers(0, one_in - 1).flatmap(lambda i: unusual if i == one_in // 2 else valid)


numbers = st.one_of(st.floats(), st.integers(-3, 3), huge, st.booleans())
text = mostly(st.text(max_size=12), lone_surrogates)
parts = st.lists(
    mostly(
        st.fixed_dictionaries({"type": st.just("text"), "text": text}),
        st.fixed_dictionaries({"type": json_text}),
    ),
    max_size=3,
)
messages = st.lists(
    mostly(
        st.fixed_dictionaries(
            {
                "role": mostly(st.sampled_from(ROLES), st.sampled_from(["tool", "function", "User", ""])),
                "content": mostly(text | parts),
            },
            optional={
                "name": json_text,
                "tool_calls": st.just([]) | json_values,
                "function_call": json_values,
            },
        )
    ),
    min_size=1,
    max_size=4,
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": mostly(json_text),
    "messages": mostly(messages),
    "prompt": mostly(
        text
        | st.lists(text, min_size=1, max_size=1)
        | st.lists(st.integers(0, (1 << 31) - 1), min_size=1, max_size=5),
        st.lists(st.integers() | huge, max_size=3)
        | st.lists(st.lists(json_text | st.integers(0, 9), max_size=2), max_size=1),
    ),
    "max_tokens": mostly(st.integers(1, 4096), st.integers(-2, 0) | huge | numbers),
    "max_completion_tokens": mostly(st.integers(1, 4096), st.integers(-2, 0) | huge | numbers),
    "temperature": mostly(st.floats(0, 2) | st.integers(0, 2), numbers),
    "top_p": mostly(st.floats(0, 1, exclude_min=True), numbers),
    "top_k": mostly(st.integers(0, 200), st.sampled_from([-1, TOP_K_MAX, TOP_K_MAX + 1]) | numbers),
    "seed": mostly(st.integers(SEED_MIN, SEED_MAX), numbers),
    "stop": mostly(
        text | st.lists(text, max_size=4), st.lists(text, min_size=MAX_STOPS, max_size=MAX_STOPS + 2)
    ),
    "stream": mostly(st.booleans(), st.none()),
    "stream_options": mostly(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "response_format": mostly(
        st.just({"type": "text"}), st.sampled_from([{"type": "json_object"}, {}, "text"])
    ),
    "user": json_text,
    **{
        name: mostly(st.sampled_from(allowed), st.just(True) | st.just(2))
        for name, (allowed, _why) in REFUSED.items()
    },
}
FIELD_NAMES = sorted(FIELDS)


@st.composite
def request_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A body with messages or a prompt (or, now and then, both or neither)
    and a few other fields."""
    body = {}
    for name in draw(st.sampled_from([["messages"], ["prompt"], ["messages", "prompt"], []])):
        body[name] = draw(FIELDS[name])
    for name in draw(st.lists(st.sampled_from(FIELD_NAMES), max_size=5, unique=True)):
        body[name] = draw(FIELDS[name])
    return body


# --------------------------------------------------------------- properties


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=json_values)
@example(body=[])
@example(body=math.nan)
def test_any_json_body(body: Any) -> None:
    parses_or_refuses(parse_chat, body)
    parses_or_refuses(parse_completion, body)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(st.sampled_from(FIELD_NAMES) | json_text, json_values, max_size=6))
def test_any_json_body_in_an_object(body: dict[str, Any]) -> None:
    parses_or_refuses(parse_chat, body)
    parses_or_refuses(parse_completion, body)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=request_bodies())
@example(body={**CHAT, "messages": [{"role": [], "content": "hi"}]})  # an unhashable role
@example(body={**CHAT, "messages": [{"role": {"a": 1}, "content": "hi"}]})
@example(body={**CHAT, "temperature": 10**400})  # an integer no float holds
@example(body={**CHAT, "top_p": -(10**400)})
@example(body={"prompt": "\udfff"})
@example(body={**CHAT, "stop": ["a\udc80"]})
@example(body={"prompt": [[[["deep"]]]]})
def test_request_shaped_bodies(body: dict[str, Any]) -> None:
    parses_or_refuses(parse_chat, body)
    parses_or_refuses(parse_completion, body)
