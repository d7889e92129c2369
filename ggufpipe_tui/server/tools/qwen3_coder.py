"""Qwen3-Coder's XML calls (also Qwen3.5 and others)::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values as :mod:`xmlargs` reads and constrains them."""

from __future__ import annotations

from collections.abc import Sequence

from ggufpipe_tui.server.request import Tool
from ggufpipe_tui.server.tools.base import Syntax, markup_family
from ggufpipe_tui.server.tools.grammar import Gbnf, alternatives, choose, literal, repeat, think_prefix
from ggufpipe_tui.server.tools.scan import Call, Scan
from ggufpipe_tui.server.tools.schema import property_schema, xml_value
from ggufpipe_tui.server.tools.xmlargs import params_rule

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"


def strip_newline(text: str) -> str:
    """A value less the one newline after its tag and the one before its closer."""
    if text.startswith("\n"):
        text = text[1:]
    return text[:-1] if text.endswith("\n") else text


class Qwen3CoderSyntax(Syntax):
    """Qwen3-Coder at times leaves out ``<tool_call>``: ``<function=NAME>`` of
    a tool offered opens a call too (as llama.cpp takes it)."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        super().__init__(tools)
        self.markers = (OPEN, *(f"{FUNCTION}{t.name}>" for t in tools))

    def read(self, scan: Scan) -> list[Call]:
        wrapped = scan.maybe(OPEN)
        scan.ws()
        scan.expect(FUNCTION)
        name = scan.until(">").strip()
        scan.expect(">")
        tool = self.tools.get(name)
        args = {}
        while True:
            scan.ws()
            if not scan.maybe(PARAM):
                break
            key = scan.until(">").strip()
            scan.expect(">")
            raw = scan.value_until(PARAM_END, (PARAM, FUNCTION_END, CLOSE))
            args[key] = xml_value(strip_newline(raw), property_schema(tool, key))
        scan.closer(FUNCTION_END)
        if wrapped:
            scan.ws()
            scan.closer(CLOSE)
        return [Call(name, args)]


def grammar(tools: Sequence[Tool], name: str | None, parallel: bool, thinking: bool) -> str:
    g = Gbnf()
    calls = []
    for i, tool in choose(tools, name):
        params = params_rule(g, tool, i, (PARAM, ">\n"), "\n" + PARAM_END, "\n")
        head = literal(f"{OPEN}\n{FUNCTION}{tool.name}>\n")
        calls.append(g.rule(f"call-{i}", f"{head} {params} {literal(FUNCTION_END + chr(10) + CLOSE)}"))
    call = alternatives(g, calls)
    return g.render(think_prefix(g, thinking) + repeat(call, parallel, literal("\n")))


FAMILY = markup_family("qwen3-coder", Qwen3CoderSyntax, grammar)
