"""Kimi K2 calls: a section of calls, each with the model's own id
``functions.NAME:INDEX`` and JSON arguments::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>

The call keeps the model's id: Kimi's template writes ids back verbatim, so a
call's id in the history is the one the model was trained to see."""

from __future__ import annotations

from collections.abc import Sequence

from ggufpipe_tui.server.request import Tool
from ggufpipe_tui.server.tools.base import Syntax, markup_family
from ggufpipe_tui.server.tools.grammar import Gbnf, alternatives, choose, literal, think_prefix
from ggufpipe_tui.server.tools.scan import Call, Scan, arguments_object

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def name_of(call_id: str) -> str:
    """``functions.NAME:3`` -> NAME."""
    name = call_id.removeprefix("functions.")
    head, colon, tail = name.rpartition(":")
    return head if colon and tail.isdigit() else name


class KimiSyntax(Syntax):
    markers = (SECTION, CALL, SECTION_END)

    def read(self, scan: Scan) -> list[Call]:
        if scan.maybe(SECTION_END):  # the end of a section whose calls streamed
            return []
        section = scan.maybe(SECTION)
        calls = []
        while True:
            scan.ws()
            if not scan.maybe(CALL):
                break
            call_id = scan.until(ARGS).strip()
            scan.expect(ARGS)
            args = arguments_object(scan.json())
            scan.ws()
            scan.closer(CALL_END)
            calls.append(Call(name_of(call_id), args, call_id))
            if not section:
                return calls
        scan.closer(SECTION_END)
        return calls

    def opening(self, scan: Scan) -> tuple[str, str]:
        scan.maybe(SECTION)
        scan.ws()
        scan.expect(CALL)
        call_id = scan.until(ARGS).strip()
        scan.expect(ARGS)
        scan.object_next()
        return name_of(call_id), call_id

    def closing(self, scan: Scan) -> None:
        scan.ws()
        scan.closer(CALL_END)


def grammar(tools: Sequence[Tool], name: str | None, parallel: bool, thinking: bool) -> str:
    g = Gbnf()
    calls = []
    for i, tool in choose(tools, name):
        head = f"{literal(CALL + 'functions.' + tool.name + ':')} [0-9]+ {literal(ARGS)}"
        calls.append(g.rule(f"call-{i}", f"{head} {g.arguments(tool, i)} {literal(CALL_END)}"))
    call = alternatives(g, calls)
    body = f"{call}+" if parallel else call
    return g.render(think_prefix(g, thinking) + f"{literal(SECTION)} {body} {literal(SECTION_END)}")


FAMILY = markup_family("kimi-k2", KimiSyntax, grammar)
