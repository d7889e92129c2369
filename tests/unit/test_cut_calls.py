"""A reply cut by max_tokens says so in every API, calls or not: its last
call may be unfinished (OpenAI and llama-server say "length" too)."""

from __future__ import annotations

from ggufpipe_tui.server import anthropic_api, openai_answer
from ggufpipe_tui.server.api_common import collect
from ggufpipe_tui.server.request import CallArguments, CallStart, Finish, Usage


def pieces(reason: str) -> list:
    return [CallStart(0, "call_1", "f"), CallArguments(0, '{"a": '), Finish(reason, Usage(3, 20))]


def test_openai_finish_reason() -> None:
    assert openai_answer.finish_reason(collect(pieces("length"))) == "length"
    assert openai_answer.finish_reason(collect(pieces("tool_calls"))) == "tool_calls"
    assert openai_answer.finish_reason(collect(pieces("stop"))) == "tool_calls"


def test_anthropic_stop_reason() -> None:
    assert anthropic_api.stop_reason(Finish("length", Usage(3, 20)), calls=True) == ("max_tokens", None)
    assert anthropic_api.stop_reason(Finish("tool_calls", Usage(3, 20)), calls=True) == ("tool_use", None)
