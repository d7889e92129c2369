"""MiniMax M2 calls: invocations in one block::

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="KEY">VALUE</parameter>
    </invoke>
    </minimax:tool_call>

Values as :mod:`xmlargs` reads and constrains them."""

from __future__ import annotations

from collections.abc import Sequence

from ggufpipe_tui.server.request import Tool
from ggufpipe_tui.server.tools.base import Syntax, markup_family
from ggufpipe_tui.server.tools.grammar import Gbnf, alternatives, choose, literal, think_prefix
from ggufpipe_tui.server.tools.qwen3_coder import strip_newline
from ggufpipe_tui.server.tools.scan import Call, Scan
from ggufpipe_tui.server.tools.schema import property_schema, xml_value
from ggufpipe_tui.server.tools.xmlargs import params_rule

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE, INVOKE_END = '<invoke name="', "</invoke>"
PARAM, PARAM_END = '<parameter name="', "</parameter>"


class MinimaxSyntax(Syntax):
    markers = (OPEN,)

    def read(self, scan: Scan) -> list[Call]:
        scan.expect(OPEN)
        calls = []
        while True:
            scan.ws()
            if not scan.maybe(INVOKE):
                break
            name = scan.until('"')
            scan.expect('"')
            scan.ws()
            scan.expect(">")
            tool = self.tools.get(name)
            args = {}
            while True:
                scan.ws()
                if not scan.maybe(PARAM):
                    break
                key = scan.until('"')
                scan.expect('">')
                raw = scan.value_until(PARAM_END, (PARAM, INVOKE_END, CLOSE))
                args[key] = xml_value(strip_newline(raw), property_schema(tool, key))
            scan.closer(INVOKE_END)
            calls.append(Call(name, args))
        scan.closer(CLOSE)
        return calls


def grammar(tools: Sequence[Tool], name: str | None, parallel: bool, thinking: bool) -> str:
    g = Gbnf()
    calls = []
    for i, tool in choose(tools, name):
        params = params_rule(g, tool, i, (PARAM, '">'), PARAM_END, "\n")
        head = literal(f'{INVOKE}{tool.name}">\n')
        calls.append(g.rule(f"call-{i}", f"{head} {params} {literal(INVOKE_END + chr(10))}"))
    call = alternatives(g, calls)
    body = f"{call}+" if parallel else call
    return g.render(think_prefix(g, thinking) + f"{literal(OPEN + chr(10))} {body} {literal(CLOSE)}")


FAMILY = markup_family("minimax", MinimaxSyntax, grammar)
